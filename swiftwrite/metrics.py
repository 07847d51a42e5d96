"""Measures of a generated text and of a run against its baseline."""

from __future__ import annotations

from collections.abc import Sequence


def distinct_n(tokens: Sequence[int], n: int) -> float:
    """Distinct-n: unique n-grams / all n-grams (1.0 = no n-gram repeats; a looping text tends to 0)."""
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    return len({tuple(tokens[i : i + n]) for i in range(total)}) / total


def distinct(tokens: Sequence[int], upto: int = 4) -> dict[str, float]:
    return {f"distinct_{n}": round(distinct_n(tokens, n), 4) for n in range(1, upto + 1)}


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where the sequences differ (a length mismatch counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def speedup(rate: float, baseline: float) -> float | None:
    return round(rate / baseline, 3) if baseline > 0 else None


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    if not s:
        raise ValueError("median of nothing")
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
