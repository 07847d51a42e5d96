"""Banned phrases and patterns: the written text never contains one, by going back and choosing again.

The rule, on plain decoding. Tokens are appended one at a time; when the text written so far (the prompt
excluded) would complete a banned phrase, decoding goes back to the token where that phrase began (position s),
forgets every token from s on, and decides position s again with that token's logit removed, exactly as if it
had never been a candidate there. The exclusions of position s last while the text before s stands: going back
further forgets them. After MAX_RETRIES exclusions at one position the match starting there is let through (the
writer says so in one sentence) and the text keeps that continuation.

Matching. Every token is a byte string; the text is matched byte by byte with an Aho-Corasick automaton over the
phrases' variants, ASCII letters folded to lower case. A phrase is stripped of surrounding white space and matches
wherever its letters occur: after a space or not, inside a word or not, in any case for ASCII letters (other
letters: as written, lower, upper, capitalised or title case). The automaton's state after each position is kept,
so a new token costs its bytes, and going back costs nothing but a truncation. Patterns (--ban-pattern, the subset
of base/patterns.py) run beside it, a `Matcher` each: a DFA over the text's bytes as written, made as the text asks
for it, whose states hold no positions (so they stay few), and a walk back over the last bytes to where a match
began, only when one is complete. Their states per position are kept likewise. At a byte that completes several
matches, decoding goes back to the one that begins first. A pattern ending in a word boundary (`cat\\b`) is complete only once the next character is
known: at that character's first byte, or at the end of the run (the end counts as no word character, as in `re`),
where the writer goes back as at any other byte. A `\\b` at the text's start looks at the prompt's last character.

Exact under drafting. The token at position p depends only on the text before p, p's seed and p's exclusions, so
a draft tree applies the exclusions of the root's position to the root's row (deeper positions have none: they
exist only at or before the current length) and the engine feeds the accepted tokens to the automaton one by one,
going back at the first completed phrase exactly where plain decoding does, discarding the rest of the step.

What may be shown. A token can still be taken back while a phrase that began at or before it may complete; the
engine hands out a token only once the automaton has passed a position where no phrase is under way (its root
state, and the matcher's with nothing under way), at or after it: no later going back reaches before such a
position (the state at any position after it can only start phrases after it). Those tokens are final: written,
checkpointed, never taken back. A resumed run starts at such a position with no exclusions past it, as the
uninterrupted run had, so it writes the same text.
"""

from __future__ import annotations

import bisect

import numpy as np

from ..base.errors import UserError
from ..base.patterns import WORD, Nfa, compile_patterns, longest_match
from ..base.userfiles import NOT_UTF8, Kind, read_text

MAX_RETRIES = 8  # exclusions at one position before a match that starts there is let through
MOVES = 1 << 16  # moves of the patterns' states kept (Bans._move): a few MB


class PhraseError(UserError):
    """A phrase that can never be written (empty, only white space, longer than the context), or a ban file that
    cannot be read; the message is one sentence."""


# a NUL byte gets the sentence of bytes that are no UTF-8: either way the file holds no phrases of text
BAN_FILE = Kind("--ban-file", "give a text file with one phrase per line", PhraseError, binary=NOT_UTF8)


def variants(phrase: str) -> list[bytes]:
    """The byte strings a phrase is matched as (ASCII-lower-cased, as the automaton folds its input)."""
    p = phrase.strip()
    forms = {p, p.lower(), p.upper(), p.capitalize(), p.title()}
    return sorted({f.encode("utf-8").lower() for f in forms})


def check_phrases(phrases, where: str = "--ban") -> tuple[str, ...]:
    """The phrases stripped of surrounding white space, in order, without repeats; PhraseError for an empty one."""
    out: list[str] = []
    for p in phrases:
        if not p.strip():
            raise PhraseError(f"{where} got an empty phrase ({p!r}); every banned phrase needs a visible character.")
        if p.strip() not in out:
            out.append(p.strip())
    return tuple(out)


PATTERN_LINE = "re:"  # a ban file's line that starts so is a pattern (base/patterns.py), taken as written after it


def read_ban_file(path: str) -> list[str]:
    """One phrase per line, blank lines skipped. PhraseError (one sentence) for a missing, unreadable or binary file."""
    return [line for line in read_text(path, BAN_FILE).splitlines() if line.strip()]


def split_lines(lines: list[str]) -> tuple[list[str], list[str]]:
    """A ban file's lines as (phrases, patterns): a line starting with `re:` is a pattern."""
    phrases = [line for line in lines if not line.startswith(PATTERN_LINE)]
    return phrases, [line[len(PATTERN_LINE) :] for line in lines if line.startswith(PATTERN_LINE)]


class Automaton:
    """Aho-Corasick over bytes: `goto[state, byte]` the next state, `out[state]` the lengths of the patterns that end
    there (longest first), state 0 the root."""

    def __init__(self, patterns: list[bytes]):
        children: list[dict[int, int]] = [{}]
        ends: list[set[int]] = [set()]
        for p in patterns:
            s = 0
            for b in p:
                if b not in children[s]:
                    children.append({})
                    ends.append(set())
                    children[s][b] = len(children) - 1
                s = children[s][b]
            ends[s].add(len(p))
        n = len(children)
        goto = np.zeros((n, 256), dtype=np.int32)
        fail = [0] * n
        order = []
        for b, c in children[0].items():
            goto[0, b] = c
            order.append(c)
        for s in order:  # breadth first: a state's fail state is done before its children
            goto[s] = goto[fail[s]]
            ends[s] |= ends[fail[s]]
            for b, c in children[s].items():
                fail[c] = int(goto[fail[s], b])
                goto[s, b] = c
                order.append(c)
        self.goto = goto.tolist()  # plain lists: a few bytes per token, stepped one at a time
        self.out = [sorted(e, reverse=True) for e in ends]
        self.longest = max((len(p) for p in patterns), default=0)


class Matcher:
    """One banned pattern's NFA (base/patterns.py) run forward as a DFA made as the text asks for it, and backward
    over the last bytes to find where a match began.

    Forward, a state is the set of threads under way, each (NFA state, what the next byte must be: None anything,
    True a word character, False not one, after a word boundary `\\b` was crossed), the kinds of match waiting on
    the next byte (a pattern ending in `\\b`: "cat\\b" is matched in "cat," and not in "cats") and whether the
    last byte is a word character; a new thread starts at every byte. No positions in it, so the states are few and
    recur, and each (state, byte) is worked out once: a byte costs one dict look-up. Where a move completes a match,
    `starts` walks the reversed NFA back over at most `longest` bytes to every place such a match begins (rare:
    only where decoding is about to go back)."""

    def __init__(self, nfa: Nfa, longest: int):
        self.nfa, self.longest = nfa, longest
        n = len(nfa.accept)
        self.rev_edges: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.rev_eps: list[list[int]] = [[] for _ in range(n)]
        self.rev_bound: list[list[int]] = [[] for _ in range(n)]
        for q in range(n):
            for mask, t in nfa.edges[q]:
                self.rev_edges[t].append((mask, q))
            for t in nfa.eps[q]:
                self.rev_eps[t].append(q)
            for t in nfa.bound[q]:
                self.rev_bound[t].append(q)
        self.accepts = [q for q in range(n) if nfa.accept[q]]
        self.ids: dict = {}
        self.states: list[tuple[frozenset, frozenset, bool]] = []
        self.idle: list[bool] = []  # nothing under way: no later match can begin before this point
        self.moves: list[dict[int, tuple[int, bool, bool]]] = []
        self.fresh = tuple(self._close([(0, None)], w)[0] for w in (False, True))  # a thread started here
        self.roots = tuple(self._intern(frozenset(), frozenset(), w) for w in (False, True))

    def _intern(self, under: frozenset, pending: frozenset, word: bool) -> int:
        key = (under, pending, word)
        if key not in self.ids:
            self.ids[key] = len(self.states)
            self.states.append(key)
            self.idle.append(not under and not pending)
            self.moves.append({})
        return self.ids[key]

    def _close(self, kernel, word: bool) -> tuple[frozenset, bool, frozenset]:
        """The threads reachable without a byte, the last byte a word character or not: (those that read bytes,
        whether a match is complete here, what the next byte must be for the matches that wait on it)."""
        nfa, need = self.nfa, not word  # across \\b the next character is a word character iff the last was not
        seen, stack, complete, pending = set(), list(kernel), False, set()
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            q, req = t
            if nfa.accept[q]:
                if req is None:
                    complete = True
                else:
                    pending.add(req)
            stack += [(r, req) for r in nfa.eps[q]]
            if req is None or req == need:
                stack += [(r, need) for r in nfa.bound[q]]
        # a thread free of a condition does all that one with a condition does
        threads = frozenset(t for t in seen if nfa.edges[t[0]] and (t[1] is None or (t[0], None) not in seen))
        return threads, complete, frozenset(pending)

    def root(self, word: bool) -> int:
        """The state at the text's start, the character before it a word character or not."""
        return self.roots[word]

    def step(self, d: int, c: int) -> tuple[int, bool, bool]:
        """State d reads byte c: (the next state, whether c completes a match that waited on it, whether a match
        ends with c itself)."""
        move = self.moves[d].get(c)
        if move is None:
            under, pending, last = self.states[d]
            word = bool(WORD >> c & 1)
            edges = self.nfa.edges
            kernel = [(t, None) for q, req in under | self.fresh[last] if req is None or req == word
                      for mask, t in edges[q] if mask >> c & 1]
            threads, complete, waiting = self._close(kernel, word)
            move = self._intern(threads, waiting, word), word in pending, complete
            self.moves[d][c] = move
        return move

    def waits(self, d: int) -> bool:
        """Whether the text's end (no word character) completes a match at state d."""
        return False in self.states[d][1]

    def starts(self, text, end: int, before: bool, after: int | None) -> set[int]:
        """Where the matches ending at byte `end` of `text` begin. `before`: whether the character before text[0]
        is a word character. `after`: the byte after `end` for the matches that waited on it (those whose \\b at
        `end` it satisfies, less those that needed none: they were reported a byte earlier); None for the matches
        complete without it."""
        def boundary(p: int) -> bool:
            left = bool(WORD >> text[p - 1] & 1) if p > 0 else before
            right = bool(WORD >> (text[p] if p < end else after) & 1)
            return left != right

        cur = {(q, False) for q in self.accepts}
        found: dict[bool, set[int]] = {False: set(), True: set()}
        for p in range(end, max(0, end - self.longest) - 1, -1):
            crosses = boundary(p) if p < end or after is not None else False  # complete: no \\b at its end
            stack, seen = list(cur), set()
            while stack:  # the reversed closure at p
                t = stack.pop()
                if t in seen:
                    continue
                seen.add(t)
                r, x = t
                stack += [(q, x) for q in self.rev_eps[r]]
                if crosses:
                    stack += [(q, x or p == end) for q in self.rev_bound[r]]
            for q, x in seen:
                if q == 0 and p < end:
                    found[x].add(p)
            if p == 0:
                break
            b = text[p - 1]
            cur = {(q, x) for r, x in seen for mask, q in self.rev_edges[r] if mask >> b & 1}
            if not cur:
                break
        return found[True] - found[False] if after is not None else found[False]


class Bans:
    """The banned-phrase state of one engine: the automaton's state after every position since `floor` (and the
    patterns' matcher's), the bytes written since then, and the exclusions per position. A pure function of the
    token history from `floor` (and the character before it) and of the going-back it caused, so a resumed run
    recomputes it.

    token_bytes: each vocabulary id's bytes (special tokens: b""). patterns: checked by base/patterns.py."""

    def __init__(self, phrases: tuple[str, ...], token_bytes: list[bytes], patterns: tuple[str, ...] = ()):
        self.phrases = phrases
        self.patterns = patterns
        self.auto = Automaton([v for p in phrases for v in variants(p)])
        self.lower = [t.lower() for t in token_bytes]
        self.raw = token_bytes  # patterns see the case as written
        # a matcher per pattern: each one's DFA has few states, where one DFA for all would have their product
        self.match = [Matcher(compile_patterns((p,)), 4 * longest_match((p,))) for p in patterns] or None
        self.moves: dict = {}  # (the matchers' states, byte) -> _move's answer
        self.backtracks = 0  # times decoding went back (this process)
        self.let_through = 0  # matches kept after MAX_RETRIES exclusions at their start
        self.reset(0)

    def reset(self, floor: int, history=()) -> None:
        """Start matching at position `floor` (the first token after the prompt, or after a resumed history);
        `history` the ids before it, whose last character a word boundary looks at."""
        self.floor = floor
        self.state = [0]  # state[i]: after the tokens floor .. floor + i - 1
        self.nbytes = [0]  # bytes of those tokens
        self.excl: dict[int, set[int]] = {}
        self.final = floor  # tokens before it are final
        if self.match is not None:
            last = next((self.raw[int(t)] for t in reversed(history) if self.raw[int(t)]), b" ")
            self.before = bool(WORD >> last[-1] & 1)  # the character before the text a word character
            self.pstate = [tuple(m.root(self.before) for m in self.match)]  # the patterns' states, as `state`
            self.text = bytearray()  # the bytes since floor, for `Matcher.starts`

    def excluded(self, pos: int) -> list[int]:
        e = self.excl.get(pos)
        return sorted(e) if e else []

    def push(self, pos: int, token: int) -> int | None:
        """Append `token` at position `pos` (the next one). Returns the position to go back to when it completes a
        banned phrase or pattern that may still be refused there, else None."""
        assert pos == self.floor + len(self.state) - 1, (pos, self.floor, len(self.state))
        if self.match is not None:
            return self._push_both(token)
        goto, out = self.auto.goto, self.auto.out
        s = self.state[-1]
        before = self.nbytes[-1]
        for k, b in enumerate(self.lower[token]):
            s = goto[s][b]
            for length in out[s]:
                at = self._refusable(before + k + 1 - length)  # the byte where the match begins
                if at is not None:
                    return at
        self.state.append(s)
        self.nbytes.append(before + len(self.lower[token]))
        return None

    def _push_both(self, token: int) -> int | None:
        """push() with patterns: at each byte, the match that begins first among the phrases' and patterns'."""
        goto, out, match, moves = self.auto.goto, self.auto.out, self.match, self.moves
        s, ds = self.state[-1], self.pstate[-1]
        before = self.nbytes[-1]
        self.text += self.raw[token]
        for k, (b, c) in enumerate(zip(self.lower[token], self.raw[token])):
            s = goto[s][b]
            move = moves.get((ds, c)) or self._move(ds, c)
            ds = move[0]
            found = {before + k + 1 - length for length in out[s]} if out[s] else None
            for i, waited, complete in move[1]:
                found = found or set()
                if waited:
                    found |= match[i].starts(self.text, before + k, self.before, c)
                if complete:
                    found |= match[i].starts(self.text, before + k + 1, self.before, None)
            if found:
                for start in sorted(found):
                    at = self._refusable(start)
                    if at is not None:
                        del self.text[before:]
                        return at
        self.state.append(s)
        self.pstate.append(ds)
        self.nbytes.append(before + len(self.raw[token]))
        return None

    def _move(self, ds: tuple[int, ...], c: int) -> tuple[tuple[int, ...], tuple]:
        """Every pattern's matcher reads byte c: (their next states, (pattern, waited, complete) for each one whose
        move completes a match). Kept per (states, byte), so a byte costs one look-up for all the patterns; the
        table is emptied when it grows past MOVES (the matchers keep their own)."""
        nxt, hits = [], []
        for i, (m, d) in enumerate(zip(self.match, ds)):
            d, waited, complete = m.step(d, c)
            nxt.append(d)
            if waited or complete:
                hits.append((i, waited, complete))
        if len(self.moves) >= MOVES:
            self.moves.clear()
        move = self.moves[ds, c] = tuple(nxt), tuple(hits)
        return move

    def _refusable(self, start: int) -> int | None:
        """The position of the token holding byte `start` (where a match begins), or None when it has been refused
        MAX_RETRIES times there already: the match is let through."""
        at = self.floor + bisect.bisect_right(self.nbytes, start) - 1
        if len(self.excl.get(at, ())) < MAX_RETRIES:
            return at
        self.let_through += 1
        return None

    def finish(self) -> int | None:
        """The text ends after the tokens pushed: the position to go back to when that completes a pattern ending
        in a word boundary (`cat\\b` at the very end), else None."""
        if self.match is None:
            return None
        found = set()
        for m, d in zip(self.match, self.pstate[-1]):
            if m.waits(d):
                found |= m.starts(self.text, len(self.text), self.before, ord(" "))
        for start in sorted(found):
            at = self._refusable(start)
            if at is not None:
                return at
        return None

    def back(self, s: int, token: int) -> None:
        """Go back to position `s` and exclude `token` (the one the phrase began with) there."""
        del self.state[s - self.floor + 1 :]
        del self.nbytes[s - self.floor + 1 :]
        if self.match is not None:
            del self.pstate[s - self.floor + 1 :]
            del self.text[self.nbytes[-1] :]
        for p in [p for p in self.excl if p > s]:
            del self.excl[p]
        self.excl.setdefault(s, set()).add(token)
        self.backtracks += 1

    def settle(self, n: int, everything: bool = False) -> int:
        """The new final length for a history of `n` tokens: the last position at or before n where no phrase or
        pattern is under way (or n itself when `everything`: the run ends there)."""
        if everything:
            self.final = n
            return n
        match = self.match
        for p in range(n, self.final, -1):
            if self.state[p - self.floor] == 0 and (match is None or all(
                    m.idle[d] for m, d in zip(match, self.pstate[p - self.floor]))):
                self.final = p
                break
        return self.final


def token_bytes(tok, vocab: int) -> list[bytes]:
    """Each id's bytes. Byte-level BPE (GPT-2, Llama 3, SmolLM) spells bytes as printable characters; other
    tokenizers' ids are decoded one by one (a character split across two such tokens is then not matched)."""
    n = min(vocab, len(tok))
    special = set(getattr(tok, "all_special_ids", ()) or ())
    pieces = tok.convert_ids_to_tokens(list(range(n)))
    dec = {c: b for b, c in _byte_chars().items()}
    if all(p is None or all(c in dec for c in p) for p in pieces):
        out = [b"" if i in special or p is None else bytes(dec[c] for c in p) for i, p in enumerate(pieces)]
    else:
        texts = tok.batch_decode([[i] for i in range(n)])
        out = [b"" if i in special else t.encode("utf-8") for i, t in enumerate(texts)]
    return out + [b""] * (vocab - n)


def _byte_chars() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: byte -> the printable character byte-level BPE writes for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
