"""What every draft source shares: the interface the engine calls, and the online acceptance estimates.

A source writes candidate nodes into the shared `DraftTree` with an estimated probability of acceptance.
The estimate for a node is its parent's times the measured rate at which verification accepted nodes
from this source, at this depth, with this sibling rank, *given that their parent was accepted*. Those
rates start from an optimistic prior (so new sources get tried) and are counted after every step.
"""

from __future__ import annotations

import numpy as np
import torch

from .tree import DraftTree, Flat

MAX_DEPTH = 8  # deepest draft node considered; deeper trees never paid on the machines measured
MAX_RANK = 8


class AcceptanceStats:
    """Counts per (source, depth, rank): how often a node was verified while its parent was accepted, and
    how often it was accepted itself."""

    def __init__(self, n_sources: int):
        shape = (n_sources, MAX_DEPTH + 1, MAX_RANK)
        self.tried = np.zeros(shape, dtype=np.float64)
        self.hit = np.zeros(shape, dtype=np.float64)
        # Prior: 2 pseudo-trials with acceptance 0.6 / (rank + 1).
        prior = 0.6 / (np.arange(MAX_RANK) + 1.0)
        self.prior_hit = np.broadcast_to(2.0 * prior, shape)
        self.prior_tried = 2.0
        self._refresh()

    def _refresh(self) -> None:
        self.rate = (self.hit + self.prior_hit) / (self.tried + self.prior_tried)
        self._rates = self.rate.tolist()  # the sources read a few dozen estimates per step: plain floats are cheaper

    def estimate(self, source: int, depth: int, rank: int) -> float:
        return self._rates[source][min(depth, MAX_DEPTH)][min(rank, MAX_RANK - 1)]

    def update(self, flat: Flat, path: list[int]) -> None:
        self.count(flat.parent.tolist(), flat.depth.tolist(), flat.ranks, path)

    def count(self, parents: list[int], depth: list[int], ranks: list[dict[int, int]], path: list[int]) -> None:
        """Count a tree (parents precede children) whose accepted path is `path` (node indices, root first)."""
        accepted = set(path)
        for i in range(1, len(parents)):
            if parents[i] not in accepted:
                continue
            for src, rank in ranks[i].items():
                key = (src, min(depth[i], MAX_DEPTH), min(rank, MAX_RANK - 1))
                self.tried[key] += 1
                self.hit[key] += i in accepted
        self._refresh()

    def summary(self, source: int) -> dict:
        t, h = self.tried[source].sum(), self.hit[source].sum()
        return {"verified": int(t), "accepted": int(h), "rate": round(h / t, 4) if t else None}


class DraftSource:
    """A source of draft tokens. `id` is its bit in a node's source mask; `name` is what users see."""

    name = "base"
    costly = False  # True: its drafting costs a noticeable share of a step; it sits out while the budget rests at 0

    def __init__(self, source_id: int, stats: AcceptanceStats):
        self.id = source_id
        self.stats = stats

    def bind(self, engine) -> None:
        """Called once by the engine that will use this source (for sources that run the model themselves)."""

    def propose(self, tree: DraftTree, history: np.ndarray, max_depth: int, limit: int) -> None:
        """Add up to `limit` nodes no deeper than `max_depth` to `tree` (rooted at history[-1])."""
        raise NotImplementedError

    def after_verify(self, flat: Flat, topk: np.ndarray) -> None:
        """Called after each verification forward with each node's top-k next tokens [n, k]."""

    def after_accept(self, hidden: torch.Tensor) -> None:
        """Called after each verification with the hidden state (before the final norm) of the last accepted
        node: the position whose output is the bonus token, i.e. the next tree's root."""

    def after_commit(self, history: np.ndarray, n_new: int) -> None:
        """Called after `n_new` tokens were appended to `history` (prompt + output so far)."""

    def rewind(self, n: int) -> None:
        """Called when the engine took back every token from position n on (a banned phrase, bans.py). A source's
        state only shapes its guesses, so one that ignores this stays correct; it may guess worse for a while."""

    def seed(self, tokens: np.ndarray, topk: np.ndarray) -> None:
        """Called with the prompt's prefill: tokens [m] and each one's top-k next tokens [m, k]."""

    def state(self) -> dict[str, np.ndarray]:
        return {}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        pass
