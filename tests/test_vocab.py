"""The ids the sampler suppresses until --tokens are written: the model's and the tokenizer's end ids, only those the
model can write, read from the tokenizer once; and each id's text, which the DRY breakers are found in."""

from __future__ import annotations

from types import SimpleNamespace

from swiftwrite.decoding.vocab import decode_each, suppressed_ids
from swiftwrite.models.modelfiles import load_tokenizer


class Tok:
    """A tokenizer's surface as suppressed_ids reads it; counts how often its vocabulary is built."""

    def __init__(self, vocab: dict[str, int], eos: int | None, pad: int | None = None):
        self.vocab, self.eos_token_id, self.pad_token_id, self.built = vocab, eos, pad, 0

    def get_vocab(self):
        self.built += 1
        return dict(self.vocab)


def test_end_ids_within_the_model_are_suppressed_and_one_past_it_is_not():
    mcfg = SimpleNamespace(eos_token_ids=(2,), vocab_size=100)
    tok = Tok({"<|im_end|>": 7, "<|endoftext|>": 105, "hello": 9}, eos=105, pad=3)  # 105: added past the embeddings
    assert suppressed_ids(tok, mcfg) == (2, 3, 7)
    assert suppressed_ids(None, mcfg) == (2,)


def test_the_vocabulary_is_read_once_per_tokenizer():
    mcfg = SimpleNamespace(eos_token_ids=(), vocab_size=50)
    tok = Tok({"<|eot_id|>": 4}, eos=None)
    for _ in range(5):
        assert suppressed_ids(tok, mcfg) == (4,)
    assert tok.built == 1


def test_each_ids_text_is_what_batch_decode_gives_with_and_without_the_clean_up_of_spaces(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    n = len(tok)
    assert not tok.clean_up_tokenization_spaces  # the Rust batch decode's case
    assert decode_each(tok, n) == tok.batch_decode([[i] for i in range(n)])
    tok.clean_up_tokenization_spaces = True  # " ." -> "." after decoding: transformers' own path, one id at a time
    assert decode_each(tok, n) == tok.batch_decode([[i] for i in range(n)])
