"""CUDA graphs for the verification and decoding forwards.

A forward of the 135M default model launches ~450 small kernels; on a GPU the launches, not the arithmetic,
take most of a step. A CUDA graph records them once and replays them with one call. That needs every shape
and address fixed, so a tree of n nodes is padded to the next bucket B in BUCKETS (a padded node is token 0
at the root's position that sees the cache and itself; its logits are dropped and its K/V slot lies past the
committed ones, so the next step overwrites it), the committed length is read from a one-element tensor, and
the whole step runs through `LeanModel.forward_static` with the Triton tree kernel. One graph per bucket,
captured on first use against one KV cache.

`GraphedModel` wraps a LeanModel behind the same interface; forwards it cannot replay (prefill chunks over
64 tokens, draft forwards over a partial cache, another cache) go to the plain forward. With `capture=False`
the bucket's static forward runs eagerly instead of from a graph: the same padded computation, which is how
the padding and bookkeeping are tested on a CPU (under Triton's interpreter). Capture itself needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import KVCache, LeanModel, check_positions

# the last: the tree kernel's MAX_NODES (kernels/tree_attention.py; a test holds them equal). The kernel module is not
# imported here: it imports triton (0.3 s and a 66 MB library), and every run imports this module, graphs or not; a
# GraphedModel reaches the kernel through its model (model.gpu.tree), which it cannot be made without.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WARMUP = 2  # eager runs before a capture: compile the Triton kernel for this size, settle the allocator


def bucket_for(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


@dataclass
class _Bucket:
    ids: torch.Tensor  # [B] token ids
    pos: torch.Tensor  # [B] absolute positions
    bits: torch.Tensor  # [B] ancestry bitmasks
    alone: torch.Tensor  # [B] each node seeing only itself: what a padded node keeps
    replay: object = None  # () -> (logits [B, vocab], hidden [B, hidden]); a captured graph lives in its closure


class GraphedModel:
    def __init__(self, model: LeanModel, capture: bool | None = None):
        if model.gpu.tree is None:
            raise ValueError("CUDA graphs need the Triton tree kernel (the static forward is built on it)")
        self.model = model
        self.capture = model.device.type == "cuda" if capture is None else capture
        if self.capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self._cache: KVCache | None = None
        self._buckets: dict[int, _Bucket] = {}
        self._length = torch.zeros(1, dtype=torch.long, device=model.device)
        self.replays = 0  # forwards served from a bucket (graph or, without capture, its static forward)
        self.passthrough = 0  # forwards handed to the plain forward

    def __getattr__(self, name):  # cfg, device, dtype, embed, lm_head, gpu ...: the wrapped model's
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def new_cache(self, capacity: int) -> KVCache:
        return self.model.new_cache(capacity)

    @torch.inference_mode()
    def forward(self, ids, positions, cache, mask=None, logits_for=None, kv=None):
        n = ids.shape[0]
        B = bucket_for(n)
        tree = mask is not None and mask.shape[1] == n
        if kv is not None or B is None or (mask is not None and not tree) or cache.length + B > cache.capacity:
            self.passthrough += 1
            return self.model.forward(ids, positions, cache, mask, logits_for, kv)
        check_positions(positions, self.model.cfg)
        if cache is not self._cache:  # graphs hold the cache's addresses: a new cache means new graphs
            self._cache, self._buckets = cache, {}
        b = self._buckets.get(B) or self._make(B)
        b.ids[:n] = ids
        b.ids[n:] = 0
        b.pos[:n] = positions
        b.pos[n:] = positions[:1]
        b.bits.copy_(b.alone)
        if n > 1:
            anc = mask if tree else torch.ones(n, n, dtype=torch.bool, device=ids.device).tril_()
            b.bits[:n] = self.model.gpu.tree.ancestry_bits(anc)
        self._length.fill_(cache.length)
        logits, hidden = b.replay()
        self.replays += 1
        # copies: the buffers are overwritten by the next replay, and callers keep rows of these (the heads)
        logits = logits[:n] if logits_for is None else logits[:n][logits_for]
        return logits.clone(), hidden[:n].clone()

    def _make(self, B: int) -> _Bucket:
        dev = self.model.device
        self._length.fill_(self._cache.length)
        alone = torch.ones(B, dtype=torch.long, device=dev) << torch.arange(B, device=dev)
        b = _Bucket(ids=torch.zeros(B, dtype=torch.long, device=dev),
                    pos=torch.full((B,), min(self._cache.length, self.model.cfg.max_positions - 1), device=dev),
                    bits=alone.clone(), alone=alone)

        def run():
            return self.model.forward_static(b.ids, b.pos, b.bits, self._length, self._cache)

        if not self.capture:
            b.replay = run
        else:
            # Warm up on a side stream (the capture rules ask for it), then record. Both write K/V only into the
            # slots past the committed ones, which no committed state reads.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run()

            def replay():
                graph.replay()
                return out

            b.replay = replay
        self._buckets[B] = b
        return b
