"""The tool a CPU user compares swiftwrite with, run beside it by `swiftwrite bench` on the same GGUF and the same
prompt ids: llama.cpp's own generation loop (llama-cpp-python's high-level `Llama`), plain and with its prompt
lookup. Its sampler is its own (repeat penalty over its last-n window, min-p, its own seeded RNG), so its text
differs from ours: the bench puts each speed beside the Distinct-n and the longest repeat of that method's own text.
"""

from __future__ import annotations

import time
from pathlib import Path

from . import ggmlbinding

LOOKUP_TOKENS = 2  # llama.cpp's prompt lookup drafts this many; 2 was its best setting here (0.95x at 2, 0.73x at 10)


def load_llamacpp(gguf: Path, threads: int, context: int, lookup: bool = False, flash_attn: bool = False):
    """A `llama_cpp.Llama` on the GGUF with the defaults a user gets (flash attention off: the binding's default),
    `threads` threads, room for `context` tokens."""
    llama_cpp = ggmlbinding.binding()
    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # part of the optional binding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                           last_n_tokens_size=256, seed=0, verbose=False, draft_model=draft, flash_attn=flash_attn)


def llamacpp_generate(llm, ids: list[int], n: int, setting: dict) -> tuple[float, list[int]]:
    """(seconds, tokens) of `n` new tokens after `ids`, with the bench setting's temperature, min-p and penalty.
    End-of-text does not stop it: every method writes exactly `n` tokens."""
    out: list[int] = []
    llm.reset()
    # The prompt first, untimed, as the bench's swiftwrite methods are timed after their prefill. generate() then
    # finds it in the cache and samples the first token from the prompt's logits: n tokens cost it n - 1 steps
    # where our engine forwards the last prompt token (the root) first, n steps (0.05 % of 2,000 tokens)
    llm.eval(ids)
    t = time.perf_counter()
    for tok in llm.generate(ids, temp=setting["temperature"], top_k=0 if setting["temperature"] > 0 else 1, top_p=1.0,
                            min_p=setting["min_p"], repeat_penalty=setting["penalty"], reset=True):
        out.append(int(tok))
        if len(out) == n:
            break
    return time.perf_counter() - t, out


def llamacpp_long(llm, ids: list[int], n: int, setting: dict, last_n: int = 256) -> tuple[float, list[int], int]:
    """(seconds, tokens, context shifts) of `n` new tokens after `ids`, past the context's end as llama.cpp's own
    command-line tool goes past it (--context-shift): keep the prompt, drop the older half of what follows, and move
    the rest down (llama.cpp shifts the keys' rotary positions in place; nothing is computed again). The sampler is
    llama.cpp's chain with the setting's repeat penalty over the last `last_n` tokens, min-p and temperature, as
    `llamacpp_generate` asks of the high-level loop; the prompt's prefill is outside the time, as there."""
    lib = ggmlbinding.binding()
    ctx, vocab = llm.ctx, llm.n_vocab()
    mem, n_ctx = lib.llama_get_memory(ctx), lib.llama_n_ctx(ctx)
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    parts = [lib.llama_sampler_init_penalties(vocab, last_n, setting["penalty"], 0.0, 0.0)]
    if setting["temperature"] > 0:
        parts += [lib.llama_sampler_init_min_p(setting["min_p"], 1), lib.llama_sampler_init_temp(setting["temperature"]),
                  lib.llama_sampler_init_dist(0)]
    else:
        parts.append(lib.llama_sampler_init_greedy())
    for p in parts:
        lib.llama_sampler_chain_add(chain, p)  # the chain owns them from here
    try:
        llm.reset()
        lib.llama_memory_clear(mem, True)
        body = ids[:-1]  # the prompt but its last token (the first step's input), untimed
        for a in range(0, len(body), llm.n_batch):
            part = (lib.llama_token * len(body[a : a + llm.n_batch]))(*body[a : a + llm.n_batch])  # kept alive:
            if lib.llama_decode(ctx, lib.llama_batch_get_one(part, len(part))) != 0:  # the batch only points at it
                raise RuntimeError("llama_decode failed on the prompt")
        for t in ids[-last_n:]:
            lib.llama_sampler_accept(chain, t)  # the penalty's window starts with the prompt's end, as in generate()
        out, shifts, past, tok = [], 0, len(ids) - 1, ids[-1]
        one = (lib.llama_token * 1)()
        t0 = time.perf_counter()
        while len(out) < n:
            if past + 1 >= n_ctx:  # as llama.cpp's tool: no room for the next token
                keep = len(ids)
                drop = (past - keep) // 2
                lib.llama_memory_seq_rm(mem, 0, keep, keep + drop)
                lib.llama_memory_seq_add(mem, 0, keep + drop, past, -drop)
                past -= drop
                shifts += 1
            one[0] = tok
            if lib.llama_decode(ctx, lib.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError(f"llama_decode failed at token {len(out)}")
            past += 1
            tok = lib.llama_sampler_sample(chain, ctx, -1)  # also accepts it into the penalty's window
            out.append(int(tok))
        return time.perf_counter() - t0, out, shifts
    finally:
        lib.llama_sampler_free(chain)
