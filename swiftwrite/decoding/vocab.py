"""What the sampler needs to know of the tokenizer's vocabulary, as token ids: the ids that end a text, the ids
whose text holds a DRY breaker, and every id's bytes (for banned phrases). Each scan of the whole vocabulary is done
once per tokenizer, not once per engine (bench and the long-run probe build one engine per method).
"""

from __future__ import annotations

import functools

from .bans import token_bytes

END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


def suppressed_ids(tok, mcfg) -> tuple[int, ...]:
    """The ids that end a text: the model configuration's, the tokenizer's end and pad ids, and the chat formats'
    end tokens this vocabulary has. Without a tokenizer (ids-only callers such as bench/gpu_check.py with random
    weights): the configuration's."""
    ids = set(mcfg.eos_token_ids)
    if tok is not None:
        ids |= set(_tokenizer_end_ids(tok))
    # a tokenizer may add an end token past the model's embeddings (transformers' GGUF tokenizer adds <|endoftext|>
    # where the file lacks it): the model never writes it, and an index past the logits would fail
    return tuple(sorted(i for i in ids if 0 <= i < mcfg.vocab_size))


@functools.lru_cache(maxsize=4)
def _tokenizer_end_ids(tok) -> tuple[int, ...]:
    """The tokenizer's end and pad ids and the chat formats' end tokens it has. Its vocabulary is a dict built anew
    on each get_vocab() (~0.1 s for 49,152 ids): read once per tokenizer, not once per engine and end token."""
    ids = {int(t) for t in (tok.eos_token_id, getattr(tok, "pad_token_id", None)) if t is not None}
    vocab = tok.get_vocab()
    ids.update(int(vocab[name]) for name in END_TOKENS if name in vocab)
    return tuple(sorted(ids))


@functools.lru_cache(maxsize=4)
def breaker_ids(tok, strings: tuple[str, ...], vocab: int) -> tuple[int, ...]:
    """Every id whose text holds one of `strings` (a newline is inside "\\n\\n" and ".\\n" tokens too)."""
    texts = decode_each(tok, min(vocab, len(tok)))
    return tuple(i for i, t in enumerate(texts) if any(b in t for b in strings))


def decode_each(tok, n: int) -> list[str]:
    """The text of each of the first `n` ids alone, as `tok.batch_decode` gives it. transformers decodes a batch one
    id at a time in Python (0.42 s for SmolLM2's 49,152 ids, at every start); where its decode is the Rust tokenizer's
    with nothing done after it (no clean-up of spaces), the Rust batch decode gives the same strings (0.16 s)."""
    fast = getattr(tok, "_tokenizer", None)
    if fast is None or getattr(tok, "clean_up_tokenization_spaces", True) or not hasattr(fast, "decode_batch"):
        return tok.batch_decode([[i] for i in range(n)])
    return fast.decode_batch([[i] for i in range(n)], skip_special_tokens=False)


@functools.lru_cache(maxsize=4)
def vocab_bytes(tok, vocab: int) -> list[bytes]:
    return token_bytes(tok, vocab)
