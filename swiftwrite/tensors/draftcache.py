"""The partial draft cache of the two-pass head mode (TokenSwift's dynamic KV management, DESIGN §4).

The two-pass draft forward runs one token (the next tree's root) against a *subset* of the context's keys
and values: the 16 sink tokens, the earlier tokens that matter most, and the recent past, `budget` slots in
all. Only drafts ever see it, so what it leaves out can cost acceptance, never text.

Layout of the buffer, per layer and per KV head (each head selects its own tokens):

    [ sinks | selected, most important first ........ | recent window ]
      0..15   16 ..                        w ->  <- w    .. budget-1

A rebuild scores every context slot by the dot product of the last query with its key, summed over the
query heads that share the KV head (no scaling, no softmax: the order is all that is used), keeps the sinks
and the most recent `recent` slots, and fills the middle with the best-scoring rest in descending order.
Each newly committed token then overwrites the least important selected slot (the write pointer w walks
from the end of the selected region towards the sinks); when it would reach the sinks, the next draft
forward re-scores everything and rebuilds. While the whole context fits the budget, the draft forward
simply reads the verification cache: there is nothing to leave out.
"""

from __future__ import annotations

import torch

from .kvcache import KVCache

SINKS = 16


def importance(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [H, D] (one token's queries), k [KV, T, D] -> scores [KV, T]: q·k summed over each KV head's group."""
    KV = k.shape[0]
    qg = q.reshape(KV, -1, q.shape[-1])  # [KV, g, D]: query heads h*g .. h*g+g-1 share KV head h
    return torch.bmm(qg.sum(1, keepdim=True), k.transpose(1, 2))[:, 0]  # sum then dot == dot then sum


def select(scores: torch.Tensor, budget: int, recent: int, sinks: int = SINKS) -> torch.Tensor:
    """Slots to keep, per KV head: [KV, budget] = sinks, then the best of the middle by score (descending),
    then the `recent` last slots. scores [KV, T] with T > budget."""
    KV, T = scores.shape
    middle = scores[:, sinks : T - recent]
    best = torch.topk(middle, budget - sinks - recent, dim=-1, sorted=True).indices + sinks
    head = torch.arange(sinks, device=scores.device).expand(KV, sinks)
    tail = torch.arange(T - recent, T, device=scores.device).expand(KV, recent)
    return torch.cat([head, best, tail], dim=1)


class PartialCache:
    """The draft forward's view of the context, kept in step with the verification cache `full`."""

    def __init__(self, full: KVCache, budget: int, recent: int | None = None):
        L, KV, _, D = full.k.shape
        if budget <= SINKS:
            raise ValueError(f"draft KV budget {budget} must be larger than the {SINKS} sink tokens")
        self.full, self.budget = full, budget
        # A quarter of the budget for the recent past: between rebuilds the window grows into the selected
        # region anyway, so this only matters right after one.
        self.recent = recent if recent is not None else max(1, (budget - SINKS) // 4)
        self.k = torch.empty(L, KV, budget, D, device=full.k.device, dtype=full.k.dtype)
        self.v = torch.empty_like(self.k)
        self.seen = 0  # full-cache slots reflected here
        self.w = -1  # next slot to overwrite; < SINKS + 1: rebuild at the next draft forward
        self.active = False  # False: the context fits the budget, read the full cache directly
        self.rebuilds = 0

    def reset(self) -> None:
        """The verification cache was rebuilt (new context, new slots): forget everything."""
        self.seen, self.w, self.active = 0, -1, False

    def sync(self) -> None:
        """Take in the slots the verification cache committed since the last call."""
        T = self.full.length
        if T < self.seen:  # rebuilt under us
            self.reset()
        if not self.active:
            self.active = T > self.budget
            if self.active:
                self.w = -1  # first selection at the next draft forward
            self.seen = T
            return
        new = T - self.seen
        while new > 0 and self.w >= SINKS + 1:
            take = min(new, self.w - SINKS)
            src = torch.arange(T - new, T - new + take, device=self.k.device)
            dst = torch.arange(self.w, self.w - take, -1, device=self.k.device)
            self.k[:, :, dst] = self.full.k[:, :, src]
            self.v[:, :, dst] = self.full.v[:, :, src]
            self.w -= take
            new -= take
        if new > 0:
            self.w = -1  # ran into the sinks: re-score at the next draft forward
        self.seen = T

    def kv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For the draft forward's layer `layer`: the keys and values to attend to, its own token's last.
        q [H, 1, D], k/v [KV, 1, D] of the draft token (never stored: verification recomputes it exactly)."""
        T = self.seen
        if not self.active:
            ks, vs = self.full.k[layer, :, :T], self.full.v[layer, :, :T]
        else:
            if self.w < SINKS + 1:
                self._rebuild(layer, q)
            ks, vs = self.k[layer], self.v[layer]
        return torch.cat([ks, k], dim=1), torch.cat([vs, v], dim=1)

    def _rebuild(self, layer: int, q: torch.Tensor) -> None:
        T = self.seen
        keep = select(importance(q[:, 0], self.full.k[layer, :, :T]), self.budget, self.recent)  # [KV, budget]
        idx = keep.unsqueeze(-1).expand(-1, -1, self.k.shape[-1])
        self.k[layer] = torch.gather(self.full.k[layer, :, :T], 1, idx)
        self.v[layer] = torch.gather(self.full.v[layer, :, :T], 1, idx)
        if layer == self.k.shape[0] - 1:  # every layer re-selected with its own query: the write pointer restarts
            self.w = self.budget - self.recent - 1
            self.rebuilds += 1
