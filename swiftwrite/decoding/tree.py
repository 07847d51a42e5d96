"""The draft tree: a trie of candidate tokens that every draft source writes into, and its verification.

Node 0 is the root: the last committed token, whose K/V are not yet in the cache. Every other node is a
guess for the token after its parent. Each node carries `score`, the estimated probability that
verification accepts it (the product of the online acceptance rates along its path), so the best `B`
nodes are simply the `B` highest scores: a child never scores above its parent, so that set is closed
under ancestry and is itself a tree.

Verification walks from the root: at each node the model's own choice (greedy or position-seeded
sample, `Sampler.choose`) is computed from that node's logits; if a child carries that token we descend,
otherwise we stop. The accepted path plus the model's choice at its last node (the bonus token) is exactly
what plain decoding would have produced, because plain decoding would have computed the same choices from
the same contexts.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import torch


@dataclass
class Flat:
    """The selected tree as tensors, in an order where parents precede children."""

    tokens: torch.Tensor  # [n] long
    depth: torch.Tensor  # [n] long
    parent: torch.Tensor  # [n] long, root's parent is -1
    anc: torch.Tensor  # [n, n] bool: anc[i, j] = j is an ancestor of i or i itself (the attention mask)
    sources: list[int]  # bitmask of the draft sources that proposed each node
    ranks: list[dict[int, int]]  # per node: source -> the rank it gave the node among its siblings
    children: dict[tuple[int, int], int]  # (parent index, token) -> child index


class DraftTree:
    def __init__(self, chain: bool = False):
        """`chain`: verify one path, the best child at each depth (a backend whose rows off a tree's first chain
        compute other bits than single steps: Abilities.chains_only), not the best nodes anywhere."""
        self.chain = chain
        self.reset(0)

    def reset(self, root_token: int) -> None:
        self.token = [root_token]
        self.parent = [-1]
        self.depth = [0]
        self.score = [1.0]
        self.src = [0]
        self.rank: list[dict[int, int]] = [{}]
        self._child: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.token)

    def add(self, parent: int, token: int, score: float, source: int, rank: int = 0) -> int:
        """Add (or merge into) the child `token` of node `parent`. Returns the node index. A node proposed by
        several sources keeps the highest estimate and remembers every source (bit `source`)."""
        key = (parent, token)
        i = self._child.get(key)
        if i is None:
            i = len(self.token)
            self._child[key] = i
            self.token.append(token)
            self.parent.append(parent)
            self.depth.append(self.depth[parent] + 1)
            self.score.append(min(score, self.score[parent]))
            self.src.append(1 << source)
            self.rank.append({source: rank})
        else:
            self.score[i] = max(self.score[i], min(score, self.score[parent]))
            self.src[i] |= 1 << source
            self.rank[i].setdefault(source, rank)
        return i

    def best_scores(self, max_depth: int) -> list[float]:
        """Scores of non-root nodes within `max_depth`, best first (for choosing the budget)."""
        if self.chain:
            return [self.score[i] for i in self._chain(max_depth)]
        return sorted((s for s, d in zip(self.score[1:], self.depth[1:]) if d <= max_depth), reverse=True)

    def _best(self, k: int, max_depth: int) -> list[int]:
        """Indices of the `k` best nodes no deeper than `max_depth`, parents before children. Ties go to the
        shallower, then the older node, so a parent always comes before a child that scores as much."""
        if self.chain:
            return self._chain(max_depth)[:k]
        order = heapq.nsmallest(k, (i for i in range(1, len(self.token)) if self.depth[i] <= max_depth),
                                key=lambda i: (-self.score[i], self.depth[i], i))
        return sorted(order, key=lambda i: (self.depth[i], i))

    def _chain(self, max_depth: int) -> list[int]:
        """The path from the root through the best-scoring child at each depth (ties to the older node), to
        `max_depth` or a leaf. Scores fall along it, so its first k nodes are the best k-node chain."""
        best: dict[int, int] = {}
        for i in range(1, len(self.token)):
            p = self.parent[i]
            if p not in best or self.score[i] > self.score[best[p]]:
                best[p] = i
        path, node = [], 0
        while node in best and len(path) < max_depth:
            node = best[node]
            path.append(node)
        return path

    def select(self, budget: int, max_depth: int, device="cpu") -> Flat:
        """Keep the root and the `budget` best nodes no deeper than `max_depth`; return them flattened."""
        if budget <= 0:  # a plain step (or a resting one): nothing to rank, and the root's shape is always the same
            depth, parent, anc = _root_shape(str(device))
            return Flat(torch.tensor(self.token[:1], dtype=torch.long, device=device), depth, parent, anc,
                        self.src[:1], self.rank[:1], {})
        keep = [0] + self._best(budget, max_depth)
        new = {old: k for k, old in enumerate(keep)}
        n = len(keep)
        parent = [-1] + [new[self.parent[i]] for i in keep[1:]]
        tokens = [self.token[i] for i in keep]
        anc = torch.eye(n, dtype=torch.bool)
        for k in range(1, n):  # parents precede children, so each row is complete when it is copied
            anc[k] |= anc[parent[k]]
        return Flat(
            tokens=torch.tensor(tokens, dtype=torch.long, device=device),
            depth=torch.tensor([self.depth[i] for i in keep], dtype=torch.long, device=device),
            parent=torch.tensor(parent, dtype=torch.long, device=device),
            anc=anc.to(device),
            sources=[self.src[i] for i in keep],
            ranks=[self.rank[i] for i in keep],
            children={(parent[k], tokens[k]): k for k in range(1, n)},
        )

    def best(self, k: int, max_depth: int) -> tuple[list[int], list[int], list[int], list[dict[int, int]], float]:
        """What `select(k)` would verify, as plain lists: (tokens, parents, depths, ranks, sum of the nodes'
        scores), root first. For a shadow check (Engine), which verifies nothing and so needs no tensors."""
        keep = [0] + self._best(k, max_depth)
        new = {old: j for j, old in enumerate(keep)}
        return ([self.token[i] for i in keep], [-1] + [new[self.parent[i]] for i in keep[1:]],
                [self.depth[i] for i in keep], [self.rank[i] for i in keep], sum(self.score[i] for i in keep[1:]))


@functools.cache
def _root_shape(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A lone root's depth, parent and mask, made once per device: a plain step is made every few milliseconds,
    and nothing writes into a Flat."""
    return (torch.zeros(1, dtype=torch.long, device=device), torch.full((1,), -1, dtype=torch.long, device=device),
            torch.ones(1, 1, dtype=torch.bool, device=device))


def walk(flat: Flat, choice: list[int]) -> tuple[list[int], int]:
    """Follow the model's choices from the root. Returns (indices of the accepted path, root first; the
    bonus token, i.e. the model's choice at the last accepted node)."""
    path = [0]
    while True:
        nxt = flat.children.get((path[-1], choice[path[-1]]))
        if nxt is None:
            return path, choice[path[-1]]
        path.append(nxt)
