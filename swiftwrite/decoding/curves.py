"""The cost curves an automatic budget prices trees with: measured once per model, machine, thread count and
1K-token context bucket, then kept on disk ($SWIFTWRITE_HOME/cost_curves.json). The assembly decides the key (what
a curve depends on) and whether later buckets can be measured ahead; `Curves.fit` gives an engine its curves at
the start of a run, so no measurement lands inside a timed loop (bench) or stalls a step mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import budget as budget_mod
from .autobudget import COST_BUCKET


@dataclass(frozen=True)
class Curves:
    path: Path  # the JSON file the curves are kept in
    key: str  # model, device, dtype, threads, backend ...: what a curve depends on besides the context bucket
    plan: tuple[int, ...] | None  # a model whose trees' rows are padded (ops.row_plan): 9 tokens may cost what 16 do
    # llama.cpp cannot run at a scratch length past the committed tokens (its sequences' positions are checked), so
    # a later bucket could only be measured when the run gets there, inside the loop; its one curve, measured at the
    # start, is kept for the whole run instead (the budget compares costs, and the sizes' ratios move little)
    bucketed: bool

    def at(self, model, cache) -> budget_mod.CostCurve:
        """The curve for the cache's context: kept, or measured now and kept."""
        bucket = cache.length // COST_BUCKET if self.bucketed else 0
        curve = budget_mod.cached_curve(self.path, f"{self.key}/ctx{bucket}", lambda: budget_mod.measure(model, cache))
        return curve.padded(list(self.plan)) if self.plan else curve

    def fit(self, engine, upto: int | None = None) -> None:
        """Give an automatic-budget engine its curves: the current bucket's now, and with `upto` (the longest
        context this run will reach) every later bucket's too. Engines that draft nothing or at a fixed budget
        need none."""
        if engine.auto is None:  # drafts nothing, or at a fixed budget
            return
        cost_at = lambda cache: self.at(engine.model, cache)  # noqa: E731
        engine.auto.use_costs(cost_at, engine.cache)
        if upto and self.bucketed:
            self._measure_ahead(engine, upto, cost_at)

    def _measure_ahead(self, engine, upto: int, cost_at) -> None:
        cache, length = engine.cache, engine.cache.length
        try:
            last = min(upto, engine.window.context, cache.capacity - budget_mod.SIZES[-1]) // COST_BUCKET
            for bucket in range(length // COST_BUCKET + 1, last + 1):
                cache.length = bucket * COST_BUCKET  # scratch slots past the committed ones: timing only
                cost_at(cache)
        finally:
            cache.length = length
