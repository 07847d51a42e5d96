"""Banned patterns (--ban-pattern): the subset of regular expressions they are written in, parsed and compiled to
a byte NFA that decoding/bans.py steps over the text a byte at a time.

The subset is the one a match can be recognised in incrementally, token by token, with a bound on how far back it
began: literal text; `.` (any character but a newline); classes `[a-z]`, `[^,;]` (a `[^...]` excludes ASCII only);
`\\w \\d \\s` and `\\W \\D \\S`; `?`, `{m}`, `{m,n}`, `{,n}` (lazy `??`, `{m,n}?` too: the same matches); word
boundaries `\\b`; alternation `|`; groups `(...)`, `(?:...)`, `(?P<name>...)`; escapes `\\n \\t \\r \\f \\v \\xhh
\\uhhhh` and escaped punctuation; a leading `(?i)` for any case. Meanings are Python's `re` with `re.ASCII`: `\\w` is
`[A-Za-z0-9_]`, `\\b` sits between a `\\w` character and another (or the text's edge), `(?i)` folds ASCII letters
only. Refused, each in one sentence: `*`, `+` and `{m,}` (they can match text of any length: bound them), a pattern
that can match empty text, anchors `^ $ \\A \\Z`, `\\B`, back references, lookarounds, flags other than a leading
`(?i)`, and invalid syntax.

Text is matched as UTF-8 bytes: a character outside ASCII is its byte sequence, `.` and the negated sets walk a
whole character. Compiling expands the bounded repeats, so `\\w{1,40}` is 40 copies of `\\w`: MAX_STATES caps it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .errors import UsageError

MAX_REPEAT = 255  # the largest {m,n} bound
MAX_STATES = 20_000  # NFA states one pattern may expand to (each repeat copies its body)
# the longest match, in characters: a state of the matcher holds a thread per byte a match may have begun at, so its
# work grows with this; a banned pattern is a phrase's length, not a paragraph's
MAX_LENGTH = 256
ALL = (1 << 128) - 1  # every ASCII byte, as a bit mask
WORD = sum(1 << c for c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
DIGIT = sum(1 << c for c in b"0123456789")
SPACE = sum(1 << c for c in b" \t\n\r\f\v")
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
FLAG = "(?i)"


class PatternError(UsageError):
    """A --ban-pattern that is no valid regular expression, or lies outside the subset; one sentence."""


@dataclass(frozen=True)
class Chars:
    """A set of characters: `ascii` a bit mask over the 128 ASCII codes, `other` True for every character outside
    ASCII or a frozenset of some of them."""

    ascii: int
    other: bool | frozenset = frozenset()

    def __or__(self, o: "Chars") -> "Chars":
        other = True if self.other is True or o.other is True else self.other | o.other
        return Chars(self.ascii | o.ascii, other)

    def negate(self) -> "Chars":
        assert self.other is True or not self.other  # the parser refuses [^é]
        return Chars(ALL & ~self.ascii, not self.other)

    def fold(self) -> "Chars":
        """Closed under ASCII case: each letter's other case added."""
        m = self.ascii
        for c in range(ord("a"), ord("z") + 1):
            if m >> c & 1 or m >> (c - 32) & 1:
                m |= 1 << c | 1 << (c - 32)
        return Chars(m, self.other)


def char(c: str) -> Chars:
    return Chars(1 << ord(c)) if ord(c) < 128 else Chars(0, frozenset(c))


CLASSES = {"w": Chars(WORD), "d": Chars(DIGIT), "s": Chars(SPACE)}
CLASSES.update({k.upper(): v.negate() for k, v in list(CLASSES.items())})
DOT = Chars(ALL & ~(1 << 10), True)


# The parsed pattern: ("set", Chars) | ("cat", [node]) | ("alt", [node]) | ("rep", node, m, n) | ("b",)


class _Parser:
    def __init__(self, src: str, offset: int, icase: bool, refuse):
        self.s, self.i, self.off, self.icase, self.refuse = src, 0, offset, icase, refuse

    def peek(self, k: int = 0) -> str:
        return self.s[self.i + k] if self.i + k < len(self.s) else ""

    def parse(self):
        node = self.alt()
        assert self.i == len(self.s), (self.s, self.i)  # re.compile took it, so a ')' here has its '('
        return node

    def alt(self):
        branches = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.cat())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def cat(self):
        items = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.repeat(self.atom()))
        return ("cat", items)

    def repeat(self, node):
        while True:
            at, c = self.i, self.peek()
            if c and c in "*+":
                self.refuse(f"can match text of any length ('{c}' at position {self.off + at}); write a bounded "
                            "repeat such as " + ("{0,8}" if c == "*" else "{1,8}") + " instead")
            if c == "?":
                m, n = 0, 1
                self.i += 1
            elif c == "{" and (q := re.match(r"\{(\d*)(,?)(\d*)\}", self.s[self.i :])):
                lo, comma, hi = q.groups()
                if comma and not hi:
                    self.refuse(f"can match text of any length ('{q.group(0)}' at position {self.off + at}); give "
                                "the repeat an upper bound, such as {" + (lo or "0") + ",8}")
                if not lo and not comma:
                    return node  # '{}' is literal text in Python: the atom loop takes it
                m = int(lo or 0)
                n = int(hi) if comma else m
                if n > MAX_REPEAT:
                    self.refuse(f"repeats up to {n} times (at position {self.off + at}); at most {MAX_REPEAT} is "
                                "supported")
                self.i += len(q.group(0))
            else:
                return node
            if self.peek() == "+":
                self.refuse(f"uses a possessive repeat (at position {self.off + self.i}), which bans by pattern do "
                            "not support; drop the '+'")
            if self.peek() == "?":  # lazy: the same set of matches
                self.i += 1
            node = ("rep", node, m, n)

    def atom(self):
        at, c = self.i, self.peek()
        self.i += 1
        if c == "(":
            return self.group(at)
        if c == "[":
            return ("set", self.fold(self.cls()))
        if c == ".":
            return ("set", DOT)
        if c in "^$":
            self.unsupported(f"the anchor '{c}'", at)
        if c == "\\":
            return self.escape(at)
        return ("set", self.fold(char(c)))

    def group(self, at: int):
        if self.peek() == "?":
            rest = self.s[self.i + 1 :]
            if rest.startswith(":"):
                self.i += 2
            elif rest.startswith("P<"):
                self.i = self.s.index(">", self.i) + 1
            else:
                what = {"=": "a lookahead", "!": "a lookahead", "<": "a lookbehind", "P": "a back reference",
                        "#": "a comment group", ">": "an atomic group"}.get(rest[:1], "an inline flag")
                self.unsupported(what, at)
        node = self.alt()
        assert self.peek() == ")"
        self.i += 1
        return node

    def escape(self, at: int):
        c = self.peek()
        self.i += 1
        if c == "b":
            return ("b",)
        if c in CLASSES:
            return ("set", CLASSES[c])
        if c in "BAZzG" or c.isdigit():
            self.unsupported("a back reference or an octal escape" if c.isdigit() else f"'\\{c}'", at)
        return ("set", self.fold(char(self.literal_escape(c, at))))

    def literal_escape(self, c: str, at: int) -> str:
        if c in ESCAPES:
            return ESCAPES[c]
        if c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            code = int(self.s[self.i : self.i + width], 16)
            self.i += width
            return chr(code)
        if c.isalnum():  # \N{...} and the like: valid in re, outside the subset
            self.unsupported(f"'\\{c}'", at)
        return c

    def cls(self) -> Chars:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        got, first = Chars(0), True
        while first or self.peek() != "]":
            first = False
            lo = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("]", "") and isinstance(lo, str):
                self.i += 1
                hi = self.class_item()
                assert isinstance(hi, str)  # re.compile refuses a range to a class like \w
                if ord(lo) >= 128 or ord(hi) >= 128:
                    self.unsupported("a range of characters outside ASCII", self.i)
                got |= Chars(sum(1 << k for k in range(ord(lo), ord(hi) + 1)))
            else:
                got |= lo if isinstance(lo, Chars) else char(lo)
        self.i += 1
        if negate:
            if got.other not in (True, frozenset()):
                self.unsupported("a character outside ASCII in a [^...] class", self.i)
            return self.fold(got).negate()  # fold first: (?i)[^a] excludes 'A' too, as re does
        return got

    def class_item(self) -> Chars | str:
        """One character of a class, or a class escape (\\w)."""
        c = self.peek()
        self.i += 1
        if c != "\\":
            return c
        e = self.peek()
        self.i += 1
        if e in CLASSES:
            return CLASSES[e]
        if e == "b":
            return "\b"  # in a class, as in re: a backspace
        if e.isdigit():
            self.unsupported("an octal escape", self.i - 2)
        return self.literal_escape(e, self.i - 2)

    def fold(self, cs: Chars) -> Chars:
        return cs.fold() if self.icase else cs

    def unsupported(self, what: str, at: int):
        self.refuse(f"uses {what} (at position {self.off + at}), which bans by pattern do not support; see README "
                    "'Banned phrases' for the subset")


def _lengths(node) -> tuple[int, int]:
    """(fewest, most) characters a node matches."""
    kind = node[0]
    if kind == "set":
        return 1, 1
    if kind == "b":
        return 0, 0
    if kind == "rep":
        lo, hi = _lengths(node[1])
        return lo * node[2], hi * node[3]
    parts = [_lengths(n) for n in node[1]]
    if kind == "cat":
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    return min(p[0] for p in parts), max(p[1] for p in parts)


# ---------------------------------------------------------------------------------------------------------
# The NFA


class Nfa:
    """States 0.. with `edges[q]` [(byte mask as an int, next state)], `eps[q]` the states reached without a byte,
    `bound[q]` those reached across a word boundary, `accept[q]`; state 0 the start."""

    def __init__(self):
        self.edges: list[list[tuple[int, int]]] = []
        self.eps: list[list[int]] = []
        self.bound: list[list[int]] = []
        self.accept: list[bool] = []
        self.new()

    def new(self) -> int:
        if len(self.accept) >= MAX_STATES:
            raise OverflowError
        self.edges.append([])
        self.eps.append([])
        self.bound.append([])
        self.accept.append(False)
        return len(self.accept) - 1

    def build(self, node, q: int) -> int:
        """Add `node` after state q; return the state its matches end in."""
        kind = node[0]
        if kind == "set":
            return self._chars(node[1], q)
        if kind == "b":
            e = self.new()
            self.bound[q].append(e)
            return e
        if kind == "cat":
            for n in node[1]:
                q = self.build(n, q)
            return q
        end = self.new()
        if kind == "alt":
            for n in node[1]:
                self.eps[self.build(n, q)].append(end)
            return end
        _, body, m, n = node
        for _ in range(m):
            q = self.build(body, q)
        for _ in range(n - m):  # each optional copy may be skipped straight to the end
            self.eps[q].append(end)
            q = self.build(body, q)
        self.eps[q].append(end)
        return end

    def _chars(self, cs: Chars, q: int) -> int:
        end = self.new()
        if cs.ascii:
            self.edges[q].append((cs.ascii, end))
        if cs.other is True:  # any character outside ASCII: a lead byte, then its continuation bytes
            for lead, more in ((range(0xC2, 0xE0), 1), (range(0xE0, 0xF0), 2), (range(0xF0, 0xF5), 3)):
                s = q
                for k in range(more + 1):
                    t = end if k == more else self.new()
                    self.edges[s].append((_mask(lead) if k == 0 else _mask(range(0x80, 0xC0)), t))
                    s = t
        else:
            for ch in sorted(cs.other):
                s, bs = q, ch.encode("utf-8")
                for k, b in enumerate(bs):
                    t = end if k == len(bs) - 1 else self.new()
                    self.edges[s].append((1 << b, t))
                    s = t
        return end


def _mask(r: range) -> int:
    return sum(1 << b for b in r)


def parse(pattern: str, where: str = "--ban-pattern"):
    """The pattern's tree and whether it ignores case; PatternError (one sentence) outside the subset."""

    def refuse(why: str):
        raise PatternError(f"{where} '{pattern}' {why}.")

    icase = pattern.startswith(FLAG)
    body = pattern[len(FLAG) :] if icase else pattern
    try:
        re.compile(body, re.ASCII | (re.IGNORECASE if icase else 0))
    except (re.error, OverflowError, RecursionError) as e:
        at = f" at position {e.pos + (len(FLAG) if icase else 0)}" if getattr(e, "pos", None) is not None else ""
        refuse(f"is not a valid regular expression ({getattr(e, 'msg', e)}{at}); fix it, or ban the text with --ban")
    if not body:
        refuse("is empty; give the text to ban")
    node = _Parser(body, len(FLAG) if icase else 0, icase, refuse).parse()
    fewest, most = _lengths(node)
    if fewest == 0:
        refuse("can match empty text, which cannot be banned; make some part of it required")
    if most > MAX_LENGTH:
        refuse(f"can match up to {most:,} characters; at most {MAX_LENGTH} are supported, so use smaller repeat "
               "counts")
    return node


@functools.lru_cache(maxsize=256)
def compile_patterns(patterns: tuple[str, ...], where: str = "--ban-pattern") -> Nfa:
    """One NFA for all the patterns: from state 0 to each one's start without a byte. PatternError as parse."""
    nfa = Nfa()
    for p in patterns:
        node = parse(p, where)
        try:
            start = nfa.new()
            nfa.eps[0].append(start)
            nfa.accept[nfa.build(node, start)] = True
        except OverflowError:
            raise PatternError(f"{where} '{p}' expands to more than {MAX_STATES:,} states (each bounded repeat "
                               "copies what it repeats); use smaller repeat counts.") from None
    return nfa


def longest_match(patterns) -> int:
    """The most characters a match of any of the (checked) patterns spans."""
    return max(_lengths(parse(p))[1] for p in patterns)


def check_patterns(patterns, where: str = "--ban-pattern") -> tuple[str, ...]:
    """The patterns in order, without repeats; PatternError for the first one outside the subset."""
    out = tuple(dict.fromkeys(patterns))
    compile_patterns(out, where)
    return out
