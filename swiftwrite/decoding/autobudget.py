"""The automatic draft budget: how many nodes of each step's tree to verify, learned as the run goes.

The engine asks it at fixed points of a step: before drafting, whether this resting step is quiet (`quiet`) and
whether the costly sources sit out (`resting`); once the sources have proposed, how many nodes to verify (`choose`);
after a verified tree, how many of its draft tokens were accepted (`verified`); after each commit, to count the
resting steps' trees whose tokens now exist (`check_shadows`); and each step's wall time (`timed`). The budget only
decides how fast the text comes: verification accepts what plain decoding writes, whatever was verified.

Three things move it beside the cost curve (budget.best_budget):
  * calibration: the acceptance estimates are scaled by what verification (or a shadow check) actually accepted;
  * resting: while no tree pays, steps are plain ones, mostly quiet, and the costly sources look only now and then;
  * the engine's own time around a tree, measured, is added to every tree's cost (`extra`).
"""

from __future__ import annotations

from collections import deque
from statistics import median

import numpy as np

from .budget import CostCurve, best_budget
from .drafting import AcceptanceStats, DraftSource
from .tree import DraftTree

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


class AutoBudget:
    def __init__(self, stats: AcceptanceStats, sources: list[DraftSource], cost: CostCurve | None = None,
                 cost_at=None):
        """`stats`: the acceptance rates the sources estimate with (shadow checks count into them); `sources`: the
        engine's sources (a look is judged by the costly ones); `cost_at`: callable(cache) -> CostCurve for the
        cache's context, refreshed as the context grows (see use_costs)."""
        self.stats = stats
        self.sources = sources
        self.cost = cost
        self.cost_at = cost_at
        self._cost_bucket = -1
        self._idle = 0  # consecutive steps with an automatic budget of 0
        self._explore_every = EXPLORE_EVERY  # resting steps before the costly sources look again
        # Shadow checks of resting steps' trees, waiting for the tokens that decide them: (n at that step, tokens,
        # parents, depths, ranks, sum of scores, whether it was a look).
        self._shadows: list[tuple] = []
        # Calibration: accepted draft tokens vs the sum of the verified (or, while resting, shadow-checked) nodes'
        # estimates, decayed. The per-(source, depth, rank) rates are fitted on the nodes that got checked, and the
        # best-scoring nodes of a step are exactly the ones whose estimates came out high by chance (and a node
        # several sources proposed keeps the highest), so the raw scores overpromise; on a CPU, where one extra
        # node costs 30% of a step, that turns a small expected gain into a real loss.
        self._real, self._pred = CALIBRATION_PRIOR, CALIBRATION_PRIOR
        self._predicted = 0.0  # the summed estimates of the tree being verified
        # The engine's own time per step beyond its forward's cost on the curve, for the last TIMED resting and tree
        # steps: the curve prices forwards only, and where they are cheap (the H200, 2026-12-04: eager trees at 1.17
        # tokens a forward, 45 tok/s against plain's 71) the work around a tree decides. The budget adds the medians'
        # difference (`extra`) to every tree's cost; medians, because noise (a stall, a warm-up) only adds time.
        self._spent = (deque(maxlen=TIMED), deque(maxlen=TIMED))
        self.extra = 0.0  # seconds; 0 until three trees' steps are timed
        self._warm = False  # whether a tree's step has run (its first is not timed)

    def use_costs(self, cost_at, cache) -> None:
        """Price forwards with `cost_at(cache)` from now on: the curve for the cache's context now, measured again
        (or read from its cache) each time the context enters another COST_BUCKET."""
        self.cost_at = cost_at
        self.cost = cost_at(cache)
        self._cost_bucket = cache.length // COST_BUCKET

    @property
    def calibration(self) -> float:
        """Accepted draft tokens per unit of estimated acceptance, recently (1.0: the estimates are right)."""
        return self._real / self._pred

    # -- before drafting --------------------------------------------------------------------------------

    def resting(self) -> bool:
        """True while the budget rests at 0: the costly sources (the heads: a few ms of matrix work per step) sit
        out until the explore period has passed (EXPLORE_EVERY steps, doubled after each look that accepted
        nothing, up to EXPLORE_MAX), then every source proposes again into that step's shadow check. The cheap
        sources (table lookups) keep proposing, so a repetition they spot is still taken at once. On a CPU where
        drafts rarely pay, this keeps `auto` near the speed of plain decoding: a resting step runs the same
        one-token forward as a plain step."""
        return 0 < self._idle < self._explore_every

    def quiet(self) -> bool:
        """Whether this step is a quiet resting one (no proposals, no budget, and no source learns from its
        forward: see CHECK_EVERY); a quiet step is counted as rested."""
        if self.resting() and self._idle % CHECK_EVERY:
            self._idle += 1
            return True
        return False

    def choose(self, tree: DraftTree, max_depth: int, limit: int, n: int, cache) -> int:
        """How many of `tree`'s best nodes (no deeper than `max_depth`, at most `limit`) to verify at a step whose
        root is token n - 1 and whose context is `cache`'s. 0 rests: the tree is then kept as a shadow check."""
        bucket = cache.length // COST_BUCKET
        if self.cost_at is not None and bucket != self._cost_bucket:
            self.cost, self._cost_bucket = self.cost_at(cache), bucket
        scores = tree.best_scores(max_depth)
        budget = best_budget(scores, self.cost, limit, scale=self.calibration, extra=self.extra)
        if budget > 0:
            self._idle, self._explore_every = 0, EXPLORE_EVERY
            self._predicted = sum(scores[:budget])  # what the calibration compares the accepted count with
            return budget
        # A budget of 0 verifies nothing, yet the rates must follow the text, or one that turns repetitive would
        # go unnoticed. They need no forward: a node would have been accepted exactly when its path equals the
        # tokens committed after the root (verification accepts what plain decoding writes), so the tree this
        # step would verify if drafting were to pay at all is counted once those tokens exist. Its outcome is
        # what the rates and the calibration must learn, since that tree is the choice against resting.
        look = self._idle >= self._explore_every  # the costly sources proposed too
        # after a look the count restarts at 1, not 0 (0: a tree was just verified): the costly sources rest again
        self._idle = 1 if look else self._idle + 1
        size = best_budget(scores, self.cost, limit, scale=self.calibration, least=1, extra=self.extra)
        self._shadows.append((n, *tree.best(size, max_depth), look))
        return 0

    # -- after a step -----------------------------------------------------------------------------------

    def verified(self, accepted: int) -> None:
        """A tree chosen by `choose` was verified and `accepted` of its draft tokens were accepted."""
        self._real = self._real * CALIBRATION_DECAY + accepted
        self._pred = self._pred * CALIBRATION_DECAY + self._predicted

    def check_shadows(self, hist: np.ndarray, n: int) -> None:
        """Count each waiting shadow check whose deepest node's token is committed (hist[:n]: every token so far),
        as if it had been verified."""
        keep = []
        for shadow in self._shadows:
            n0, tokens, parents, depth, ranks, predicted, look = shadow
            if n0 + depth[-1] > n:
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

    def forget(self) -> None:
        """Drop the waiting shadow checks: the tokens that would decide them were taken back, or were forced."""
        self._shadows.clear()

    def timed(self, n_nodes: int, seconds: float) -> None:
        """Keep a step's own time (its wall time `seconds` less its forward's cost on the curve, over `n_nodes`
        tokens) and update `extra`: the seconds a tree's step spends in the engine beyond a resting step's (a
        resting step counts 0 until one is timed). Nothing without a cost curve."""
        if self.cost is None:
            return
        tree, rest = self._spent[1], self._spent[0]
        if n_nodes > 1 and not self._warm:  # the first tree's step pays first calls' warm-up (seen: 19 ms on a CPU)
            self._warm = True
            return
        (tree if n_nodes > 1 else rest).append(seconds - float(self.cost(n_nodes)))
        if len(tree) >= 3:  # a median of one or two is one or two steps' noise
            self.extra = max(0.0, median(tree) - (median(rest) if rest else 0.0))
