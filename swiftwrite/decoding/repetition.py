"""Verbatim repeats: where the text's ending occurred before, kept up to date token by token.

Two users: the n-gram repetition suppression in the sampler (DRY, below) and the loop alarm of the writer.
Both ask one question of a text h[0..i]: for every earlier end position e < i, how long is the common suffix
of h[..e] and h[..i] (the match "ending at e")? Only matches of at least `min_len` tokens matter, and those
are exactly the earlier occurrences of the last `min_len` tokens, so an index from each `min_len`-gram to
the positions where it ended finds them, and the length follows from the previous position's matches:

    match(e, i) = match(e - 1, i - 1) + 1   when h[e] == h[i]   (a match ending at e - 1 grew by one)

so a match of the new ending at e is the old match at e - 1 plus one, or exactly `min_len` if there was none
that long. Each new token costs O(occurrences of its `min_len`-gram), never a scan of the text, and the same
step extends a committed state to a draft-tree node (the committed text plus the node's ancestors), so a node
costs O(matches + depth). Everything is a pure function of the token history: a resumed run or a rebuilt
context recomputes it instead of storing it.

A sequence breaker (a newline, by default) is never part of a match: an n-gram containing one is not indexed,
so no match runs back across it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

EMPTY = np.zeros(0, dtype=np.int64)
FLOAT_MAX_LOG = 88.7228391  # ln(float32 max): the penalty's exponent is capped so it stays finite


class _Positions:
    """A growable sorted array of end positions (appended in increasing order)."""

    __slots__ = ("buf", "n")

    def __init__(self):
        self.buf = np.empty(4, dtype=np.int64)
        self.n = 0

    def append(self, e: int) -> None:
        if self.n == self.buf.shape[0]:
            self.buf = np.concatenate([self.buf, np.empty(self.n, dtype=np.int64)])
        self.buf[self.n] = e
        self.n += 1

    def view(self) -> np.ndarray:
        return self.buf[: self.n]


class _GramIndex:
    """Every end position of each `A`-gram of the history, in the memory a long run can afford.

    Most grams of a long text occur once (the loop alarm's 16-grams nearly all, DRY's 3-grams most): a dict of
    bytes keys to arrays cost ~400 and ~230 bytes a token, 0.6 KB a token together, which was the resident set's
    growth over a 100K run. Here a gram seen once takes one slot of a numpy open-addressing table (its end
    position; at most half the slots full), and only a repeated gram gets a growable array. A slot is found by the
    hash of the gram's bytes and confirmed by comparing the gram with the history at the slot's position, so two
    grams never share one: the positions returned are exactly the dict's."""

    __slots__ = ("A", "pos", "used", "many")

    def __init__(self, A: int):
        self.A = A
        self.pos = np.full(1024, -1, dtype=np.int64)  # a gram's first end position; -1: a free slot
        self.used = 0
        self.many: dict[int, _Positions] = {}  # slot -> every end position, for grams seen more than once

    def _slot(self, key: bytes, h: np.ndarray) -> tuple[int, bool]:
        """The slot holding the gram whose bytes are `key`, or the free slot it would take; whether it holds it."""
        mask, A = self.pos.shape[0] - 1, self.A
        s = hash(key) & mask
        while True:
            p = int(self.pos[s])
            if p < 0:
                return s, False
            if h[p - A + 1 : p + 1].astype(np.int64, copy=False).tobytes() == key:
                return s, True
            s = (s + 1) & mask

    def get(self, key: bytes, h: np.ndarray) -> np.ndarray:
        """The sorted end positions of the gram (`key`: its int64 bytes) in the history `h`."""
        s, found = self._slot(key, h)
        if not found:
            return EMPTY
        many = self.many.get(s)
        return many.view() if many is not None else self.pos[s : s + 1]

    def add(self, key: bytes, h: np.ndarray, i: int) -> np.ndarray:
        """Record that the gram ended at i (after every earlier end); its earlier end positions, as get() gives."""
        s, found = self._slot(key, h)
        if not found:
            self.pos[s] = i
            self.used += 1
            if 2 * self.used > self.pos.shape[0]:
                self._grow(h)
            return EMPTY
        many = self.many.get(s)
        if many is None:
            many = self.many[s] = _Positions()
            many.append(int(self.pos[s]))
        occ = many.view()
        many.append(i)
        return occ

    def _grow(self, h: np.ndarray) -> None:
        old, many, A = self.pos, self.many, self.A
        self.pos = np.full(2 * old.shape[0], -1, dtype=np.int64)
        self.many = {}
        for s in np.flatnonzero(old >= 0).tolist():
            p = int(old[s])
            t, _ = self._slot(h[p - A + 1 : p + 1].astype(np.int64, copy=False).tobytes(), h)
            self.pos[t] = p
            if s in many:
                self.many[t] = many[s]


@dataclass(frozen=True)
class Matches:
    """The earlier occurrences of a text's ending: `ends` (sorted end positions e < i) and `lens`, each match's
    length not counting the window (`Repeats.capped` applies it)."""

    ends: np.ndarray
    lens: np.ndarray
    at: int  # i, the position of the text's last token

    @staticmethod
    def none(at: int) -> "Matches":
        return Matches(EMPTY, EMPTY, at)


class Repeats:
    """The matches of a token history's ending, kept in step with the history as it grows.

    min_len: shortest match tracked (DRY's allowed length; the loop alarm's floor).
    breaker: bool [vocab], True for tokens no match may contain; None = none.
    window: only the last `window` tokens count, the earlier occurrence included (0 = the whole text).
    start: no earlier occurrence may begin before this position (a source document in the prompt).
    """

    def __init__(self, min_len: int, breaker: np.ndarray | None = None, window: int = 0, start: int = 0):
        if min_len < 1:
            raise ValueError("min_len must be at least 1")
        self.min_len = min_len
        self.breaker = breaker
        self.window = window
        self.start = start
        self.reset()

    def reset(self) -> None:
        self.n = 0  # tokens indexed so far
        self._index = _GramIndex(self.min_len)
        self.current = Matches.none(-1)
        self._tail = EMPTY

    # -- the committed history --------------------------------------------------------------------------

    def sync(self, history: np.ndarray) -> None:
        """Bring the index up to `history` (int64). Appended tokens extend it; anything else (a shorter or a
        different history) rebuilds it from scratch, which gives the same state by construction."""
        N = history.shape[0]
        if N < self.n or not np.array_equal(history[self.n - self._tail.shape[0] : self.n], self._tail):
            self.reset()
        for i in range(self.n, N):
            self._push(history, i)
        self._tail = history[max(0, N - 8) : N].copy()

    def _push(self, h: np.ndarray, i: int) -> None:
        key = self._key(h[max(0, i - self.min_len + 1) : i + 1], i)
        if key is None:
            self.current = Matches.none(i)
        else:
            occ = self._index.add(key, h, i)
            self.current = self._grow(self.current, occ, i)
        self.n = i + 1

    # -- one step, for committed tokens and tree nodes alike ---------------------------------------------

    def _key(self, gram: np.ndarray, i: int) -> bytes | None:
        """The index key of the `min_len` tokens ending at i, or None when there are fewer or one breaks."""
        if i + 1 < self.min_len or (self.breaker is not None and self.breaker[gram].any()):
            return None
        return gram.astype(np.int64, copy=False).tobytes()

    def window_start(self, i: int) -> int:
        return max(self.start, i + 1 - self.window) if self.window > 0 else self.start

    def _grow(self, prev: Matches, occ: np.ndarray, i: int) -> Matches:
        """The matches ending at i from those ending at i - 1 (`prev`) and the earlier end positions `occ`
        (sorted, < i) of the `min_len`-gram ending at i."""
        lo = self.window_start(i) + self.min_len - 1  # an occurrence must lie inside the window
        if occ.shape[0] and occ[0] < lo:
            occ = occ[np.searchsorted(occ, lo) :]
        if occ.shape[0] == 0:
            return Matches.none(i)
        if prev.ends.shape[0] == 0:
            return Matches(occ, np.full(occ.shape[0], self.min_len, dtype=np.int64), i)
        j = np.minimum(np.searchsorted(prev.ends, occ - 1), prev.ends.shape[0] - 1)
        grew = prev.ends[j] == occ - 1
        return Matches(occ, np.where(grew, prev.lens[j] + 1, self.min_len), i)

    def capped(self, m: Matches) -> np.ndarray:
        """Match lengths within the window: a match may not start before it."""
        if self.window <= 0 and self.start <= 0:
            return m.lens
        return np.minimum(m.lens, m.ends - self.window_start(m.at) + 1)

    def child(self, h: np.ndarray, n: int, ext: np.ndarray, parent: Matches) -> Matches:
        """The matches of the virtual text h[:n] + ext (a tree node whose ancestors after the committed
        root are `ext`, itself last), from its parent's. h[:n] must be synced."""
        i = n - 1 + ext.shape[0]
        A = self.min_len
        gram = virtual(h, n, ext, max(0, i - A + 1), i + 1)
        key = self._key(gram, i)
        if key is None:
            return Matches.none(i)
        occ = self._index.get(key, h)
        # occurrences ending inside the node's own path (after the committed text, before the node)
        inside = [e for e in range(max(n, A - 1), i) if np.array_equal(virtual(h, n, ext, e - A + 1, e + 1), gram)]
        if inside:
            occ = np.concatenate([occ, np.array(inside, dtype=np.int64)])
        return self._grow(parent, occ, i)


def virtual(h: np.ndarray, n: int, ext: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Positions lo..hi-1 of the text h[:n] + ext."""
    if hi <= n:
        return h[lo:hi]
    if lo >= n:
        return ext[lo - n : hi - n]
    return np.concatenate([h[lo:n], ext[: hi - n]])


# -- DRY: n-gram repetition suppression -------------------------------------------------------------------


@dataclass(frozen=True)
class DrySettings:
    multiplier: float = 0.0  # 0 = off
    base: float = 1.75
    allowed_length: int = 2
    window: int = 0  # 0 = the whole text
    breakers: tuple[int, ...] = ()  # token ids that end a match (tokens whose text holds a breaker string)
    start: int = 0  # earlier occurrences must begin at or after this position (the written text, with --source)

    @property
    def on(self) -> bool:
        return self.multiplier > 0


class Dry:
    """For a candidate token t: L(t) = the longest suffix of the text that, followed by t, already occurred
    (within the window, never across a breaker). If L(t) >= A, t's logit loses m * b^(L(t) - A). The one
    function `penalties` serves plain decoding (a tree of one node) and every node of a draft tree."""

    def __init__(self, s: DrySettings, vocab: int):
        self.s = s
        breaker = np.zeros(vocab, dtype=bool)
        if s.breakers:
            breaker[np.asarray(s.breakers, dtype=np.int64)] = True
        self.breaker = breaker
        self.repeats = Repeats(s.allowed_length, breaker if s.breakers else None, s.window, s.start)
        # Past this exponent base^x overflows float32 (llama.cpp caps it the same way)
        self.max_exp = int(FLOAT_MAX_LOG / math.log(s.base)) if s.base > 1.000001 else 0

    def penalty(self, L: np.ndarray) -> np.ndarray:
        x = L - self.s.allowed_length
        if self.max_exp > 0:
            x = np.minimum(x, self.max_exp)
        return self.s.multiplier * np.power(self.s.base, x.astype(np.float64))

    def _amounts(self, h: np.ndarray, n: int, ext: np.ndarray, m: Matches) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, amount to subtract) for one node's matches; a token may appear more than once."""
        if m.ends.shape[0] == 0:
            return EMPTY, np.zeros(0)
        nxt = m.ends + 1  # where each earlier occurrence went on: < n in the committed text, else in ext
        if ext.shape[0]:
            follow = np.where(nxt < n, h[np.minimum(nxt, n - 1)], ext[np.clip(nxt - n, 0, ext.shape[0] - 1)])
        else:
            follow = h[nxt]
        L = self.repeats.capped(m)
        keep = (L >= self.s.allowed_length) & ~self.breaker[follow]  # a breaker itself is never penalised
        return follow[keep], self.penalty(L[keep])

    def penalties(self, history: np.ndarray, tokens: np.ndarray, depth: np.ndarray, parent: np.ndarray):
        """Per node of a tree (node 0 = the root = history's last token; parents before children):
        (row indices, token ids, amounts). The amount for a (row, token) pair is the largest listed."""
        n = history.shape[0]
        self.repeats.sync(history)
        states: list[Matches] = [self.repeats.current]
        exts: list[np.ndarray] = [EMPTY]
        rows, toks, amts = [], [], []
        for k in range(tokens.shape[0]):
            if k > 0:
                p = int(parent[k])
                exts.append(np.append(exts[p], tokens[k]).astype(np.int64))
                states.append(self.repeats.child(history, n, exts[k], states[p]))
            t, a = self._amounts(history, n, exts[k], states[k])
            if t.shape[0]:
                rows.append(np.full(t.shape[0], k, dtype=np.int64))
                toks.append(t)
                amts.append(a)
        if not rows:
            return EMPTY, EMPTY, np.zeros(0)
        return np.concatenate(rows), np.concatenate(toks), np.concatenate(amts)


def dry_reference(history: list[int], s: DrySettings, vocab: int) -> np.ndarray:
    """The rule written out directly (a scan of the whole window per candidate): the amount each vocabulary
    id loses after `history`. For tests; O(window^2)."""
    N = len(history)
    ws = max(s.start, N - s.window) if s.window > 0 else s.start
    brk = set(s.breakers)
    L = [0] * vocab
    for k in range(ws + 1, N):  # history[k] followed an earlier stretch ending at k - 1
        ell = 0
        while (k - 1 - ell >= ws and history[k - 1 - ell] == history[N - 1 - ell]
               and history[N - 1 - ell] not in brk):
            ell += 1
        L[history[k]] = max(L[history[k]], ell)
    out = np.zeros(vocab)
    for t in range(vocab):
        if L[t] >= s.allowed_length and t not in brk:
            x = L[t] - s.allowed_length
            if s.base > 1.000001:
                x = min(x, int(FLOAT_MAX_LOG / math.log(s.base)))
            out[t] = s.multiplier * s.base ** x
    return out


# -- the loop alarm ---------------------------------------------------------------------------------------

LOOP_FLOOR = 16  # shortest repeat the alarm tracks: below it a match is an ordinary phrase (config.MIN_LOOP)
LOOP_WARN = 256  # a repeat this long is a loop, not a quotation: the writer warns once per loop


class LoopWatch:
    """The longest verbatim repeat the written text is currently in: how many of its last tokens already
    occurred, in the same order, earlier in the text (newlines included; no breakers, no window). It reads
    committed tokens only and changes no logits. 0 while that is under LOOP_FLOOR tokens."""

    def __init__(self, tokens: list[int] | None = None):
        self.repeats = Repeats(LOOP_FLOOR)
        self.buf = np.zeros(1024, dtype=np.int64)
        self.n = 0
        if tokens:
            self.extend(tokens)

    def extend(self, ids: list[int]) -> int:
        if self.n + len(ids) > self.buf.shape[0]:
            self.buf = np.concatenate([self.buf, np.zeros(max(len(ids), self.buf.shape[0]), dtype=np.int64)])
        self.buf[self.n : self.n + len(ids)] = ids
        self.n += len(ids)
        self.repeats.sync(self.buf[: self.n])
        return self.current

    @property
    def current(self) -> int:
        lens = self.repeats.current.lens
        return int(lens.max()) if lens.shape[0] else 0
