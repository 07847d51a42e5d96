"""Measures of a generated text and of a run against its baseline."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np


def distinct_n(tokens: Sequence[int], n: int) -> float:
    """Distinct-n: unique n-grams / all n-grams (1.0 = no n-gram repeats; a looping text tends to 0)."""
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    return len({tuple(tokens[i : i + n]) for i in range(total)}) / total


def distinct(tokens: Sequence[int], upto: int = 4) -> dict[str, float]:
    return {f"distinct_{n}": round(distinct_n(tokens, n), 4) for n in range(1, upto + 1)}


def distinct_per_window(tokens: Sequence[int], window: int = 500) -> list[float]:
    """Distinct-1 of each whole `window`-token stretch, in order. Where Distinct-4 and the longest repeat miss
    the two ways a small model's long text fails (word salad reads near 1, a template loop near 0.1-0.3),
    this shows both, as a curve along the text."""
    return [round(distinct_n(tokens[lo : lo + window], 1), 3) for lo in range(0, len(tokens) - window + 1, window)]


GLUED_LETTERS = 17  # longer than "responsibilities" (16): English words this long are rare; glued words are not


def glued_share(text: str, letters: int = GLUED_LETTERS) -> float:
    """Share of the text's non-space characters that sit in 'words' (whitespace-separated) of at least `letters`
    letters: 0 for prose; 0.3-0.45 where a small model glues words together without spaces
    ("lifeselifebelovedlovely..."), which no token-level measure sees (the ids are ordinary word pieces)."""
    words = text.split()
    total = sum(len(w) for w in words)
    glued = sum(len(w) for w in words if sum(c.isalpha() for c in w) >= letters)
    return round(glued / total, 4) if total else 0.0


def capitalised_share(text: str) -> float:
    """Share of words (runs of letters) that start with a capital: ~0.05-0.15 for this model's prose, 0.3-0.6
    where it slides into streams of Capitalised Words ("Just Want It Now So I Will Not Get Anymore")."""
    words = re.findall(r"[^\W\d_]+", text)
    return round(sum(w[0].isupper() for w in words) / len(words), 4) if words else 0.0


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


def longest_repeat(tokens: Sequence[int]) -> int:
    """Length of the longest stretch of tokens that occurs at least twice in the text (the two occurrences
    may overlap): 0 for a text with no repeated token. Binary search on the length, each length checked by
    rolling hashes of every window and confirmed token by token, so O(n log n) for a 100K-token text."""
    a = np.asarray(tokens, dtype=np.int64)
    n = a.shape[0]
    if n < 2:
        return 0
    mods, B = (2_147_483_647, 2_147_483_629), 1_000_003
    prefix = []
    for p in mods:  # prefix[i] = hash of a[:i]
        h = np.zeros(n + 1, dtype=np.int64)
        acc = 0
        for i, t in enumerate(a.tolist()):
            acc = (acc * B + t + 1) % p
            h[i + 1] = acc
        prefix.append(h)

    def repeated(L: int) -> bool:
        keys = None
        for p, h in zip(mods, prefix):
            w = (h[L:] - h[: n - L + 1] * pow(B, L, p) % p) % p
            keys = w if keys is None else keys * p + w  # < 2^62: two 31-bit residues in one int64
        order = np.argsort(keys, kind="stable")
        same = np.nonzero(keys[order][1:] == keys[order][:-1])[0]
        return any(np.array_equal(a[order[j] : order[j] + L], a[order[j + 1] : order[j + 1] + L]) for j in same[:64])

    lo, hi = 0, n - 1  # repeated(lo) holds (the empty stretch); find the largest L that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if repeated(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def lookup_hits(prompt: Sequence[int], text: Sequence[int], k: int) -> float:
    """The reuse ceiling: the share of `text`'s tokens that equal what followed the most recent earlier
    occurrence (in prompt + text before it) of the k tokens before them. A draft source that copies from
    earlier text (n-gram tables, prompt lookup) can be right at most this often at depth 1 with context k;
    a text that does not restate its source leaves it near zero, whatever the source's cleverness."""
    seq = list(prompt) + list(text)
    last: dict[tuple, int] = {}  # k-gram -> the position after its most recent occurrence
    hits = 0
    for i in range(k, len(seq)):
        key = tuple(seq[i - k : i])
        if i >= len(prompt) and key in last and seq[last[key]] == seq[i]:
            hits += 1
        last[key] = i
    return hits / len(text) if text else 0.0


def restated_share(source: Sequence[int], text: Sequence[int], n: int = 4) -> float:
    """The share of `text`'s n-grams found in `source`: how much of a grounded text restates its material."""
    grams = {tuple(source[i : i + n]) for i in range(len(source) - n + 1)}
    total = len(text) - n + 1
    return sum(tuple(text[i : i + n]) in grams for i in range(total)) / total if total > 0 else 0.0
