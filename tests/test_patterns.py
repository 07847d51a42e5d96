"""Banned patterns (base/patterns.py, bans.Matcher): what is outside the subset is refused in one sentence (exit 2 from
the command line), and the incremental matcher reports exactly the matches Python's `re` finds, byte by byte, at the
byte that decides each one, on random patterns of the subset over random text."""

from __future__ import annotations

import random
import re
import sys

import pytest

from swiftwrite import cli
from swiftwrite.base.config import Config
from swiftwrite.base.errors import UsageError
from swiftwrite.base.patterns import FLAG, MAX_LENGTH, PatternError, check_patterns, compile_patterns, longest_match
from swiftwrite.decoding.bans import Bans, Matcher, split_lines

# ---------------------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("pattern, says", [
    ("a+", "any length"), ("the \\w*", "any length"), ("x{2,}", "any length"), ("x{,}", "any length"),
    ("a?", "empty text"), ("\\b", "empty text"), ("(a|)", "empty text"), ("a{0,3}", "empty text"),
    ("a(", "not a valid regular expression"), ("[a-", "not a valid regular expression"),
    ("a{3,1}", "not a valid regular expression"), ("**", "not a valid regular expression"),
    ("^the", "anchor"), ("end$", "anchor"), ("\\Bx", "'\\B'"), ("(a)\\1", "back reference"),
    ("(?=a)b", "lookahead"), ("(?<!a)b", "lookbehind"), ("(?s)a.b", "inline flag"), ("a(?i:b)", "inline flag"),
    ("[^é]", "outside ASCII"), ("a{1,3}+", "possessive"), ("a{300}", "at most 255"),
    ("\\w{1,200}\\w{1,200}", f"at most {MAX_LENGTH}"),
])
def test_a_pattern_outside_the_subset_is_refused_in_one_sentence(pattern, says):
    with pytest.raises(PatternError) as e:
        check_patterns([pattern])
    msg = str(e.value)
    assert says in msg and msg.startswith(f"--ban-pattern '{pattern}' ") and msg.endswith(".")
    assert msg.count(". ") == 0 and "\n" not in msg  # one sentence
    assert isinstance(e.value, UsageError)


def test_the_subset_compiles():
    ok = ["a sense of", "(?i)the (old|young) \\w{1,12}", "\\bcat\\b", "[A-Z][a-z]{2,5}ly", "[^ ,.]{3}",
          "colou?r", "\\d{1,3}(,\\d{3}){0,2}", "(?P<w>wh(y|at))\\?", "a{}", "é—[é—]", "\\x41\\u00e9\\.", ".{2,4}",
          "[\\w-]{1,3}", "x{,3}y", "ab??c{1,2}?"]
    assert check_patterns(ok + ok[:2]) == tuple(ok)


def test_a_bad_pattern_exits_2_from_the_command_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    brief = tmp_path / "brief.txt"
    brief.write_text("A lighthouse keeper finds a bottle.")
    (tmp_path / "bans.txt").write_text("a sense of\nre:the \\w*\n")
    for args, says, code in ((["--ban-pattern", "a+"], "'a+' can match text of any length", 2),
                             (["--ban-pattern", "("], "'(' is not a valid regular expression", 2),
                             (["--ban-file", str(tmp_path / "bans.txt")], "pattern 'the \\w*' can match text of any", 1)):
        monkeypatch.setattr(sys, "argv", ["swiftwrite", "generate", str(brief), *args, "--run-dir", str(tmp_path / "run")])
        with pytest.raises(SystemExit) as e:
            cli._main()
        err = capsys.readouterr().err
        assert e.value.code == code and says in err and err.count("\n") == 1, err
        assert not (tmp_path / "run").exists()


def test_bans_by_pattern_are_settings_of_the_run_and_a_ban_file_holds_them_after_re():
    assert Config(ban_pattern=("the (old|young) \\w{1,9}",)).validate().ban_pattern == ("the (old|young) \\w{1,9}",)
    with pytest.raises(UsageError, match="any length"):
        Config(ban_pattern=("a sense of.*",)).validate()
    assert split_lines(["a sense of", "re:\\bgrin\\w{0,3}", "really"]) == (["a sense of", "really"], ["\\bgrin\\w{0,3}"])


# ---------------------------------------------------------------------------------------------------------
# The matcher against `re`

ALPHABET = "aAbBc1_ ,.\né—"


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    def atom() -> str:
        r = rng.random()
        if r < 0.4:
            c = rng.choice("abAB ,.1é—")
            return re.escape(c) if c in ".," else c
        if r < 0.55:
            return rng.choice([".", "\\w", "\\d", "\\s", "\\W", "\\S", "\\D"])
        if r < 0.7:
            return rng.choice(["[a-c]", "[^ab]", "[ \\w]", "[^\\w]", "[A-Bé]", "[^ ,.]", "[_1]", "[\\W1]"])
        if r < 0.8:
            return "\\b"
        if depth < 2:
            return "(" + random_pattern(rng, depth + 1) + ")"
        return "a"

    def piece() -> str:
        a = atom()
        if a == "\\b":
            return a
        q = rng.choice(["", "", "", "?", "{2}", "{1,3}", "{0,2}", "??", "{,2}"])
        return a + q

    branches = ["".join(piece() for _ in range(rng.randint(1, 4))) for _ in range(rng.choice([1, 1, 2, 3]))]
    return "|".join(branches)


def matches_at(rx: re.Pattern, full: str, i: int, j: int, after: str) -> bool:
    """Whether the pattern matches full[i:j] exactly when `after` follows it (and then the text ends)."""
    tail = re.compile(f"(?:{rx.pattern})(?={re.escape(after)}\\Z)", rx.flags)
    return tail.match(full[:j] + after, i) is not None


def expected_reports(pattern: str, before: str, text: str) -> tuple[dict[int, set[int]], set[int]]:
    """Per byte of `text` (read after `before`), the byte offsets where the matches the byte decides begin, and the
    ones the text's end decides. A match decided by its last character is reported at that character's last
    byte; one that holds only for some next characters (a final \\b) at the next character's first byte, or at
    the end."""
    icase = pattern.startswith(FLAG)
    rx = re.compile(pattern[len(FLAG) :] if icase else pattern, re.ASCII | (re.IGNORECASE if icase else 0))
    full, p = before + text, len(before)
    offs = [len(text[:k].encode()) for k in range(len(text) + 1)]  # byte offset of each character
    at: dict[int, set[int]] = {}
    end: set[int] = set()
    for j in range(1, len(text) + 1):
        for i in range(j):
            if not matches_at(rx, full, p + i, p + j, full[p + j :]):
                continue
            if all(matches_at(rx, full, p + i, p + j, probe) for probe in ("a", " ")):
                at.setdefault(offs[j] - 1, set()).add(offs[i])
            elif j < len(text):
                at.setdefault(offs[j], set()).add(offs[i])
            else:
                end.add(offs[i])
    return at, end


def reported(pattern: str, before: str, text: str) -> tuple[dict[int, set[int]], set[int]]:
    """What the matcher reports, read byte by byte as Bans reads it: per byte, where the matches it completes
    begin; and where the ones the text's end completes begin."""
    m = Matcher(compile_patterns((pattern,)), 4 * longest_match((pattern,)))
    data, word = text.encode(), bool(re.match(r"\w", before[-1:], re.A))
    d = m.root(word)
    at: dict[int, set[int]] = {}
    for k, c in enumerate(data):
        d, waited, complete = m.step(d, c)
        found = (m.starts(data, k, word, c) if waited else set()) | (m.starts(data, k + 1, word, None) if complete else set())
        if found:
            at[k] = found
    return at, m.starts(data, len(data), word, ord(" ")) if m.waits(d) else set()


@pytest.mark.parametrize("seed", range(60))
def test_the_matcher_reports_what_re_finds_at_the_byte_that_decides_it(seed):
    rng = random.Random(seed)
    tried = 0
    while tried < 8:
        pattern = (FLAG if rng.random() < 0.3 else "") + random_pattern(rng)
        try:
            check_patterns([pattern])
        except PatternError as e:
            assert "empty text" in str(e), str(e)  # the generator writes only the subset
            continue
        tried += 1
        for _ in range(6):
            before = rng.choice(["", "a", " ", "é"])
            text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 24)))
            assert reported(pattern, before, text) == expected_reports(pattern, before, text), (pattern, before, text)


def test_word_boundaries_wait_for_the_next_character():
    at, end = reported("\\bcat\\b", " ", "cats cat, cat")
    # "cats": nothing; "cat," reported at the ',' (byte 8), the match beginning at byte 5; the final "cat" at the end
    assert at == {8: {5}} and end == {10}


def test_bans_go_back_to_where_the_pattern_began_across_tokens():
    spell = [b"", b" the", b" old", b" young", b" man", b" manner", b",", b" The"]
    bans = Bans((), spell, check_patterns(["(?i)the (old|young) man\\b"]))
    bans.reset(5, [7])
    assert [bans.push(5 + k, t) for k, t in enumerate([1, 2, 5])] == [None, None, None]  # "manner" is no match
    bans.reset(5, [7])
    assert [bans.push(5 + k, t) for k, t in enumerate([7, 3, 4])] == [None, None, None]  # waits on what follows
    assert bans.settle(8) == 5  # a match may still begin at 5: nothing after it is final
    assert bans.push(8, 6) == 5  # "," completes it: back to " The"
    bans.back(5, 7)
    assert bans.excluded(5) == [7] and bans.settle(5) == 5
    bans.reset(0, [])
    assert [bans.push(k, t) for k, t in enumerate([1, 3, 4])] == [None, None, None] and bans.finish() == 0
