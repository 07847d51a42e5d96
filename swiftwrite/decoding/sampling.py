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

import math
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
        # only a filter (top-k, top-p, min-p) can leave few candidates; without one choose() skips looking for them
        self._ranked = (0 < s.top_k < vocab) or s.top_p < 1.0  # filters that sort the vocabulary
        self._filters = self._ranked or s.min_p > 0.0

    @property
    def greedy(self) -> bool:
        return self.s.temperature <= 0

    # -- the contextual penalty ------------------------------------------------------------------------

    def seen(self, history: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor
             ) -> tuple[np.ndarray, np.ndarray]:
        """Which vocabulary ids each node's penalty window contains, as (node, id) pairs (a pair may repeat).

        history: the committed sequence [N] on the CPU (its last entry is the tree's root, depth 0). A node at
        depth d continues history + its ancestors at depths 1..d, so its window is the last W tokens of that:
        history[N-W+d:] plus those ancestors. Only a handful of distinct depths exist: one set of history ids
        per depth, then the ancestors. A few hundred pairs, where a mask over the vocabulary would be 49,152
        entries a node."""
        W = self.s.window
        h = history.numpy()
        N = h.shape[0]
        h = h[max(self.s.start, N - W, 0):]  # only the window is read (nothing before `start` counts)
        if tokens.shape[0] == 1:  # plain decoding: the root's own window, repeats and all (sorting them out would
            return np.zeros(h.shape[0], dtype=np.int64), h  # cost more than penalising an id twice with one value)
        N = h.shape[0]  # now <= W
        d_np, tok_np = depth.cpu().numpy(), tokens.cpu().numpy()
        rows, ids = [], []
        for d in np.unique(d_np).tolist():
            inside = np.unique(h[max(0, N - W + d):])  # the first N - W + d fall out of a depth-d node's window
            nodes = np.flatnonzero(d_np == d)
            rows.append(np.repeat(nodes, inside.shape[0]))
            ids.append(np.tile(inside, nodes.shape[0]))
        if W > 0 and d_np.max() > 0:
            # ancestors (depth >= 1) of each node, itself included, within the last W tokens
            ii, jj = np.nonzero(anc.cpu().numpy() & (d_np[None, :] >= 1) & (d_np[:, None] - d_np[None, :] < W))
            rows.append(ii)
            ids.append(tok_np[jj])
        return np.concatenate(rows), np.concatenate(ids)

    def presence(self, history: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
        """seen() as a mask: bool [n, vocab]."""
        rows, ids = self.seen(history, tokens, depth, anc)
        pres = torch.zeros(tokens.shape[0], self.vocab, dtype=torch.bool)
        pres[torch.from_numpy(rows), torch.from_numpy(ids)] = True
        return pres.to(tokens.device)

    def process(self, logits: torch.Tensor, history: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor,
                anc: torch.Tensor, parent: torch.Tensor | None = None, excluded: list[int] | None = None) -> torch.Tensor:
        """Penalty, n-gram suppression, end-of-text suppression, temperature and filters, per node. `history`
        is the committed sequence on the CPU (its last token is the root); `parent` of each node (root: -1),
        derived from `anc` when not given; `excluded`: ids the root's row may not choose (banned phrases start
        there: removed like end-of-text, before the filters). Returns float logits [n, vocab] (a new tensor)."""
        s = self.s
        # One copy, then every step in place: right after a forward has evicted the caches, each pass over the
        # vocabulary costs several times its warm figure. The copy is an ordinary tensor even from inference-mode
        # logits, so the in-place steps work outside inference mode too.
        # On the CPU the copy and the steps up to the temperature run in numpy on the same memory: the same IEEE
        # operations on float32 (tested), at a fraction of torch's per-call cost, which is most of what these
        # few-id steps cost; and torch's copy of a row of the vocabulary is an OpenMP region (a sampling profile of
        # plain decoding on llama.cpp put a fifth of the time between its steps in that copy; numpy's, a fiftieth).
        if _numpy_view(logits):
            L = np.array(logits.numpy(), order="C")  # a model's rows may be a strided view
            logits = torch.from_numpy(L)
        else:
            logits, L = logits.clone(memory_format=torch.contiguous_format), None
        if s.penalty != 1.0 and s.window > 0:
            # only the ids in a window change (a few hundred of the vocabulary): computed there alone
            rows, ids = self.seen(history, tokens, depth, anc)
            # theta > 1 pushes seen tokens down on both sides of zero: divide positive logits, multiply negative
            if L is not None:
                flat = L.reshape(-1)  # a view (L is contiguous): numpy's 1-D indexing costs less than its 2-D
                at = ids if L.shape[0] == 1 else rows * L.shape[1] + ids
                seen, theta = flat[at], np.float32(s.penalty)
                flat[at] = np.where(seen > 0, seen / theta, seen * theta)
            else:
                rows, ids = torch.from_numpy(rows).to(logits.device), torch.from_numpy(ids).to(logits.device)
                seen = logits[rows, ids]
                logits.index_put_((rows, ids), torch.where(seen > 0, seen / s.penalty, seen * s.penalty))
        if self.dry is not None:
            self._dry(logits, L, history, tokens, depth, anc, parent)
        if self._suppress is not None:
            if L is not None:
                L[:, self.s.suppress] = -np.inf
            else:
                logits.index_fill_(-1, self._suppress, float("-inf"))
        if excluded:
            logits[0, torch.tensor(excluded, dtype=torch.long, device=logits.device)] = float("-inf")
        if self.greedy:
            return logits
        if L is not None and s.min_p > 0.0 and not self._ranked and _min_p_near_top(L, s.temperature, s.min_p):
            return logits
        if L is not None:
            np.divide(L, np.float32(s.temperature), out=L)
        else:
            logits.div_(s.temperature)
        if s.top_k > 0 and s.top_k < logits.shape[-1]:
            kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1.0:
            srt, idx = torch.sort(logits, dim=-1, descending=True)
            probs = torch.softmax(srt, dim=-1)
            drop = (probs.cumsum(-1) - probs) > s.top_p  # mass before this token already exceeds top_p
            logits = logits.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
        if s.min_p > 0.0:
            _drop_below(logits, torch.softmax(logits, dim=-1), s.min_p)
        return logits

    def _dry(self, logits, L, history, tokens, depth, anc, parent) -> None:
        """Subtract the n-gram suppression's penalties from `logits` (or its numpy view L), in place."""
        if parent is None:
            parent = parent_of(anc, depth)
        rows, toks, amounts = self.dry.penalties(history.cpu().numpy(), tokens.cpu().numpy(), depth.cpu().numpy(),
                                                 parent.cpu().numpy())
        if rows.shape[0] == 0:
            return
        # A token several earlier occurrences point at loses the largest amount (that of its longest match).
        key = rows * self.vocab + toks
        order = np.lexsort((amounts, key))
        key, amounts = key[order], amounts[order]
        last = np.append(key[1:] != key[:-1], True)
        if L is not None:
            L.reshape(-1)[key[last]] += (-amounts[last]).astype(np.float32)  # one entry per id: a plain add
            return
        idx = torch.from_numpy(key[last]).to(logits.device)
        minus = torch.from_numpy(-amounts[last]).to(logits.device, logits.dtype)
        logits.view(-1).index_put_((idx,), minus, accumulate=True)

    # -- the choice -------------------------------------------------------------------------------------

    def noise(self, position: int) -> torch.Tensor:
        """G_position over the whole vocabulary [vocab] (float32)."""
        g = self._noise.get(position)
        if g is None:
            # numpy's SeedSequence mixes both numbers in full (torch's CPU generator keeps only 32 bits of a
            # seed, which would make the noise depend on the position alone).
            rng = np.random.default_rng([self.s.seed & 0xFFFFFFFFFFFFFFFF, position])
            g = _gumbel(torch.from_numpy(rng.random(self.vocab))).to(self.device)
            if len(self._noise) > 256:
                self._noise.clear()
            self._noise[position] = g
        return g

    def noise_at(self, position: int, ids: np.ndarray) -> torch.Tensor:
        """The entries `ids` (ascending) of noise(position), bit for bit, without drawing the rest: the generator
        jumps over the ids between (PCG64 advances in O(log n)), so the handful of candidates min-p leaves costs
        a few dozen generator calls instead of a draw over the whole vocabulary."""
        bits = np.random.PCG64(np.random.SeedSequence([self.s.seed & 0xFFFFFFFFFFFFFFFF, position]))
        # padded so the element-wise ops below run on whole vectors, as they do over a vocabulary
        u = np.full(-(-max(len(ids), 1) // NOISE_PAD) * NOISE_PAD, 0.5)
        at = 0
        for j, i in enumerate(ids.tolist()):
            bits.advance(i - at)
            u[j] = (bits.random_raw() >> 11) * 2.0**-53  # how Generator.random makes a double of 64 bits
            at = i + 1
        return _gumbel(torch.from_numpy(u))[: len(ids)]

    def choose(self, processed: torch.Tensor, positions: list[int] | torch.Tensor) -> torch.Tensor:
        """Token per row: argmax (greedy) or argmax(logits + G_position) (sampling). `positions` are the
        absolute indices of the tokens being chosen."""
        if self.greedy:  # the first maximum in both (numpy's: one thread, as process() explains)
            return torch.from_numpy(processed.numpy().argmax(-1)) if _numpy_view(processed) else processed.argmax(-1)
        pos = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
        if self._filters and _numpy_view(processed):  # the only ids that can win: -inf + G stays -inf
            live = np.flatnonzero(processed.numpy() != -np.inf)
            if live.shape[0] <= SPARSE_NOISE:
                return self._choose_among(processed, pos, live)
        uniq = sorted(set(pos))
        table = torch.stack([self.noise(p) for p in uniq])
        rows = torch.tensor([uniq.index(p) for p in pos], device=processed.device)
        if _numpy_view(processed):  # float32 sums and the first maximum, as torch's, on one thread
            return torch.from_numpy((processed.numpy() + table[rows].numpy()).argmax(-1))
        return (processed + table[rows]).argmax(-1)

    def _choose_among(self, processed: torch.Tensor, pos: list[int], live: np.ndarray) -> torch.Tensor:
        """choose() where the filters left few candidates (`live`: their flat indices, ascending): the same sums at
        those ids, the same first maximum. (Flat indices: numpy's 2-D nonzero is several times slower over one
        row than flatnonzero.)"""
        rows, ids_np = np.divmod(live, processed.shape[1])  # row-major: each row's ids ascending
        bounds = np.searchsorted(rows, np.arange(len(pos) + 1)).tolist()
        score = processed.numpy().reshape(-1)[live]
        out = [0] * len(pos)  # a row without candidates: argmax over -inf alone is 0, as in the full sum
        for r, p in enumerate(pos):
            a, b = bounds[r], bounds[r + 1]
            if b - a == 1:  # one candidate wins whatever its (finite) noise: none drawn
                out[r] = int(ids_np[a])
            elif a < b:  # float32 sums, as torch adds them; the first maximum, as torch's argmax takes
                out[r] = int(ids_np[a + int(np.argmax(score[a:b] + self.noise_at(p, ids_np[a:b]).numpy()))])
        return torch.tensor(out)


SPARSE_NOISE = 2048  # candidates (over all rows) up to which choose() draws noise at the candidates only
NOISE_PAD = 64  # a multiple of every CPU vector width torch uses for float64 (and of its unrolling)


def _numpy_view(x: torch.Tensor) -> bool:
    """Whether x can be read as a numpy array in place. On the CPU numpy's compares and fills over one row of
    logits cost a fraction of torch's kernels with boolean results (seen in a scratch timing), with the same bits."""
    return x.is_cpu and x.dtype == torch.float32  # is_cpu: no device object made (this runs a few times a token)


def _drop_below(logits: torch.Tensor, probs: torch.Tensor, scale: float) -> None:
    """min-p, in place: -inf where probs < scale * the row's largest prob."""
    if not (_numpy_view(logits) and _numpy_view(probs)):
        logits.masked_fill_(probs < scale * probs.max(-1, keepdim=True).values, float("-inf"))
        return
    p = probs.numpy()
    # scale * p in float32, as torch multiplies a float32 tensor by a Python number
    np.putmask(logits.numpy(), p < np.float32(scale) * p.max(-1, keepdims=True), -np.inf)


def _min_p_near_top(L: np.ndarray, temperature: float, scale: float) -> bool:
    """The temperature and min-p, in place on float32 rows L of logits, leaving exactly what the dense path leaves
    (np.divide by the temperature, then _drop_below over torch's softmax) while working out the softmax only near
    each row's top. Dividing by T > 0 keeps the order, so z = L / T peaks at top / T, and token i survives min-p when
    exp(z_i - z_top) >= scale: torch's softmax computes exp(z - z_top) / sum, within a few float32 ulps, and the sum
    cancels. A token more than MIN_P_BAND from that threshold is therefore decided here as torch decides it; every
    token below `floor` is 2 % under it. Returns False, with L untouched, when a row has no finite top or a token lies
    inside the band: only torch's own rounding decides those (the caller then runs the dense path)."""
    V, T, s32 = L.shape[-1], np.float32(temperature), float(np.float32(scale))
    top = L.max(axis=-1, keepdims=True)
    if not np.isfinite(top).all():
        return False
    floor = (top + np.float32(temperature * (math.log(scale) - 0.02))).astype(np.float32)
    near = np.flatnonzero(L >= floor)  # flat indices, each row's own ids ascending; every row's top among them
    z = L.reshape(-1)[near] / T  # float32, as np.divide computes each entry
    e = np.exp((z - (top[:, 0] / T)[near // V]).astype(np.float64))  # the float32 difference, as torch's
    if (np.abs(e - s32) <= MIN_P_BAND * s32).any():
        return False
    keep = e > s32
    L.fill(-np.inf)
    L.reshape(-1)[near[keep]] = z[keep]
    return True


MIN_P_BAND = 1e-4  # relative; torch's float32 exp and sum are within ~1e-6 of the true values, far inside it


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, float32, from uniform doubles: one function for both ways of drawing them."""
    return u.clamp_(1e-300, 1.0 - 1e-16).log_().neg_().log_().neg_().to(torch.float32)  # in place: the same bits


def parent_of(anc: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Each node's parent from the ancestor mask: its ancestor one level up (the root's is -1)."""
    up = anc & (depth.unsqueeze(0) == depth.unsqueeze(1) - 1)
    return torch.where(up.any(1), up.to(torch.int8).argmax(1), torch.full_like(depth, -1))
