"""The tool a CPU user compares swiftwrite with, run beside it by `swiftwrite bench` on the same GGUF and the same
prompt ids: llama.cpp's own generation loop (llama-cpp-python's high-level `Llama`), plain and with its prompt
lookup. Its sampler is its own (repeat penalty over its last-n window, min-p, its own seeded RNG), so its text
differs from ours: the bench puts each speed beside the Distinct-n and the longest repeat of that method's own text.
"""

from __future__ import annotations

import time
from pathlib import Path

from . import ggmlmodel

LOOKUP_TOKENS = 2  # llama.cpp's prompt lookup drafts this many; 2 was its best setting here (0.95x at 2, 0.73x at 10)


def load_llamacpp(gguf: Path, threads: int, context: int, lookup: bool = False):
    """A `llama_cpp.Llama` on the GGUF with the defaults a user gets, `threads` threads, room for `context` tokens."""
    llama_cpp = ggmlmodel.binding()
    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # part of the optional binding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                           last_n_tokens_size=256, seed=0, verbose=False, draft_model=draft)


def llamacpp_generate(llm, ids: list[int], n: int, setting: dict) -> tuple[float, list[int]]:
    """(seconds, tokens) of `n` new tokens after `ids`, with the bench setting's temperature, min-p and penalty.
    End-of-text does not stop it: every method writes exactly `n` tokens."""
    out: list[int] = []
    llm.reset()
    # The prompt first, untimed, as the bench's swiftwrite methods are timed after their prefill. generate() then
    # finds it in the cache and evaluates the prompt's last token again: the first step, as our engine's first
    # step forwards the last prompt token (the root)
    llm.eval(ids)
    t = time.perf_counter()
    for tok in llm.generate(ids, temp=setting["temperature"], top_k=0 if setting["temperature"] > 0 else 1, top_p=1.0,
                            min_p=setting["min_p"], repeat_penalty=setting["penalty"], reset=True):
        out.append(int(tok))
        if len(out) == n:
            break
    return time.perf_counter() - t, out
