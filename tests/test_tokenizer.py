"""The tokenizer a run opens (models/tokenizer.py): transformers' the first time, kept, then read back without
transformers, giving the same ids, text and chat prompt; a tokenizer transformers treats with code of its own, or
a kept file that is damaged, loads through transformers as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from swiftwrite.io import prompt as prompt_mod
from swiftwrite.models import tokenizer as tokenizer_mod
from swiftwrite.models.tokenizer import LeanTokenizer, differences, open_tokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# what else transformers gives a template: a namespace, tojson, loop controls, the generation tag, the special
# tokens as variables, raise_exception on a branch not taken
RICH = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}{% set ns.n = ns.n + 1 %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}"
        "<|im_start|>{{ m['role'] }} {{ m | tojson }} #{{ ns.n }}\n{% generation %}{{ m['content'] | trim }}"
        "{% endgeneration %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% endif %}{{ eos_token }}")
TEXTS = ["", "The keeper climbed the stairs.", "  two  spaces\n\nand\ttabs ", "<|im_start|>user\nhi<|im_end|>",
         "café naïve 日本 🙂", "1234567890" * 5]


def tokenizer_dir(path: Path, template: str | None = CHATML, **settings) -> Path:
    """A byte-level BPE tokenizer with a few merges and ChatML's special tokens, saved as transformers saves one."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("e", "r"), ("Ġ", "k")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>", chat_template=template,
                                   **settings)
    fast.save_pretrained(str(path))
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def kept_files(home: Path) -> list[Path]:
    return sorted((home / "tokenizers").glob("*.json"))


def assert_same(lean, want) -> None:
    """The calls swiftwrite makes, on `lean` and on transformers' `want`: the same answers."""
    n = len(want)
    assert len(lean) == n and lean.get_vocab() == want.get_vocab()
    assert lean.convert_ids_to_tokens(range(n)) == want.convert_ids_to_tokens(list(range(n)))
    assert lean.batch_decode([[i] for i in range(n)]) == want.batch_decode([[i] for i in range(n)])
    assert (lean.eos_token_id, lean.pad_token_id) == (want.eos_token_id, want.pad_token_id)
    assert sorted(lean.all_special_ids) == sorted(want.all_special_ids)
    for text in TEXTS:
        for special in (True, False):
            ids = lean(text, add_special_tokens=special)["input_ids"]
            assert ids == list(want(text, add_special_tokens=special)["input_ids"]), text
            assert lean.decode(ids, skip_special_tokens=special) == want.decode(ids, skip_special_tokens=special)
        assert prompt_mod.prompt_ids(lean, text, raw=False) == prompt_mod.prompt_ids(want, text, raw=False)
        assert prompt_mod.prompt_ids(lean, text, raw=True) == prompt_mod.prompt_ids(want, text, raw=True)
    if want.chat_template is None:
        assert lean.chat_template is None
        return
    chat = [{"role": "user", "content": TEXTS[3]}, {"role": "assistant", "content": " sure "}]
    for header in (True, False):
        assert lean.apply_chat_template(chat, add_generation_prompt=header, tokenize=False) == \
            want.apply_chat_template(chat, add_generation_prompt=header, tokenize=False)


@pytest.mark.parametrize("template", [CHATML, RICH, None], ids=["chatml", "namespace-tojson-generation", "none"])
def test_the_second_open_reads_the_kept_tokenizer_and_answers_as_transformers(home, tmp_path, monkeypatch,
                                                                              template):
    path = tokenizer_dir(tmp_path / "tok", template)
    first = open_tokenizer(path)
    assert not isinstance(first, LeanTokenizer)  # the first open is transformers', as before
    assert len(kept_files(home)) == 1

    def no_transformers(p):
        raise AssertionError("the kept tokenizer was loaded through transformers")

    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", no_transformers)
    second = open_tokenizer(path)
    assert isinstance(second, LeanTokenizer)
    assert_same(second, AutoTokenizer.from_pretrained(str(path)))


def test_a_tokenizer_that_cleans_up_spaces_is_kept_as_transformers_only(home, tmp_path):
    path = tokenizer_dir(tmp_path / "tok", clean_up_tokenization_spaces=True)
    for _ in range(2):
        assert not isinstance(open_tokenizer(path), LeanTokenizer)
    [kept] = kept_files(home)
    assert json.loads(kept.read_text()) == {"backend": None, "why": "it cleans up spaces after decoding or splits "
                                                                     "special tokens"}


def test_a_kept_tokenizer_that_answers_otherwise_is_not_kept(home, tmp_path, monkeypatch):
    """The check before keeping: a kept tokenizer whose chat prompt differs (here a template that reads a variable
    transformers passes and the kept one is told to drop) is kept as transformers only, with the reason."""
    path = tokenizer_dir(tmp_path / "tok", RICH)
    real = LeanTokenizer.__init__

    def drop_bos(self, kept):
        real(self, kept)
        self.special_tokens_map.pop("bos_token")

    monkeypatch.setattr(LeanTokenizer, "__init__", drop_bos)
    assert not isinstance(open_tokenizer(path), LeanTokenizer)
    [kept] = kept_files(home)
    assert json.loads(kept.read_text()) == {"backend": None, "why": "the kept tokenizer differs on the chat prompt"}
    monkeypatch.setattr(LeanTokenizer, "__init__", real)
    assert not isinstance(open_tokenizer(path), LeanTokenizer)  # the verdict is kept, not tried at every start


def test_a_template_that_fails_on_the_probe_is_not_kept_and_the_run_goes_on(home, tmp_path):
    """A template that refuses the check's conversation (one that wants a system message first): the open still
    gives transformers' tokenizer, and the reason is kept; nothing is raised at start-up."""
    path = tokenizer_dir(tmp_path / "tok", "{% if messages[0]['role'] != 'system' %}"
                         "{{ raise_exception('a system message comes first') }}{% endif %}" + CHATML)
    for _ in range(2):
        assert not isinstance(open_tokenizer(path), LeanTokenizer)
    [kept] = kept_files(home)
    assert json.loads(kept.read_text()) == {"backend": None,
                                            "why": "the check failed (a system message comes first)"}


@pytest.mark.parametrize("damage", ["not json", '{"backend": "{\\"version\\": 7}"}', '{"backend": "x"}', "[]"])
def test_a_damaged_kept_file_is_built_again(home, tmp_path, damage):
    path = tokenizer_dir(tmp_path / "tok")
    open_tokenizer(path)
    [kept] = kept_files(home)
    kept.write_text(damage)
    assert not isinstance(open_tokenizer(path), LeanTokenizer)  # transformers again, and kept again
    lean = open_tokenizer(path)
    assert isinstance(lean, LeanTokenizer)
    assert_same(lean, AutoTokenizer.from_pretrained(str(path)))


def test_each_tokenizer_is_kept_under_its_own_files(home, tmp_path):
    a = tokenizer_dir(tmp_path / "a")
    b = tokenizer_dir(tmp_path / "b", RICH)
    c = tokenizer_dir(tmp_path / "c")  # a's files in another folder: the same tokenizer, kept once
    for p in (a, b, c):
        open_tokenizer(p)
    assert len(kept_files(home)) == 2
    lean_b = open_tokenizer(b)
    assert lean_b.chat_template == RICH and open_tokenizer(a).chat_template == CHATML


def test_the_default_models_kept_tokenizer_answers_as_transformers(default_model_dir, home):
    """The model every README command runs: the kept tokenizer on the novel template's prompt and on the whole
    vocabulary, against AutoTokenizer."""
    want = AutoTokenizer.from_pretrained(str(default_model_dir))
    assert not isinstance(open_tokenizer(default_model_dir), LeanTokenizer)
    lean = open_tokenizer(default_model_dir)
    assert isinstance(lean, LeanTokenizer) and differences(want, lean) is None
    assert_same(lean, want)
    brief = prompt_mod.apply_template("A lighthouse keeper finds a letter.", "novel")
    assert prompt_mod.prompt_ids(lean, brief, False) == prompt_mod.prompt_ids(want, brief, False)
