"""N-gram reuse: a table of 4-grams over the prompt and the output, proposing what followed the root before.

Keyed by one token, each entry counts the 3-token continuations seen after it. A plain dict of counters,
not a container sorted by count: the reference implementation's sorted set silently merged entries with
equal counts. Long documents repeat names, phrases and formatting, which is what this source catches.
"""

from __future__ import annotations

import heapq
from collections import Counter

import numpy as np

from .drafting import AcceptanceStats, DraftSource
from .tree import DraftTree

TOP = 20  # continuations proposed per step (the paper's k)
N = 4  # n-gram order: the key token plus 3 continuation tokens


class NgramDrafter(DraftSource):
    name = "ngram"

    def __init__(self, source_id: int, stats: AcceptanceStats):
        super().__init__(source_id, stats)
        self.table: dict[int, Counter] = {}
        self.seen = 0  # history tokens already counted
        # key -> its TOP continuations, best first, until the key is counted again: a common token of a long
        # document has thousands of continuations, and ranking them every time it is the root would grow with it
        self._best: dict[int, list[tuple]] = {}

    def after_commit(self, history: np.ndarray, n_new: int) -> None:
        # Count every 4-gram that ends in a token not counted before.
        total = len(history)
        first = max(0, self.seen - (N - 1))
        window = history[first:total].tolist()
        for j in range(len(window) - N + 1):
            if first + j + N > self.seen:
                key = window[j]
                self.table.setdefault(key, Counter())[tuple(window[j + 1 : j + N])] += 1
                self._best.pop(key, None)
        self.seen = total

    def seed(self, tokens: np.ndarray, topk: np.ndarray) -> None:
        pass  # the prompt is counted by the first after_commit, which sees the whole history

    def propose(self, tree: DraftTree, history: np.ndarray, max_depth: int, limit: int) -> None:
        root = int(history[-1])
        best = self._best.get(root)
        if best is None:
            counts = self.table.get(root)
            if not counts:
                return
            # nlargest is sorted(...)[:n], stable: the first `limit` of the TOP are the `limit` best
            best = self._best[root] = [c for c, _ in heapq.nlargest(TOP, counts.items(), key=lambda kv: kv[1])]
        rank_of: dict[tuple, int] = {}  # (prefix, token) -> its rank among the prefix's children, by first sight
        children: dict[tuple, int] = {}  # prefix -> how many distinct children it has so far
        for cont in best[: min(TOP, limit)]:
            node = 0
            for d, tok in enumerate(cont[:max_depth], start=1):
                prefix = cont[: d - 1]
                rank = rank_of.get((prefix, tok))
                if rank is None:
                    rank = rank_of[(prefix, tok)] = children.get(prefix, 0)
                    children[prefix] = rank + 1
                node = tree.add(node, tok, tree.score[node] * self.stats.estimate(self.id, d, rank), self.id, rank)

    def state(self) -> dict[str, np.ndarray]:
        rows = [(k, *c, n) for k, ctr in self.table.items() for c, n in ctr.items()]
        arr = np.array(rows, dtype=np.int64).reshape(-1, N + 1)
        return {"ngram.table": arr, "ngram.seen": np.array([self.seen], dtype=np.int64)}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        arr, seen = state.get("ngram.table"), state.get("ngram.seen")
        if arr is None or seen is None or arr.ndim != 2 or arr.shape[1] != N + 1:
            raise ValueError("n-gram table missing or of the wrong shape")
        table: dict[int, Counter] = {}
        for row in arr.tolist():
            table.setdefault(row[0], Counter())[tuple(row[1:N])] = row[N]
        self.table, self.seen, self._best = table, int(seen[0]), {}
