"""The tokenizer a run opens: transformers' the first time, then the same tokenizer without transformers.

transformers costs every start about 0.65 s before the first token (its import scans its own source tree, then the
tokenizer class sets itself up), where the Rust tokenizer it wraps loads in 0.1 s. For a generic tokenizer (the
class tokenizer.json describes whole: TokenizersBackend, PreTrainedTokenizerFast, as the store writes every model),
what transformers adds on top is data: the Rust tokenizer's state after transformers has set it up (its special
tokens added, its post-processor updated), the special ids, and the chat template rendered in a Jinja sandbox.
The first start keeps that data in $SWIFTWRITE_HOME/tokenizers/, after checking that the kept tokenizer gives what
transformers gives on a probe (every id's token and text, encodings of awkward text, the chat prompt), and later
starts read it back. A tokenizer that fails the check, or that transformers treats with code of its own (another
class, spaces cleaned up after decoding, special tokens split), is kept as "use transformers" and loads as before.

A cache, never a record: the key is a hash of the tokenizer's files and the versions of transformers and tokenizers,
and a kept file that cannot be read is built again.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from importlib import metadata
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ..base.durable import atomic_write
from ..base.errors import first_line
from ..base.paths import home
from .modelfiles import GENERIC_TOKENIZERS, load_tokenizer

# the files transformers reads for a tokenizer; what is kept depends on their bytes, whichever of them a model has
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
         "special_tokens_map.json", "added_tokens.json", "tokenizer.model")
# text that tends to part two tokenizers: special tokens written as text, accents, CJK, emoji, runs of spaces
PROBE = ("", "Hello", " leading space", "A keeper's café <|im_start|> at 3:05, naïve\n\n  spaces\t.",
         "<|endoftext|><s></s><|im_end|>", "日本語の文章。 🙂 ÿ\u00a0\u200b", "x" * 40 + " 1234567890 -> ...")


class LeanTokenizer:
    """The part of a transformers tokenizer swiftwrite calls, on the kept Rust tokenizer: the same ids and text."""

    def __init__(self, kept: dict):
        self._tokenizer = Tokenizer.from_str(kept["backend"])
        self._tokenizer.no_truncation()  # transformers switches both off for a call that asks for neither
        self._tokenizer.no_padding()
        self.eos_token_id = kept["eos_token_id"]
        self.pad_token_id = kept["pad_token_id"]
        self.all_special_ids = list(kept["all_special_ids"])
        self.chat_template = kept["chat_template"]
        self.special_tokens_map = dict(kept["special_tokens_map"])
        self.clean_up_tokenization_spaces = False  # a tokenizer that cleans up is never kept
        self._template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, seqs, skip_special_tokens: bool = False) -> list[str]:
        """As transformers' (each sequence decoded alone), in one call into Rust rather than one per sequence."""
        seqs = [[int(i) for i in s] for s in seqs]
        return self._tokenizer.decode_batch(seqs, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids) -> list[str | None]:
        return [self._tokenizer.id_to_token(int(i)) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True):
        """The chat prompt as transformers renders it (render_jinja_template, one conversation, no tools), then
        encoded without special tokens of the tokenizer's own, as transformers encodes it."""
        if self._template is None:
            self._template = chat_environment().from_string(self.chat_template)
        text = self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


# ---------------------------------------------------------------------------------------------------------
# The chat template's environment: what transformers gives a template (chat_template_utils), built here.


class _Generation(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks the assistant's part for training masks; rendering keeps its
    text as it is, which is all transformers does with it when no mask is asked for."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, as transformers' does (a template may not reach CPython's
    internals through one)."""

    def __init__(*args, **kwargs):  # Jinja's own signature trick: `namespace(self=…)` stays a plain attribute
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace")


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    # tojson without Jinja's HTML escaping, with json.dumps' options
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=dict, namespace=_Namespace)
    return env


# ---------------------------------------------------------------------------------------------------------
# Kept once, read back after.


def open_tokenizer(path: Path):
    """The tokenizer of the model in `path`: the kept one where this tokenizer was kept, else transformers' (and the
    check that keeps it, or keeps the reason it cannot be)."""
    key = _key(path)
    file = home() / "tokenizers" / f"{key}.json" if key else None
    kept = _read(file) if file else None
    if kept is not None and kept.get("backend"):
        try:
            return LeanTokenizer(kept)
        except Exception:  # noqa: BLE001 - a damaged entry (tokenizers raises a bare Exception): built again below
            kept = None
    tok = load_tokenizer(path)
    if file is not None and kept is None:
        try:
            data = json.dumps(snapshot(tok)).encode()
            file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(file, data, shared=True)
        except OSError:
            pass  # a cache we cannot write costs transformers' load again next time
    return tok


def snapshot(tok) -> dict:
    """What LeanTokenizer needs of transformers' tokenizer `tok`, or {"backend": None, "why": …} where the kept
    one would not give the same ids and text."""
    why = _unkeepable(tok)
    if why:
        return {"backend": None, "why": why}
    kept = {"backend": tok.backend_tokenizer.to_str(), "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "all_special_ids": list(tok.all_special_ids),
            "chat_template": tok.chat_template, "special_tokens_map": dict(tok.special_tokens_map)}
    try:
        differs = differences(tok, LeanTokenizer(kept))
    except Exception as e:  # noqa: BLE001 - a template or tokenizer that fails on the probe, in either: not kept
        return {"backend": None, "why": f"the check failed ({first_line(e)})"}
    return {"backend": None, "why": f"the kept tokenizer differs on {differs}"} if differs else kept


def _unkeepable(tok) -> str | None:
    if type(tok).__name__ not in GENERIC_TOKENIZERS:
        return f"{type(tok).__name__} has code of its own"
    if tok.clean_up_tokenization_spaces or getattr(tok, "split_special_tokens", False):
        return "it cleans up spaces after decoding or splits special tokens"
    if tok.chat_template is not None and not isinstance(tok.chat_template, str):
        return "it has several named chat templates"
    return None


def differences(tok, lean: LeanTokenizer) -> str | None:
    """The first thing `lean` does otherwise than transformers' `tok`, None when nothing does: every id's token and
    text, the vocabulary, the encodings and decodings of PROBE, the chat prompt with and without its header."""
    n = len(tok)
    if len(lean) != n or lean.get_vocab() != tok.get_vocab():
        return "the vocabulary"
    ids = list(range(n))
    if lean.convert_ids_to_tokens(ids) != tok.convert_ids_to_tokens(ids):
        return "the tokens of the ids"
    if lean.batch_decode([[i] for i in ids]) != tok.batch_decode([[i] for i in ids]):
        return "the text of each id"
    for text in PROBE:
        for special in (True, False):
            got = lean(text, add_special_tokens=special)["input_ids"]
            if got != list(tok(text, add_special_tokens=special)["input_ids"]):
                return f"the encoding of {text!r}"
            if lean.decode(got, special) != tok.decode(got, skip_special_tokens=special):
                return f"the decoding of {text!r}"
    if tok.chat_template is not None:
        for header in (True, False):
            chat = [{"role": "user", "content": PROBE[3]}]
            want = tok.apply_chat_template(chat, add_generation_prompt=header, tokenize=False)
            if lean.apply_chat_template(chat, add_generation_prompt=header, tokenize=False) != want:
                return "the chat prompt"
    return None


def _key(path: Path) -> str | None:
    """A hash of the tokenizer's files and of the two libraries' versions; None where there is no tokenizer.json
    (transformers converts another format at every load) or a file cannot be read."""
    if not (path / "tokenizer.json").is_file():
        return None
    h = hashlib.sha256()
    try:
        for name in FILES:
            if (path / name).is_file():
                h.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\0")
        versions = f"transformers {metadata.version('transformers')} tokenizers {metadata.version('tokenizers')}"
        h.update(versions.encode())
    except (OSError, metadata.PackageNotFoundError):
        return None
    return h.hexdigest()[:32]


def _read(file: Path) -> dict | None:
    try:
        kept = json.loads(file.read_bytes())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) and "backend" in kept else None
