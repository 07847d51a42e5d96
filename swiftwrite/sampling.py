"""Logits processing and exact, position-seeded sampling.

Every token choice, in plain decoding and for every node of a draft tree, goes through `Sampler.choose`,
so a speculative run applies exactly the same rule as plain decoding at each position.

Sampling is made deterministic per *position*: the noise for absolute position p (index of the token in
prompt + output) comes from a generator seeded with (seed, p), and the choice is

    argmax(processed_logits / T + G_p),   G_p ~ Gumbel(0, 1) per vocabulary entry,

which is an exact draw from softmax(processed_logits / T) (the Gumbel-max trick). The choice at a position
then depends only on the logits there, never on how many draws happened before, so a speculative step can
verify sampled tokens by the same walk as greedy ones, and a resumed run needs no RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .repetition import Dry, DrySettings


@dataclass(frozen=True)
class SamplerSettings:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; keep tokens with p >= min_p * p_max
    penalty: float = 1.0  # theta; 1 = off
    window: int = 1024  # penalty window W in tokens (prompt included unless `start` excludes it)
    # positions before `start` are outside the penalty's window (and DrySettings.start the suppression's): a
    # prompt holding a source document (--source) is there to be restated, so only the written text counts
    start: int = 0
    suppress: tuple[int, ...] = ()  # token ids never chosen (end-of-text until the target is reached)
    seed: int = 0
    dry: DrySettings = field(default_factory=DrySettings)  # n-gram repetition suppression; off by default here


class Sampler:
    def __init__(self, s: SamplerSettings, vocab: int, device="cpu"):
        self.s = s
        self.vocab = vocab
        self.device = device
        self._noise: dict[int, torch.Tensor] = {}
        self._suppress = torch.tensor(s.suppress, dtype=torch.long, device=device) if s.suppress else None
        self.dry = Dry(s.dry, vocab) if s.dry.on else None

    @property
    def greedy(self) -> bool:
        return self.s.temperature <= 0

    # -- the contextual penalty ------------------------------------------------------------------------

    def presence(self, history: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
        """Which vocabulary ids each node's penalty window contains: bool [n, vocab].

        history: the committed sequence [N] (its last entry is the tree's root, depth 0). A node at depth d
        continues history + its ancestors at depths 1..d, so its window is the last W tokens of that:
        history[N-W+d:] plus those ancestors. Only a handful of distinct depths exist, so the history part is
        one bincount plus a small correction per depth; the ancestor part is one scatter.
        """
        W, N, V = self.s.window, history.shape[0], self.vocab
        max_d = int(depth.max())
        lo = max(self.s.start, N - W, 0)
        history = history[lo:].to(tokens.device)  # only the window is read (the history may be on the CPU)
        N, lo = N - lo, 0
        counts = torch.bincount(history[lo:], minlength=V)
        rows = [counts > 0]
        for d in range(1, max_d + 1):
            cut = N - W + d  # the first `cut` history tokens fall out of the window of a depth-d node (none
            # when the window's edge is still before `start`: those were never counted)
            if lo < cut <= N:  # nodes deeper than the window see only their ancestors
                counts = counts.clone()
                counts[history[cut - 1]] -= 1
            rows.append(counts > 0)
        pres = torch.stack(rows)[depth]
        if max_d > 0 and W > 0:
            # ancestors (depth >= 1) of each node, itself included, within the last W tokens
            inside = anc & (depth.unsqueeze(0) >= 1) & (depth.unsqueeze(1) - depth.unsqueeze(0) < W)
            ii, jj = inside.nonzero(as_tuple=True)
            pres[ii, tokens[jj]] = True
        return pres

    def process(self, logits: torch.Tensor, history: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor,
                anc: torch.Tensor, parent: torch.Tensor | None = None, excluded: list[int] | None = None) -> torch.Tensor:
        """Penalty, n-gram suppression, end-of-text suppression, temperature and filters, per node. `history`
        is the committed sequence on the CPU (its last token is the root); `parent` of each node (root: -1),
        derived from `anc` when not given; `excluded`: ids the root's row may not choose (banned phrases start
        there: removed like end-of-text, before the filters). Returns float logits [n, vocab] (a new tensor)."""
        s = self.s
        if s.penalty != 1.0 and s.window > 0:
            pres = self.presence(history, tokens, depth, anc)
            # theta > 1 pushes seen tokens down on both sides of zero: divide positive logits, multiply negative
            penalised = torch.where(logits > 0, logits / s.penalty, logits * s.penalty)
            logits = torch.where(pres, penalised, logits)
        if self.dry is not None:
            logits = self._dry(logits, history, tokens, depth, anc, parent)
        if self._suppress is not None:
            logits = logits.index_fill(-1, self._suppress, float("-inf"))  # not in place: inference-mode tensor
        if excluded:
            logits = logits.index_put((torch.zeros(len(excluded), dtype=torch.long, device=logits.device),
                                       torch.tensor(excluded, dtype=torch.long, device=logits.device)),
                                      torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
        if self.greedy:
            return logits
        logits = logits / s.temperature
        if s.top_k > 0 and s.top_k < logits.shape[-1]:
            kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1.0:
            srt, idx = torch.sort(logits, dim=-1, descending=True)
            probs = torch.softmax(srt, dim=-1)
            drop = (probs.cumsum(-1) - probs) > s.top_p  # mass before this token already exceeds top_p
            logits = logits.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
        if s.min_p > 0.0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < s.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
        return logits

    def _dry(self, logits, history, tokens, depth, anc, parent):
        if parent is None:
            parent = parent_of(anc, depth)
        rows, toks, amounts = self.dry.penalties(history.cpu().numpy(), tokens.cpu().numpy(), depth.cpu().numpy(),
                                                 parent.cpu().numpy())
        if rows.shape[0] == 0:
            return logits
        # A token several earlier occurrences point at loses the largest amount (that of its longest match).
        key = rows * self.vocab + toks
        order = np.lexsort((amounts, key))
        key, amounts = key[order], amounts[order]
        last = np.append(key[1:] != key[:-1], True)
        idx = torch.from_numpy(key[last]).to(logits.device)
        minus = torch.from_numpy(-amounts[last]).to(logits.device, logits.dtype)
        return logits.reshape(-1).index_put((idx,), minus, accumulate=True).reshape(logits.shape)

    # -- the choice -------------------------------------------------------------------------------------

    def noise(self, position: int) -> torch.Tensor:
        g = self._noise.get(position)
        if g is None:
            # numpy's SeedSequence mixes both numbers in full (torch's CPU generator keeps only 32 bits of a
            # seed, which would make the noise depend on the position alone).
            rng = np.random.default_rng([self.s.seed & 0xFFFFFFFFFFFFFFFF, position])
            u = torch.from_numpy(rng.random(self.vocab)).clamp_(1e-300, 1.0 - 1e-16)
            g = (-torch.log(-torch.log(u))).to(torch.float32).to(self.device)
            if len(self._noise) > 256:
                self._noise.clear()
            self._noise[position] = g
        return g

    def choose(self, processed: torch.Tensor, positions: list[int] | torch.Tensor) -> torch.Tensor:
        """Token per row: argmax (greedy) or argmax(logits + G_position) (sampling). `positions` are the
        absolute indices of the tokens being chosen."""
        if self.greedy:
            return processed.argmax(-1)
        pos = positions.tolist() if isinstance(positions, torch.Tensor) else positions
        uniq = sorted(set(pos))
        table = torch.stack([self.noise(p) for p in uniq])
        rows = torch.tensor([uniq.index(p) for p in pos], device=processed.device)
        return (processed + table[rows]).argmax(-1)


def parent_of(anc: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Each node's parent from the ancestor mask: its ancestor one level up (the root's is -1)."""
    up = anc & (depth.unsqueeze(0) == depth.unsqueeze(1) - 1)
    return torch.where(up.any(1), up.to(torch.int8).argmax(1), torch.full_like(depth, -1))
