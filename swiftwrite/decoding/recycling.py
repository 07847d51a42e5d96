"""Token Recycling: a [vocab, k] matrix of the tokens the model last predicted after each token.

After every verification forward, the row of each tree node's token is overwritten with that node's
top-k next tokens, accepted or not: candidates the model considered once tend to recur. Drafting expands
the tree from the root by following rows, best estimated probability first, so a wider or deeper tree
grows where acceptance has been high. The paper's static 81-node tree is available as `static_tree=True`.
"""

from __future__ import annotations

import heapq

import numpy as np

from .drafting import AcceptanceStats, DraftSource
from .tree import DraftTree, Flat

K = 8  # candidates kept per row (the paper's k)

# The reference static tree, level by level: for each node of the previous level (in order), how many
# children it gets. 8/21/25/15/8/3 nodes per level, the widest branches on the first (likeliest) children.
STATIC_TREE = [
    [8],
    [6, 5, 3, 2, 2, 1, 1, 1],
    [5, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1] + [0] * 9,
    [3, 3, 2, 2, 1, 1, 1, 1, 1] + [0] * 16,
    [2, 2, 1, 1, 1, 1] + [0] * 9,
    [1, 1, 1] + [0] * 5,
]


class RecyclingDrafter(DraftSource):
    name = "recycling"

    def __init__(self, source_id: int, stats: AcceptanceStats, vocab: int, static_tree: bool = False):
        super().__init__(source_id, stats)
        self.matrix = np.full((vocab, K), -1, dtype=np.int32)  # -1: the model never ran on this token yet
        self.static_tree = static_tree

    def seed(self, tokens: np.ndarray, topk: np.ndarray) -> None:
        self.matrix[tokens] = topk[:, :K]

    def after_verify(self, flat: Flat, topk: np.ndarray) -> None:
        self.matrix[flat.tokens.cpu().numpy()] = topk[:, :K]

    def propose(self, tree: DraftTree, history: np.ndarray, max_depth: int, limit: int) -> None:
        if self.static_tree:
            return self._propose_static(tree, max_depth)
        # Best-first: pop the likeliest node, add its row's children with their estimates.
        heap = [(-tree.score[0], 0)]
        added = 0
        while heap and added < limit:
            neg, node = heapq.heappop(heap)
            d = tree.depth[node] + 1
            if d > max_depth:
                continue
            row = self.matrix[tree.token[node]]
            for rank, tok in enumerate(row.tolist()):
                if tok < 0:
                    break
                score = -neg * self.stats.estimate(self.id, d, rank)
                before = len(tree)
                child = tree.add(node, tok, score, self.id, rank)
                added += len(tree) > before
                heapq.heappush(heap, (-tree.score[child], child))
                if added >= limit:
                    break

    def _propose_static(self, tree: DraftTree, max_depth: int) -> None:
        level = [0]
        for d, widths in enumerate(STATIC_TREE, start=1):
            if d > max_depth:
                return
            nxt = []
            for node, width in zip(level, widths):
                row = self.matrix[tree.token[node]].tolist()
                for rank in range(width):
                    if row[rank] < 0:
                        break
                    score = tree.score[node] * self.stats.estimate(self.id, d, rank)
                    nxt.append(tree.add(node, row[rank], score, self.id, rank))
            level = nxt

    def state(self) -> dict[str, np.ndarray]:
        return {"recycling.matrix": self.matrix}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        m = state.get("recycling.matrix")
        if m is None or m.shape != self.matrix.shape:
            raise ValueError(f"recycling matrix of shape {None if m is None else m.shape}, expected {self.matrix.shape}")
        self.matrix = m.astype(np.int32)
