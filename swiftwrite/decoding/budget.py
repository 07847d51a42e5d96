"""How many draft nodes to verify: the forward-pass cost curve of this machine, and the budget it implies.

A verification forward over n tokens costs c(n). With node estimates p_1 >= p_2 >= ... (probability that
each node is accepted), a tree of the best B nodes yields on average 1 + p_1 + ... + p_B tokens, so the
expected throughput is (1 + sum_{j<=B} p_j) / c(B + 1). The budget is the B that maximises it, chosen
again at every step from that step's own estimates. On a GPU c is nearly flat and B grows large; on a
2-core CPU c(16) is about 3 c(1) and B stays small.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ..base import measurements
from ..models.forward import Cache, Forward
from ..tensors.ops import row_plan, row_times

SIZES = (1, 2, 4, 8, 16, 32, 64)
MAX_BUDGET = 63  # draft nodes; a forward over 64 tokens is the largest size measured


class CostCurve:
    def __init__(self, sizes, seconds):
        self.sizes = np.asarray(sizes, dtype=np.float64)
        self.seconds = np.asarray(seconds, dtype=np.float64)
        self.clean = True  # False: measured on a busy machine, kept for this run only
        # rows[n]: the row count a forward over n tokens really runs (ops.row_plan on a float32 CPU model, set
        # by padded()); None: n itself. A measured size that the plan pads was timed at its padded count.
        self.rows: np.ndarray | None = None
        self._table: np.ndarray | None = None  # cost(1..m), kept: the automatic budget reads it every step

    def __call__(self, n: np.ndarray | int) -> np.ndarray:
        if self.rows is not None:
            n = self.rows[np.minimum(n, len(self.rows) - 1)]
        return np.interp(n, self.sizes, self.seconds)

    def padded(self, plan: list[int]) -> "CostCurve":
        """This curve for a model whose tree forwards run over plan[n] rows (ops.row_plan)."""
        top = int(self.sizes[-1])
        self.rows = np.array([plan[n] if n < len(plan) else n for n in range(top + 1)])
        self._table = None
        return self

    def upto(self, m: int) -> np.ndarray:
        """[cost(1), ..., cost(m)]."""
        if self._table is None or len(self._table) < m:
            self._table = self(np.arange(1, max(m, MAX_BUDGET + 1) + 1))
        return self._table[:m]

    def to_dict(self) -> dict:
        return {"sizes": self.sizes.astype(int).tolist(), "ms": [round(s * 1e3, 2) for s in self.seconds]}

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(d["sizes"], [m / 1e3 for m in d["ms"]])


def best_budget(scores: list[float], cost: CostCurve, cap: int = MAX_BUDGET, scale: float = 1.0, least: int = 0,
                extra: float = 0.0) -> int:
    """argmax_B (1 + scale * sum of the B best scores) / (cost(B + 1) + extra if B else cost(1)), B in least..cap
    (0 when there are fewer than `least` scores). `scale` calibrates the estimates against what verification
    actually accepted (AutoBudget.calibration); `extra` is the engine's own time a verified tree adds to a step
    beyond a resting one's, in seconds (AutoBudget.extra)."""
    p = np.asarray(sorted(scores, reverse=True)[:cap], dtype=np.float64)
    gain = np.empty(len(p) + 1)
    gain[0] = 0.0
    np.cumsum(p, out=gain[1:])
    gain *= scale
    gain += 1.0
    if len(gain) <= least:
        return 0
    seconds = cost.upto(len(gain))
    if extra > 0.0:
        seconds = seconds.copy()  # upto() hands out its kept table
        seconds[1:] += extra
    return least + int(np.argmax(gain[least:] / seconds[least:]))


def measure(model: Forward, cache: Cache, reps: int = 3, sizes=SIZES, tries: int = 3) -> CostCurve:
    """Time forwards of n scratch tokens after the cache's committed slots (nothing is committed).

    A bigger forward never does less work, so a curve that falls by more than noise (another process took
    the CPU during some sizes: on this class of machine that makes a forward 5-100x slower) is measured
    again; if it stays inconsistent it is returned as its monotone envelope with `clean = False`, which
    cached_curve() does not store."""
    curve = None
    for _ in range(tries):
        curve = _measure_once(model, cache, reps, sizes)
        if curve.clean:
            return curve
    curve.seconds, curve._table = np.maximum.accumulate(curve.seconds), None
    return curve


def _measure_once(model: Forward, cache: Cache, reps: int, sizes) -> CostCurve:
    free = cache.capacity - cache.length
    rows = model.abilities.max_rows  # llama.cpp: its exact batch size
    sizes = [n for n in sizes if n <= min(free, rows if rows is not None else n)]
    pos0 = max(0, cache.length)
    out = []
    for n in sizes:
        ids = torch.zeros(n, dtype=torch.long, device=model.device)
        pos = torch.arange(pos0, pos0 + n, device=model.device).clamp_(max=model.cfg.max_positions - 1)
        mask = torch.ones(n, n, dtype=torch.bool, device=model.device).tril_() if n > 1 else None
        model.forward(ids, pos, cache, mask)  # warm-up
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            model.forward(ids, pos, cache, mask)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out.append(best)
    curve = CostCurve(sizes, out)
    curve.clean = consistent(curve)
    return curve


def consistent(curve: CostCurve) -> bool:
    """A bigger forward never costs less, beyond noise: a curve that falls was timed while something else ran."""
    return bool(np.all(curve.seconds >= 0.8 * np.maximum.accumulate(curve.seconds)))


def cached_curve(path: Path, key: str, make) -> CostCurve:
    """The curve stored under `key` in the JSON file `path`, or a fresh measurement stored there (only a clean one:
    measure() marks a busy machine's curve, kept for this run only)."""

    def load(entry) -> CostCurve | None:
        curve = CostCurve.from_dict(entry)
        return curve if len(curve.sizes) and consistent(curve) else None

    return measurements.cached(path, key, make, load, dump=lambda curve: curve.to_dict() if curve.clean else None)


def cached_plan(path: Path, key: str, make) -> list[int]:
    """The row plan (ops.row_plan) stored under `key` in the JSON file `path`, or a fresh one stored there."""

    def load(plan) -> list[int] | None:
        return plan if isinstance(plan, list) and plan and all(isinstance(m, int) and m >= n
                                                               for n, m in enumerate(plan)) else None

    return measurements.cached(path, key, make, load)


def tree_row_plan(model, path: Path, key: str) -> list[int]:
    """The row counts a float32 CPU model's trees run their products over (ops.row_plan), kept under `key` in the
    JSON file `path` like the cost curves: measured at the first run that drafts on a machine (~4 s for the
    default model). A forward is n_layers times a layer's four products plus the LM head; that is what is timed."""

    def measure() -> list[int]:
        layer = model.layers[0]
        per_layer = row_times([layer["wqkv"], layer["wo"], layer["w_gate_up"], layer["w_down"]])
        head = row_times([model.lm_head])
        return row_plan([model.cfg.n_layers * a + b for a, b in zip(per_layer, head)])

    return cached_plan(path, key, measure)
