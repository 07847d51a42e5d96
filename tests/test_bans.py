"""Banned phrases (bans.py): the incremental matcher agrees with a scan of the text; the written text never
contains a banned phrase; and with drafts on, every draft source writes exactly what plain decoding writes, greedy
and sampled, across context rebuilds and from any point a run can be resumed at."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import numpy as np
import pytest
import yaml

from swiftwrite.base.patterns import FLAG, check_patterns
from swiftwrite.decoding.bans import MAX_RETRIES, Bans, PhraseError, check_phrases, read_ban_file, variants
from swiftwrite.base.config import Config
from swiftwrite.run import inputs
from swiftwrite.decoding.engine import Engine, make_sources
from swiftwrite.base.errors import UsageError
from swiftwrite.decoding.heads import HeadsDrafter, TwoPassHeadsDrafter
from swiftwrite.models.model import load_lean
from swiftwrite.decoding.sampling import Sampler
from swiftwrite.training.train_heads import fit
from swiftwrite.decoding.window import Window
from tiny_lossless import CONTEXT, DRAFTS, SETTINGS, VOCAB, prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def table(vocab: int = VOCAB) -> list[bytes]:
    """A made-up spelling of the tiny models' ids: a small alphabet in both cases, some with a leading space, a few
    empty (special) ids, so short phrases recur in their text."""
    out = []
    for t in range(vocab):
        if t < 3:
            out.append(b"")
            continue
        s = (" " if t % 4 == 0 else "") + chr(ord("a") + t % 11)
        if t % 3 == 0:
            s += chr(ord("A") + t % 5)
        out.append(s.encode())
    return out


TABLE = table()


def text_of(ids) -> bytes:
    return b"".join(TABLE[t] for t in ids)


def contains(ids, phrase: str) -> bool:
    low = text_of(ids).lower()
    return any(v in low for v in variants(phrase))


# ---------------------------------------------------------------------------------------------------------
# The matcher against a scan


def first_match(ids: list[int], phrases) -> tuple[int, int] | None:
    """(token index where the match that completes first begins, the token completing it), by scanning the text
    after each token; the longest match among those completing at the same byte."""
    pats = [v for p in phrases for v in variants(p)]
    starts, text = [], b""
    for i, t in enumerate(ids):
        starts.append(len(text))
        before = len(text)
        text += TABLE[t].lower()
        for end in range(before + 1, len(text) + 1):
            hits = [len(p) for p in pats if end >= len(p) and text[end - len(p) : end] == p]
            if hits:
                b0 = end - max(hits)
                return max(j for j, s in enumerate(starts) if s <= b0 and (j == i or starts[j + 1] > b0)), i
    return None


@pytest.mark.parametrize("seed", range(40))
def test_the_matcher_finds_what_a_scan_of_the_text_finds(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(VOCAB) for _ in range(300)]
    a = rng.randrange(0, 290)
    phrases = (text_of(ids[a : a + rng.randrange(1, 4)]).decode().strip() or "ab", "q" + chr(97 + seed % 11))
    phrases = check_phrases([p.upper() if seed % 2 else p for p in phrases])
    bans = Bans(phrases, TABLE)
    bans.reset(0)
    got = None
    for i, t in enumerate(ids):
        back = bans.push(i, t)
        if back is not None:
            got = back, i
            break
    assert got == first_match(ids, phrases)


def test_case_and_a_leading_space_do_not_hide_a_phrase():
    token = {b"": 0}
    words = [b" Shivers", b" down", b"SHIVERS", b" DOWN", b"shivers", b"down", b" her"]
    spell = [b""] * 3 + words
    for i, w in enumerate(words):
        token[w] = i + 3
    for text in ([b" Shivers", b" down"], [b"SHIVERS", b" DOWN"], [b"shivers", b" down"]):
        bans = Bans(check_phrases([" shivers down "]), spell)
        bans.reset(10)
        ids = [token[w] for w in text]
        assert bans.push(10, ids[0]) is None
        assert bans.push(11, ids[1]) == 10  # back to where the phrase began
    bans = Bans(check_phrases(["Shivers down"]), spell)
    bans.reset(0)
    assert [bans.push(i, token[w]) for i, w in enumerate([b" her", b"shivers", b"down"])] == [None, None, None]


def test_after_max_retries_a_match_is_let_through():
    spell = [b""] + [b"a"] * (MAX_RETRIES + 1) + [b"b"]  # ids 1 .. MAX_RETRIES + 1 all spell "a"
    b = len(spell) - 1
    bans = Bans(("ab",), spell)
    bans.reset(0)
    for k in range(MAX_RETRIES):
        assert bans.push(0, 1 + k) is None and bans.push(1, b) == 0
        bans.back(0, 1 + k)
        assert bans.excluded(0) == list(range(1, k + 2))
    assert bans.push(0, MAX_RETRIES + 1) is None and bans.push(1, b) is None and bans.let_through == 1


def test_phrases_that_can_never_be_written_are_refused_in_one_sentence(tmp_path):
    with pytest.raises(PhraseError, match="empty phrase"):
        check_phrases(["ok", "   "])
    with pytest.raises(PhraseError, match="does not exist"):
        read_ban_file(str(tmp_path / "none.txt"))
    (tmp_path / "bin").write_bytes(b"\x00\x01\xff")
    with pytest.raises(PhraseError, match="not UTF-8 text"):
        read_ban_file(str(tmp_path / "bin"))
    (tmp_path / "ok.txt").write_text("a phrase\n\n  another  \n")
    assert check_phrases(read_ban_file(str(tmp_path / "ok.txt"))) == ("a phrase", "another")


# ---------------------------------------------------------------------------------------------------------
# The engine: never written, and drafting = plain


N = 600  # ~4 context rebuilds on the tiny model's 256-token window


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_lean(tiny_model(tmp_path_factory.mktemp("tiny")), "cpu")


@pytest.fixture(scope="module")
def heads(model):
    texts = [prompt() + run(model, s, (), n=400)[0] for s in SETTINGS.values()]
    windows = [np.array(t[i : i + 200]) for t in texts for i in range(0, len(t) - 200, 100)]
    h, _ = fit(model, windows, windows[:1], steps=60, batch=256, lr=3e-2, distill=0.0, log=lambda m: None)
    return h


def run(model, settings, phrases, names=(), heads=None, n=N, history=None, patterns=(), budget=16):
    sources, stats = make_sources(list(names), VOCAB, heads=heads)
    p = prompt()
    hist = history or p
    engine = Engine(model, Sampler(settings, VOCAB), Window(CONTEXT, len(p)), sources, stats,
                    budget=budget if names else None, capacity=len(p) + N + 1,
                    bans=Bans(phrases, TABLE, patterns) if phrases or patterns else None)
    engine.start(hist)
    steps = list(engine.run(n))
    return [t for s in steps for t in s.tokens], steps


@pytest.fixture(scope="module")
def banned(model):
    """Per setting: the phrases (slices of its own unbanned text, so the model does write them), the plain banned
    run, and the lengths at which its steps left the text final (where a checkpoint can fall)."""
    out = {}
    for sid, s in SETTINGS.items():
        free = run(model, s, ())[0]
        # the three 2-token stretches its text repeats most often, so the ban bites again and again
        grams = Counter(text_of(free[a : a + 2]).decode().strip().lower() for a in range(len(free) - 2))
        phrases = check_phrases([g for g, _ in grams.most_common(3)])
        got, steps = run(model, s, phrases)
        ends, k = [], 0
        for st in steps:
            k += len(st.tokens)
            ends.append(k)
        out[sid] = free, phrases, got, steps, ends
    return out


@pytest.mark.parametrize("sid", list(SETTINGS))
def test_a_banned_phrase_is_never_written_and_going_back_happened(banned, sid):
    free, phrases, got, steps, _ = banned[sid]
    assert len(got) == N
    assert all(contains(free, p) for p in phrases)
    assert not any(contains(got, p) for p in phrases)
    assert sum(s.backtracks for s in steps) >= 3
    assert got != free


@pytest.mark.parametrize("draft_id", [*DRAFTS, "heads-two-pass"])
@pytest.mark.parametrize("sid", list(SETTINGS))
def test_speculative_equals_plain_with_banned_phrases_across_rebuilds(model, heads, banned, sid, draft_id):
    _, phrases, ref, ref_steps, _ = banned[sid]
    two_pass = draft_id == "heads-two-pass"  # its partial draft cache is dropped when decoding goes back
    factory = TwoPassHeadsDrafter.factory(heads, model, kv_budget=64) if two_pass else HeadsDrafter.factory(heads, model)
    got, steps = run(model, SETTINGS[sid], phrases, ["heads"] if two_pass else DRAFTS[draft_id], factory)
    assert got == ref
    assert sum(s.drafted for s in steps) > 0 and sum(s.rebuilt for s in steps) >= 3
    assert sum(s.backtracks for s in steps) == sum(s.backtracks for s in ref_steps)


@pytest.mark.parametrize("sid", list(SETTINGS))
def test_a_run_resumed_where_a_checkpoint_can_fall_writes_the_same_text(model, banned, sid):
    _, phrases, ref, _, ends = banned[sid]
    p = prompt()
    for k in sorted({ends[len(ends) // 4], ends[len(ends) // 2], ends[-3]}):
        got, _ = run(model, SETTINGS[sid], phrases, ["recycling", "ngram"], history=p + ref[:k], n=N - k)
        assert got == ref[k:], k


# ---------------------------------------------------------------------------------------------------------
# Patterns (base/patterns.py): never matched, and drafting = plain


def pattern_found(ids, patterns) -> str | None:
    """The first pattern `re` finds in the text of `ids`, a word boundary at its start looking at the prompt's
    last character (as the matcher does), or None."""
    before = TABLE[prompt()[-1]].decode()
    full = before + text_of(ids).decode()
    for p in patterns:
        icase = p.startswith(FLAG)
        rx = re.compile(p[len(FLAG) :] if icase else p, re.ASCII | (re.IGNORECASE if icase else 0))
        if rx.search(full, len(before)):
            return p
    return None


@pytest.fixture(scope="module")
def pattern_banned(model, banned):
    """Per setting: patterns made from the stretches its unbanned text repeats most (an alternation in any case,
    one ending in a word boundary, one with classes), and the plain run that bans them."""
    out = {}
    for sid, s in SETTINGS.items():
        free = banned[sid][0]
        grams = Counter(text_of(free[a : a + 2]).decode() for a in range(len(free) - 2))
        top = [g for g, _ in grams.most_common(12) if g.strip()]
        classes = "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in top[3])
        patterns = check_patterns([f"(?i)({re.escape(top[0])}|{re.escape(top[1])})", f"{re.escape(top[2].strip())}\\b",
                                   f"{classes}\\s?"])
        got, steps = run(model, s, (), patterns=patterns)
        out[sid] = free, patterns, got, steps
    return out


@pytest.mark.parametrize("sid", list(SETTINGS))
def test_a_banned_pattern_is_never_matched_and_going_back_happened(pattern_banned, sid):
    free, patterns, got, steps = pattern_banned[sid]
    assert len(got) == N
    assert all(pattern_found(free, [p]) for p in patterns)
    assert pattern_found(got, patterns) is None
    assert sum(s.backtracks for s in steps) >= 3 and sum(s.let_through for s in steps) == 0


@pytest.mark.parametrize("draft_id", ["all", "ngram"])
@pytest.mark.parametrize("sid", list(SETTINGS))
def test_speculative_equals_plain_with_banned_patterns_across_rebuilds(model, heads, pattern_banned, sid, draft_id):
    _, patterns, ref, ref_steps = pattern_banned[sid]
    got, steps = run(model, SETTINGS[sid], ("q" + "a" * 5,), DRAFTS[draft_id], HeadsDrafter.factory(heads, model),
                     patterns=patterns, budget=8)  # a phrase beside: the two go back together
    assert got == ref
    assert sum(s.drafted for s in steps) > 0 and sum(s.rebuilt for s in steps) >= 3
    assert sum(s.backtracks for s in steps) == sum(s.backtracks for s in ref_steps)


@pytest.mark.parametrize("sid", list(SETTINGS))
def test_a_run_with_patterns_resumed_where_a_checkpoint_can_fall_writes_the_same_text(model, pattern_banned, sid):
    _, patterns, ref, steps = pattern_banned[sid]
    ends = [sum(len(s.tokens) for s in steps[: k + 1]) for k in range(len(steps))]
    p = prompt()
    for k in sorted({ends[len(ends) // 3], ends[2 * len(ends) // 3], ends[-2]}):
        got, _ = run(model, SETTINGS[sid], (), ["recycling", "ngram"], history=p + ref[:k], n=N - k, patterns=patterns)
        assert got == ref[k:], k


# ---------------------------------------------------------------------------------------------------------
# The writer: bad input, the run directory, resume, the statistics


def test_a_ban_file_that_is_missing_or_binary_stops_the_run_before_its_directory_exists(tmp_path):
    brief = tmp_path / "brief.txt"
    brief.write_text("A lighthouse keeper finds a bottle.")
    (tmp_path / "bin").write_bytes(b"\x00\xff\x00")
    for name in ("missing.txt", "bin"):
        cfg = Config(tokens=20, ban_file=str(tmp_path / name)).validate()
        with pytest.raises(PhraseError):
            inputs.read(cfg, str(brief), tmp_path / "run", None, None)
        assert not (tmp_path / "run").exists()


def test_an_empty_phrase_is_refused_by_the_configuration_and_an_outline_takes_bans():
    with pytest.raises(UsageError, match="empty phrase"):
        Config(ban=("ok", " ")).validate()
    assert Config(ban=("ok",), ban_pattern=("o{2}",), plan=True).validate().plan
    assert Config(ban=("ok",), outline="plan.md").validate().outline == "plan.md"


def test_the_default_model_never_writes_a_banned_phrase_drafting_equals_plain_and_resume_keeps_the_ban(
        default_model_dir, tmp_path):
    """The default model, greedy, 200 tokens: ban a phrase and a pattern its unbanned text holds; the banned runs
    with --draft none and --draft all write the same tokens, none holds either, the run directory keeps them, a
    resume of the run cut back to a checkpoint writes the same tokens, and the statistics count the backtracks."""
    from swiftwrite.run import writer

    brief = tmp_path / "brief.txt"
    brief.write_text("Write a short story about a lighthouse keeper who finds a message in a bottle.")

    def gen(name, **kw):
        cfg = Config(tokens=200, temperature=0.0, context=512, chunk=64, **kw).validate()
        given = inputs.read(cfg, str(brief), tmp_path / name, tmp_path / f"{name}.md", tmp_path / f"{name}.json")
        assert writer.generate(given, True, True) == 0
        return (tmp_path / f"{name}.md").read_text(), json.loads((tmp_path / f"{name}.json").read_text())

    free, _ = gen("free", draft="none")
    words = free.split()
    phrase = " ".join(words[len(words) // 3 : len(words) // 3 + 2])
    (tmp_path / "bans.txt").write_text(phrase.upper() + "\n")
    plain, stats = gen("plain", draft="none", ban_file=str(tmp_path / "bans.txt"))
    drafted, _ = gen("drafted", draft="all", ban_file=str(tmp_path / "bans.txt"))
    assert phrase.lower() in free.lower() and phrase.lower() not in plain.lower()
    assert drafted == plain
    assert stats["banned_phrases"]["backtracks"] >= 1
    assert yaml.safe_load((tmp_path / "plain" / "config.yaml").read_text())["ban"] == [phrase.upper()]
    # a pattern (a ban file's `re:` line): two words of the text two thirds in, any case, anything between
    clean = [re.sub(r"\W", "", w, flags=re.A) for w in words]
    k = next(k for k in range(2 * len(words) // 3, len(words) - 1) if clean[k] and clean[k + 1])
    pattern = f"(?i)\\b{clean[k]}\\W{{1,6}}{clean[k + 1]}\\b"
    (tmp_path / "patterns.txt").write_text("re:" + pattern + "\n")
    found = re.compile(pattern[len(FLAG) :], re.I | re.A).search
    by_pattern, pstats = gen("pattern", draft="none", ban_file=str(tmp_path / "patterns.txt"))
    assert found(free) and not found(by_pattern) and pstats["banned_phrases"]["backtracks"] >= 1
    assert gen("pattern-drafted", draft="all", ban_file=str(tmp_path / "patterns.txt"))[0] == by_pattern
    assert yaml.safe_load((tmp_path / "pattern" / "config.yaml").read_text())["ban_pattern"] == [pattern]
    # `resume --tokens` keeps enforcing it (from the run directory's settings), with drafts as without
    for name in ("plain", "drafted"):
        assert writer.resume(tmp_path / name, 300, tmp_path / f"{name}2.md", False, True, True, None) == 0
    longer = (tmp_path / "plain2.md").read_text()
    assert longer.startswith(plain) and phrase.lower() not in longer.lower()
    assert (tmp_path / "drafted2.md").read_text() == longer
