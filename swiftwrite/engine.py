"""The generation engine: token ids in, token ids and step statistics out.

Each step verifies one draft tree (just the root for plain decoding) in one forward pass and commits the
accepted path plus the model's bonus token. The engine knows nothing of text, files or terminals; the
writer subscribes to the `Step`s it yields.

State between steps: `S` (every token so far, prompt included) and a KV cache holding the context of
`window.Window` minus its last token, the root of the next tree.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from statistics import median

import numpy as np
import torch

from .bans import Bans
from .budget import MAX_BUDGET, CostCurve, best_budget
from .drafting import MAX_DEPTH, AcceptanceStats, DraftSource
from .forward import Forward
from .ngram import NgramDrafter
from .recycling import RecyclingDrafter
from .sampling import Sampler
from .tree import DraftTree, walk
from .window import Window

SOURCES = ("recycling", "ngram", "heads")
PREFILL_CHUNK = 256
TOPK = 8  # next-token candidates per node handed to the sources
COST_BUCKET = 1024  # context growth (tokens) after which the cost curve is measured again (attention grows)
CALIBRATION_PRIOR = 2.0  # pseudo-tokens on both sides of the calibration ratio: starts at 1.0
CALIBRATION_DECAY = 0.99  # per verified or shadow-checked tree: the ratio follows the last ~100 of them
CHECK_EVERY = 4  # while resting, the cheap sources propose (and the tree is shadow-checked) every 4th step only;
# the other resting steps are quiet: no proposals, no budget, and the recycling matrix is not updated from their
# forward (a top-k over the whole vocabulary each step). Only the n-gram table keeps counting. A repetition waits at
# most 3 steps; the matrix learns on check steps and on every step once drafting pays
EXPLORE_EVERY = 16  # steps of budget 0 after which the costly sources propose again, into a shadow check
# ... doubled after each such look where none of their drafts is accepted, up to EXPLORE_MAX (a look costs the
# heads' work: their state update and proposals)
EXPLORE_MAX = 128
TIMED = 8  # steps of each kind (resting, verifying a tree) whose median is the engine's own time for that kind


@dataclass
class Step:
    tokens: list[int]  # newly committed: accepted draft tokens, then the bonus token (cut at the target)
    forward_tokens: int  # tokens in this step's forward pass (tree size incl. root)
    drafted: int  # draft nodes verified
    accepted_sources: list[int] = field(default_factory=list)  # source bitmask per accepted draft token
    rebuilt: bool = False  # the context window was rebuilt before this step
    forced: bool = False  # committed without sampling (an outline's heading, Engine.force): no forward counted
    backtracks: int = 0  # banned phrases: times this step went back to where one began (bans.py)
    let_through: int = 0  # banned phrases kept after bans.MAX_RETRIES exclusions at their start


def make_sources(names: list[str], vocab: int, static_tree: bool = False, heads=None) -> tuple[list[DraftSource], AcceptanceStats]:
    """`heads`: a ready DraftSource factory for "heads", callable(source_id, stats) (see heads.py)."""
    stats = AcceptanceStats(len(SOURCES))
    out: list[DraftSource] = []
    for name in names:
        if name == "heads":
            if heads is None:
                raise ValueError("the heads source needs trained heads")
            out.append(heads(SOURCES.index(name), stats))
        elif name == "recycling":
            out.append(RecyclingDrafter(SOURCES.index(name), stats, vocab, static_tree=static_tree))
        elif name == "ngram":
            out.append(NgramDrafter(SOURCES.index(name), stats))
        else:
            raise ValueError(f"unknown draft source {name}")
    return out, stats


class Engine:
    def __init__(
        self,
        model: Forward,
        sampler: Sampler,
        window: Window,
        sources: list[DraftSource] = (),
        stats: AcceptanceStats | None = None,
        budget: int | None = None,  # draft nodes per step; None = chosen per step from `cost`
        cost: CostCurve | None = None,
        capacity: int = 0,  # tokens S will hold (prompt + target); the buffer is sized once
        stop_ids: tuple[int, ...] = (),  # end the run when one of these is committed (--stop-at-eos)
        cost_at=None,  # callable(cache) -> CostCurve for the cache's context; refreshed as the context grows
        bans: Bans | None = None,  # banned phrases (bans.py); None = none, and no work per step
    ):
        self.model = model
        self.sampler = sampler
        self.window = window
        self.sources = list(sources)
        self.stats = stats
        self.budget = budget
        self.cost = cost
        self.cost_at = cost_at
        self._cost_bucket = -1
        self.stop_ids = set(stop_ids)
        self.bans = bans
        self.final = 0  # with bans: tokens before it are final; the ones after may still be taken back
        rows = model.abilities.max_rows  # the most a forward computes exactly (llama.cpp: its probe's)
        most = min(MAX_BUDGET, rows - 1) if rows is not None else MAX_BUDGET
        max_nodes = 1 + (min(budget, most) if budget is not None else most) if self.sources else 1
        self.max_nodes = max_nodes
        self.cache = model.new_cache(window.context + max_nodes)
        self.S = torch.zeros(max(capacity, window.context + 1), dtype=torch.long)
        self.n = 0
        self.span = (0, 0)  # (s, b) of the context currently in the cache
        self.tree = DraftTree()
        self.forwards = 0
        self.stopped = False
        self._idle = 0  # consecutive steps with an automatic budget of 0
        self._explore_every = EXPLORE_EVERY  # resting steps before the costly sources look again
        # Shadow checks of resting steps' trees, waiting for the tokens that decide them: (n at that step, tokens,
        # parents, depths, ranks, sum of scores, whether it was a look).
        self._shadows: list[tuple] = []
        # Calibration of the automatic budget: accepted draft tokens vs the sum of the verified (or, while
        # resting, shadow-checked) nodes' estimates, decayed. The per-(source, depth, rank) rates are fitted on
        # the nodes that got checked, and the best-scoring nodes of a step are exactly the ones whose estimates
        # came out high by chance (and a node several sources proposed keeps the highest), so the raw scores
        # overpromise; on a CPU, where one extra node costs 30% of a step, that turns a small expected gain into
        # a real loss.
        self._real, self._pred = CALIBRATION_PRIOR, CALIBRATION_PRIOR
        self._predicted = 0.0  # the summed estimates of the tree being verified
        # The engine's own time per step beyond its forward's cost on the curve, for the last TIMED resting and tree
        # steps: the curve prices forwards only, and where they are cheap (the H200, 2026-12-04: eager trees at 1.17
        # tokens a forward, 45 tok/s against plain's 71) the work around a tree decides. The budget adds the medians'
        # difference (`extra`) to every tree's cost; medians, because noise (a stall, a warm-up) only adds time.
        self._spent = (deque(maxlen=TIMED), deque(maxlen=TIMED))
        self.extra = 0.0  # seconds; 0 until three trees' steps are timed
        self._warm = False  # whether a tree's step has run (its first is not timed)
        self.pinned = None  # pin_context(): ids kept between the prompt and the recent tokens after a rebuild
        self.prompt_len = window.prompt
        for src in self.sources:
            src.bind(self)

    def pin_context(self, prompt_len: int, pinned) -> None:
        """After a rebuild the context becomes S[:prompt_len] + pinned(r) + S[s:n], r the output index where
        that span's rebuild fell (s + window.recent − prompt_len): a function of the span, not of n, so a resume inside the
        span rebuilds the context the running engine had. The window must reserve room for the longest pin
        (window.prompt = prompt_len + its length). An outline pins the current section's heading and notes."""
        self.prompt_len, self.pinned = prompt_len, pinned

    # -- context --------------------------------------------------------------------------------------

    def _ensure_capacity(self, n: int) -> None:
        if n > self.S.shape[0]:
            grown = torch.zeros(max(n, 2 * self.S.shape[0]), dtype=torch.long)
            grown[: self.n] = self.S[: self.n]
            self.S = grown

    @torch.inference_mode()
    def start(self, history: list[int]) -> None:
        """Take the committed sequence (prompt, or prompt + output on resume) and fill the cache."""
        self._ensure_capacity(len(history) + 1)
        self.S[: len(history)] = torch.tensor(history, dtype=torch.long)
        self.n = len(history)
        self.final = self.n
        if self.bans is not None:
            self.bans.reset(self.n)
        self._rebuild(seed_sources=True)
        hist = self.S[: self.n].numpy()
        for src in self.sources:
            src.after_commit(hist, self.n)

    def _context_ids(self) -> torch.Tensor:
        s, _ = self.window.span(self.n)
        P = self.window.prompt
        if s == P:
            return self.S[: self.n]
        if self.pinned is None:
            return torch.cat([self.S[:P], self.S[s : self.n]])
        pin = torch.tensor(self.pinned(s + self.window.recent - self.prompt_len), dtype=torch.long)
        return torch.cat([self.S[: self.prompt_len], pin, self.S[s : self.n]])

    def _rebuild(self, seed_sources: bool = False) -> None:
        """Prefill the cache with the current context, all but its last token (the next root).

        Where the model's single steps compute other bits than its batches (`steps_apart`: llama.cpp with several
        threads, ggmlmodel), the tokens a running engine wrote a step at a time since this span's rebuild are
        written a step at a time here too, so a resume (or a restart anywhere in the span) holds the bits the
        running engine held. The span's rebuild fell at n0 (the run's start in the first span), and drafting is off
        there, so one step commits one token: the last n - n0 tokens of the body were single steps."""
        ctx = self._context_ids()
        self.span = self.window.span(self.n)
        self.cache.length = 0
        body = ctx[:-1]
        seed = seed_sources and any(isinstance(s, RecyclingDrafter) for s in self.sources)
        singles = 0
        if self.model.abilities.steps_apart:
            s, _ = self.span
            n0 = self.prompt_len if s == self.window.prompt else s + self.window.recent
            singles = max(0, min(self.n - n0, body.shape[0]))
        batched = body.shape[0] - singles
        bounds = [(a, min(a + PREFILL_CHUNK, batched)) for a in range(0, batched, PREFILL_CHUNK)]
        bounds += [(a, a + 1) for a in range(batched, body.shape[0])]
        for a, z in bounds:
            chunk = body[a:z].to(self.model.device)
            pos = torch.arange(a, z, device=self.model.device)
            logits, _ = self.model.forward(chunk, pos, self.cache, logits_for=None if seed else slice(-1, None))
            self.cache.length += chunk.shape[0]
            if seed:
                top = torch.topk(logits, TOPK, dim=-1).indices.cpu().numpy().astype(np.int32)
                for src in self.sources:
                    src.seed(chunk.cpu().numpy(), top)

    # -- one step -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, remaining: int, ends: frozenset | None = None) -> Step:
        """Verify one tree and commit at most `remaining` tokens; with `ends`, stop committing after the first
        token in it (an outline's section can end there): a plain step would have stopped at that token too."""
        rebuilt = False
        if self.n >= self.span[1]:
            self._rebuild()
            rebuilt = True
        t0 = time.perf_counter()
        s, b = self.span
        root = int(self.S[self.n - 1])
        tree = self.tree
        tree.reset(root)
        max_depth = min(b - 1 - self.n, remaining - 1, MAX_DEPTH)
        budget, quiet = self._draft(tree, max_depth) if self.sources and max_depth > 0 else (0, False)
        flat = tree.select(budget, max_depth, device=self.model.device)
        n_nodes = flat.tokens.shape[0]
        base = self.cache.length  # position of the root: the context length minus one
        positions = base + flat.depth
        logits, hidden = self.model.forward(flat.tokens, positions, self.cache, flat.anc if n_nodes > 1 else None)
        self.forwards += 1
        hist_t = self.S[: self.n]
        # the root's row decides position n: the tokens banned there (only positions <= n have any)
        excluded = self.bans.excluded(self.n) if self.bans is not None else None
        processed = self.sampler.process(logits, hist_t, flat.tokens, flat.depth, flat.anc, flat.parent, excluded)
        choice = self.sampler.choose(processed, (self.n + flat.depth).tolist()).tolist()
        path, bonus = walk(flat, choice)
        tok_list = flat.tokens.tolist()
        new = [tok_list[i] for i in path[1:]] + [bonus]
        new = new[:remaining]
        if ends:
            for j, t in enumerate(new):
                if t in ends:
                    new = new[: j + 1]
                    break
        for j, t in enumerate(new):
            if t in self.stop_ids:
                new = new[: j + 1]
                self.stopped = True
                break
        back = None  # the position to go back to: a banned phrase completed (the tokens after it are dropped)
        if self.bans is not None:
            let = self.bans.let_through
            for j, t in enumerate(new):
                back = self.bans.push(self.n + j, t)
                if back is not None:
                    new = new[: j + 1]
                    self.stopped = False  # a stop token after the phrase's end was never reached
                    break
            let = self.bans.let_through - let
        # The cache keeps the root and every committed token but the last (the next root): the accepted path
        # cut to len(new) when the step was cut short, so the next step starts from exactly what was committed.
        self.cache.compact(base, torch.tensor(path[: len(new)], device=self.model.device))
        if self.sources:
            if n_nodes > 1:
                self.stats.update(flat, path)
                if self.budget is None:
                    self._real = self._real * CALIBRATION_DECAY + (len(path) - 1)
                    self._pred = self._pred * CALIBRATION_DECAY + self._predicted
            if not quiet:  # a top-k over the whole vocabulary: quiet steps skip it
                top = torch.topk(processed, TOPK, dim=-1).indices.cpu().numpy().astype(np.int32)
                for src in self.sources:
                    src.after_verify(flat, top)
            resting = self._resting()  # the costly sources sit out the next step: skip their work for it
            for src in self.sources:
                if not (resting and src.costly):
                    src.after_accept(hidden[path[len(new) - 1]])
        self._ensure_capacity(self.n + len(new))
        self.S[self.n : self.n + len(new)] = torch.tensor(new, dtype=torch.long)
        self.n += len(new)
        if self.sources:
            hist = self.S[: self.n].numpy()
            for src in self.sources:
                src.after_commit(hist, len(new))
            if self._shadows:
                self._check_shadows(hist)
            if self.budget is None and self.cost is not None and not rebuilt:
                self._time_step(n_nodes, time.perf_counter() - t0)
        accepted_src = [flat.sources[i] for i in path[1 : len(new) + 1]]  # drafts among the committed tokens
        if self.bans is None:
            return Step(new, n_nodes, n_nodes - 1, accepted_src, rebuilt)
        if back is not None:
            self._back(back)
        # the end of the run (the target, a stop token): what is written is the text, a phrase under way is none
        end = back is None and (len(new) == remaining or self.stopped)
        old = self.final
        final = self.bans.settle(self.n, everything=end)
        self.final = final
        return Step(self.S[old:final].tolist(), n_nodes, n_nodes - 1, accepted_src, rebuilt,
                    backtracks=int(back is not None), let_through=let)

    def _back(self, s: int) -> None:
        """Go back to position s (a banned phrase began there) and exclude its token there: as plain decoding would
        stand had it never chosen that token. The cache drops the tokens from s on (all but the new root S[s - 1]);
        when s lies before the context's last rebuild, the context is rebuilt for s, as a resume at s would."""
        self.bans.back(s, int(self.S[s]))
        drop = self.n - s
        self.n = s
        self._shadows.clear()  # their tokens were taken back
        if self.window.span(s) != self.span or self.cache.length - drop < 0:
            self._rebuild()
        else:
            self.cache.length -= drop
        for src in self.sources:
            src.rewind(s)

    def _draft(self, tree: DraftTree, max_depth: int) -> tuple[int, bool]:
        """Let the sources propose into `tree`; return how many of its nodes to verify, and whether this is a
        quiet resting step (no proposals, and no source learns from its forward: see CHECK_EVERY)."""
        resting = self._resting()
        if resting and self._idle % CHECK_EVERY:
            self._idle += 1
            return 0, True
        hist = self.S[: self.n].numpy()
        limit = self.max_nodes - 1
        for src in self.sources:
            if not (resting and src.costly):
                src.propose(tree, hist, max_depth, limit)
        if self.budget is not None:
            return min(self.budget, limit), False
        bucket = self.cache.length // COST_BUCKET
        if self.cost_at is not None and bucket != self._cost_bucket:
            self.cost, self._cost_bucket = self.cost_at(self.cache), bucket
        scores = tree.best_scores(max_depth)
        budget = best_budget(scores, self.cost, limit, scale=self.calibration, extra=self.extra)
        if budget > 0:
            self._idle, self._explore_every = 0, EXPLORE_EVERY
            self._predicted = sum(scores[:budget])  # what the calibration compares the accepted count with
            return budget, False
        # A budget of 0 verifies nothing, yet the rates must follow the text, or one that turns repetitive would
        # go unnoticed. They need no forward: a node would have been accepted exactly when its path equals the
        # tokens committed after the root (verification accepts what plain decoding writes), so the tree this
        # step would verify if drafting were to pay at all is counted once those tokens exist. Its outcome is
        # what the rates and the calibration must learn, since that tree is the choice against resting.
        look = self._idle >= self._explore_every  # the costly sources proposed too
        # after a look the count restarts at 1, not 0 (0: a tree was just verified): the costly sources rest again
        self._idle = 1 if look else self._idle + 1
        size = best_budget(scores, self.cost, limit, scale=self.calibration, least=1, extra=self.extra)
        self._shadows.append((self.n, *tree.best(size, max_depth), look))
        return 0, False

    @torch.inference_mode()
    def force(self, ids: list[int]) -> None:
        """Commit `ids` without sampling (an outline's heading), as prompt tokens are: the sampler's history, the
        drafters and the loop alarm see them like any committed token, in plain and speculative runs alike. The
        cache takes the old root and all new ids but the last (the next root); when that reaches the next
        rebuild, the next step rebuilds the context at the new length instead, as a resume there would."""
        if not ids:
            return
        self._shadows.clear()  # forced tokens are not the model's choices: they say nothing of a draft
        self._ensure_capacity(self.n + len(ids))
        old = self.n
        self.S[old : old + len(ids)] = torch.tensor(ids, dtype=torch.long)
        self.n += len(ids)
        if self.n < self.span[1]:
            body = self.S[old - 1 : self.n - 1]
            size = 1 if self.model.abilities.steps_apart else PREFILL_CHUNK  # as _rebuild will redo them
            for a in range(0, body.shape[0], size):
                chunk = body[a : a + size].to(self.model.device)
                pos = torch.arange(self.cache.length, self.cache.length + chunk.shape[0], device=self.model.device)
                self.model.forward(chunk, pos, self.cache, logits_for=slice(-1, None))
                self.cache.length += chunk.shape[0]
        if self.sources:
            hist = self.S[: self.n].numpy()
            for src in self.sources:
                src.after_commit(hist, len(ids))

    def _check_shadows(self, hist: np.ndarray) -> None:
        """Count each waiting shadow check whose deepest node's token is committed, as if it had been verified."""
        keep = []
        for shadow in self._shadows:
            n0, tokens, parents, depth, ranks, predicted, look = shadow
            if n0 + depth[-1] > self.n:
                keep.append(shadow)
                continue
            children = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
            path = [0]  # node at depth d guesses hist[n0 - 1 + d]: the root is hist[n0 - 1]
            while len(path) <= depth[-1] and (nxt := children.get((path[-1], int(hist[n0 + len(path) - 1])))) is not None:
                path.append(nxt)
            if len(tokens) > 1:
                self.stats.count(parents, depth, ranks, path)
                self._real = self._real * CALIBRATION_DECAY + (len(path) - 1)
                self._pred = self._pred * CALIBRATION_DECAY + predicted
            if look:  # a look where no costly source's draft was accepted waits twice as long next time
                costly = {src.id for src in self.sources if src.costly}
                found = any(src in costly for i in path[1:] for src in ranks[i])
                self._explore_every = EXPLORE_EVERY if found else min(2 * self._explore_every, EXPLORE_MAX)
        self._shadows = keep

    def _time_step(self, n_nodes: int, seconds: float) -> None:
        """Keep a step's own time (its wall time less its forward's cost on the curve) and update `extra`: the
        seconds a tree's step spends in the engine beyond a resting step's (a resting step counts 0 until one is timed)."""
        tree, rest = self._spent[1], self._spent[0]
        if n_nodes > 1 and not self._warm:  # the first tree's step pays first calls' warm-up (seen: 19 ms on a CPU)
            self._warm = True
            return
        (tree if n_nodes > 1 else rest).append(seconds - float(self.cost(n_nodes)))
        if len(tree) >= 3:  # a median of one or two is one or two steps' noise
            self.extra = max(0.0, median(tree) - (median(rest) if rest else 0.0))

    def _resting(self) -> bool:
        """True while an automatic budget rests at 0: the costly sources (the heads: a few ms of matrix work
        per step) sit out until the explore period has passed (EXPLORE_EVERY steps, doubled after each look that
        accepted nothing, up to EXPLORE_MAX), then every source proposes again into that step's shadow check.
        The cheap sources (table lookups) keep proposing, so a repetition they spot is still taken at once. On a
        CPU where drafts rarely pay, this keeps `auto` near the speed of plain decoding: a resting step runs the
        same one-token forward as a plain step."""
        return self.budget is None and 0 < self._idle < self._explore_every

    @property
    def calibration(self) -> float:
        """Accepted draft tokens per unit of estimated acceptance, recently (1.0: the estimates are right)."""
        return self._real / self._pred

    def run(self, n_new: int):
        """Yield steps until `n_new` more tokens are committed (or a stop token is)."""
        target = self.n + n_new
        while self.n < target and not self.stopped:
            yield self.step(target - self.n)

    # -- drafter state (speed only: the text never depends on it) -----------------------------------------

    def drafter_state(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for src in self.sources:
            out.update(src.state())
        return out

    def load_drafter_state(self, state: dict[str, np.ndarray]) -> list[str]:
        warnings = []
        for src in self.sources:
            try:
                src.load_state(state)
            except (ValueError, KeyError, TypeError) as e:
                warnings.append(f"ignored the saved {src.name} state ({e}); drafting restarts cold, the text is unaffected")
        return warnings
