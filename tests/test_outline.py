"""Outlines: the parser reads what people and models write, budgets add up to --tokens, and the section schedule
keeps plain, speculative and resumed runs identical.

The engine tests use the tiny sharpened models of test_engine.py (drafts are accepted there, so speculative
steps commit several tokens and really can run past a boundary), a fixed plan of headings made of token ids,
and a set of "sentence-end" ids; the context is small, so it is rebuilt many times and the pinned section
heading changes between rebuilds.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from swiftwrite.base.patterns import FLAG, check_patterns
from swiftwrite.decoding.bans import Bans
from swiftwrite.run import outline as ol
from swiftwrite.run import schedule
from swiftwrite.run.edits import continued_plan
from swiftwrite.decoding.engine import Engine, make_sources
from swiftwrite.base.errors import UsageError
from swiftwrite.models.model import load_lean
from swiftwrite.decoding.sampling import Sampler, SamplerSettings
from swiftwrite.decoding.window import Window
from test_bans import TABLE, text_of
from tiny import sharpened_tiny_model

# ---------------------------------------------------------------------------------------------------------
# Parsing


def titles(sections):
    return [s.title for s in sections]


def test_headings_notes_and_budgets():
    text = """# The lighthouse

Some preamble the writer left here.

## The harbour {tokens: 6000}
The keeper rows out at dawn.
The bottle is found.

## The letter
### a detail that belongs to the letter

## The reply {tokens:1,500}
"""
    s = ol.parse(text)
    assert titles(s) == ["The harbour", "The letter", "The reply"]
    assert [x.budget for x in s] == [6000, None, 1500]
    assert s[0].notes == "The keeper rows out at dawn. The bottle is found."
    assert s[1].notes == "a detail that belongs to the letter"
    assert all(x.level == 2 for x in s)


def test_a_single_level_of_top_headings_are_sections():
    s = ol.parse("# One\n# Two\n\n# Three\n")
    assert titles(s) == ["One", "Two", "Three"] and all(x.level == 1 for x in s)


@pytest.mark.parametrize("text", [
    "1. The storm\n2. The bottle\n3. The reply\n",
    "Here is the outline you asked for:\n\n1. The storm\n2) The bottle\n\n3 - The reply\nI hope this helps!\n",
    "Chapter 1: The storm\nChapter 2: The bottle\nChapter 3: The reply",
    "**1.** The storm\n**2.** The bottle\n**3.** The reply",
    "1. **The storm**\n   the lamp goes out\n2. \"The bottle\"\n3. The reply:\n",
])
def test_numbered_lists_a_model_might_write(text):
    s = ol.parse(text)
    assert titles(s) == ["The storm", "The bottle", "The reply"], s


def test_numbered_items_split_title_and_description_and_keep_indented_notes():
    s = ol.parse("1. The storm: the keeper loses the lamp\n2. The bottle\n   - a letter inside\n")
    assert titles(s) == ["The storm", "The bottle"]
    assert s[0].notes == "the keeper loses the lamp" and s[1].notes == "a letter inside"


@pytest.mark.parametrize("text", ["", "just some prose\nwith no headings at all\n", "#\n##   \n", "- a\n- b\n"])
def test_an_outline_without_headings_is_refused(text):
    with pytest.raises(UsageError, match="no section headings"):
        ol.parse(text, "--outline x.md")
    assert ol.parse(text, strict=False) == []


@pytest.mark.parametrize("budget", ["0", "-5", "abc", "3"])
def test_a_budget_under_the_minimum_is_refused(budget):
    with pytest.raises(UsageError, match="must be a whole number of at least"):
        ol.parse(f"## A {{tokens: {budget}}}\n## B\n", "--outline x.md")
    assert ol.parse(f"## A {{tokens: {budget}}}\n", strict=False)[0].budget is None


def test_render_reads_back():
    s = ol.parse("## The harbour {tokens: 600}\nnotes here\n## The letter\n")
    b = ol.allocate(s, 1000)
    again = ol.parse(ol.render(s, b))
    assert titles(again) == titles(s) and [x.notes for x in again] == [x.notes for x in s]
    assert [x.budget for x in again] == b == [600, 400]
    assert ol.parse(ol.render(s)) == [ol.Section(x.title, x.notes, None, x.level) for x in s]


def test_budgets_share_what_is_left_and_sum_to_tokens():
    s = ol.parse("## A {tokens: 100}\n## B\n## C\n## D\n")
    assert ol.allocate(s, 401) == [100, 101, 100, 100]
    s = ol.parse("## A {tokens: 100}\n## B {tokens: 200}\n")
    assert ol.allocate(s, 1000) == [100, 900]  # every section has one: the last takes the rest
    with pytest.raises(UsageError, match="add up to 300 tokens, more than --tokens 250"):
        ol.allocate(s, 250)
    with pytest.raises(UsageError, match="fewer than 16 each"):
        ol.allocate(ol.parse("## A {tokens: 100}\n## B\n## C\n"), 120)


def test_a_plan_with_missing_titles_is_filled_with_parts():
    s, missing = ol.planned("Sure! Here are the chapters:\n1. The storm\n2. The storm\n3. The bottle\n", 4)
    assert titles(s) == ["The storm", "The bottle", "Part 3", "Part 4"] and missing == 2
    s, missing = ol.planned("the model wrote prose instead", 3)
    assert titles(s) == ["Part 1", "Part 2", "Part 3"] and missing == 3
    assert titles(ol.parse(ol.render(s))) == titles(s)  # what --plan saves, --outline reads back


def test_plan_count():
    assert ol.plan_count(2000, 0) == 3 and ol.plan_count(100_000, 0) == 50 and ol.plan_count(9000, 0) == 5
    assert ol.plan_count(40, 0) == 2 and ol.plan_count(5000, 7) == 7


def test_sentence_ends():
    assert all(map(schedule.is_ender, [".", " end.", "!\"", "?”", ".\n", "\n\n", " done.)", "…"]))
    assert not any(map(schedule.is_ender, [" the", ",", " Mr", "3", "\"", ""]))


# ---------------------------------------------------------------------------------------------------------
# The schedule as a pure function of the tokens


def fixed_plan(budgets, heading_len=4, pin_lens=(3, 7, 5, 9, 4)):
    """A plan whose headings are runs of ids 120.. (rare in the tiny models' text) and pins of varied length."""
    n = len(budgets)
    heads = [[120 + (k % 8)] + [3 + k] * (heading_len - 1) for k in range(n)]
    pins = [[100 + k] * pin_lens[k % len(pin_lens)] for k in range(n)]
    return schedule.Plan([ol.Section(f"S{k}") for k in range(n)], list(budgets), heads, pins)


def simulate(plan, enders, stream, total):
    """Plain decoding's view: one token at a time from `stream` (an iterator), headings forced."""
    sched = schedule.Schedule(plan, frozenset(enders))
    out = []
    while len(out) < total:
        ids = sched.due(out, len(out))
        if ids is not None:
            sched.mark(len(out))
            out += ids[: total - len(out)]
        else:
            out.append(next(stream))
    return out, sched


def test_sections_end_at_a_sentence_end_within_the_grace_and_replay_finds_them():
    gen = torch.Generator().manual_seed(0)
    enders = set(range(10, 18))
    budgets = [300, 200, 500, 250]
    plan = fixed_plan(budgets)
    out, sched = simulate(plan, enders, iter(torch.randint(5, 60, (5000,), generator=gen).tolist()), sum(budgets))
    check_sections(out, sched, plan, enders)
    again = schedule.Schedule(plan, frozenset(enders))
    for cut in range(0, len(out) + 1, 7):  # a resume anywhere
        again.replay(out[:cut])
        assert again.starts == [s for s in sched.starts if s < cut]


def check_sections(out, sched, plan, enders, total=None):
    """Every heading once, in order, where the rule puts it; every section within ±10% of its budget."""
    total = total or len(out)
    n = len(plan.sections)
    assert len(sched.starts) == n and sched.starts[0] == 0
    for k, s in enumerate(sched.starts):
        assert out[s : s + len(plan.headings[k])] == plan.headings[k]
        h = plan.headings[k]
        assert sum(out[i : i + len(h)] == h for i in range(len(out))) == 1, f"heading {k} occurs more than once"
        if k:
            lo, hi = sched.bounds(k - 1)
            assert lo <= s <= hi
            assert s == hi or out[s - 1] in enders  # a sentence end, or the grace ran out
            assert not any(out[i - 1] in enders for i in range(lo, s))  # and the first one
    ends = sched.starts[1:] + [total]
    for k in range(n):
        length = ends[k] - sched.starts[k]
        assert abs(length - plan.budgets[k]) <= 0.1 * plan.budgets[k], (k, length, plan.budgets[k])


# ---------------------------------------------------------------------------------------------------------
# The engine: speculative = plain, resume = uninterrupted

VOCAB = 128
ENDERS = frozenset(range(20, 36))  # 1 in 8 of the vocabulary: sentences of ~8 tokens
BUDGETS = [180, 120, 260, 140, 200]
CONTEXT = 112  # the window: rebuilt about every 40 tokens, ~20 times over the 900
SETTINGS = {
    "greedy": SamplerSettings(penalty=1.3, window=32),
    "sample": SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=32, seed=3),
}
DRAFTS = {"none": [], "recycling": ["recycling"], "ngram": ["ngram"], "all": ["recycling", "ngram"]}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = sharpened_tiny_model("qwen3", 4.0, seed=1, out_dir=tmp_path_factory.mktemp("qwen3-s1"),
                                   vocab_size=VOCAB, max_position_embeddings=2048)
    return load_lean(path)


PROMPT = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(7)).tolist()


def write(model, setting, drafts, n, history=(), budget=16, patterns=()):
    """Write `n` tokens after `history` (earlier output: a resume) under the fixed plan; (out, sched, steps).
    `patterns`: banned, the ids spelt as test_bans.TABLE spells them."""
    plan = fixed_plan(BUDGETS)
    sources, stats = make_sources(list(drafts), VOCAB)
    engine = Engine(model, Sampler(SETTINGS[setting], VOCAB), Window(CONTEXT, len(PROMPT) + plan.pin_max), sources,
                    stats, budget=budget if drafts else None, capacity=len(PROMPT) + sum(BUDGETS) + 1,
                    bans=Bans((), TABLE, patterns) if patterns else None)
    sched = schedule.Schedule(plan, ENDERS)
    engine.pin_context(len(PROMPT), sched.pin_at)
    out = list(history)
    sched.replay(out)
    engine.start(PROMPT + out)
    steps = list(schedule.drive(engine, sched, n, out))
    return out, sched, steps


@pytest.fixture(scope="module")
def plain(model):
    return {s: write(model, s, [], sum(BUDGETS)) for s in SETTINGS}


@pytest.mark.parametrize("setting", SETTINGS)
def test_plain_runs_follow_the_outline(plain, setting):
    out, sched, steps = plain[setting]
    assert len(out) == sum(BUDGETS)
    check_sections(out, sched, fixed_plan(BUDGETS), ENDERS)
    assert any(sched.starts[k] < sched.bounds(k - 1)[1] for k in range(1, len(BUDGETS))), "no section ended at a sentence end"
    assert sum(s.rebuilt for s in steps) >= 3


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafts", ["recycling", "ngram", "all"])
def test_speculative_equals_plain_with_an_outline(model, plain, setting, drafts):
    out, sched, steps = write(model, setting, DRAFTS[drafts], sum(BUDGETS))
    ref, ref_sched, _ = plain[setting]
    first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
    assert out == ref, f"first difference at token {first}"
    assert sched.starts == ref_sched.starts
    sampled = [s for s in steps if not s.forced]
    assert max(len(s.tokens) for s in sampled) >= 3 and sum(len(s.tokens) for s in sampled) > 1.1 * len(sampled)
    assert sum(s.rebuilt for s in steps) >= 3


def test_a_step_is_cut_at_a_sentence_end_inside_the_grace(model, plain):
    """At least one speculative step had drafts accepted past a section's sentence end and was cut there."""
    out, sched, steps = write(model, "greedy", DRAFTS["all"], sum(BUDGETS))
    pos, cut = 0, 0
    for s in steps:
        end = pos + len(s.tokens)
        if not s.forced and end in sched.starts[1:] and out[end - 1] in ENDERS and s.drafted > len(s.tokens):
            cut += 1
        pos = end
    assert pos == len(out) and cut >= 1


@pytest.mark.parametrize("setting", SETTINGS)
def test_resume_mid_section_and_at_boundaries_gives_the_uninterrupted_text(model, plain, setting):
    ref, ref_sched, _ = plain[setting]
    s, plan = ref_sched.starts, fixed_plan(BUDGETS)
    points = [s[1] + 37, s[2] + len(plan.headings[2]), s[3] - 1, s[4] + 100]
    # and the first point where the context was last rebuilt in the previous section: the pin is that
    # section's, though the text has moved on (a pin chosen by the current section would differ here). Never
    # inside a heading: it is committed, appended and checkpointed as one step
    w = Window(CONTEXT, len(PROMPT) + plan.pin_max)
    inside_heading = lambda c: c - s[ref_sched.section_at(c)] < len(plan.headings[ref_sched.section_at(c)])  # noqa: E731
    lagging = [c for c in range(s[1], len(ref)) if not inside_heading(c) and w.span(len(PROMPT) + c)[0] != w.prompt and
               ref_sched.section_at(w.span(len(PROMPT) + c)[0] + w.recent - len(PROMPT)) != ref_sched.section_at(c)]
    assert lagging
    points.append(lagging[0])
    for cut in points:
        out, sched, _ = write(model, setting, DRAFTS["all"], len(ref) - cut, history=ref[:cut])
        assert out == ref, f"resumed at {cut}: first difference at " \
            f"{next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)}"
        assert sched.starts == ref_sched.starts


# ---------------------------------------------------------------------------------------------------------
# Bans with an outline: never matched inside a section, drafting = plain, resume


def bodies(out, sched, plan):
    """Each section's text after its heading, with the heading's last character (a \\b there looks at it)."""
    ends = sched.starts[1:] + [len(out)]
    return [(text_of(plan.headings[k][-1:]).decode(), text_of(out[s + len(plan.headings[k]) : e]).decode())
            for k, (s, e) in enumerate(zip(sched.starts, ends))]


def found(out, sched, patterns):
    """The first pattern `re` finds inside a section's text (headings are the writer's, as the prompt is), or None."""
    for before, body in bodies(out, sched, fixed_plan(BUDGETS)):
        for p in patterns:
            icase = p.startswith(FLAG)
            if re.compile(p[len(FLAG) :] if icase else p, re.A | (re.I if icase else 0)).search(before + body, len(before)):
                return p
    return None


@pytest.fixture(scope="module")
def banned(model, plain):
    """Per setting: patterns from the stretches its unbanned text repeats most (one in any case, one ending in a
    word boundary), and the plain banned run with its step ends (where checkpoints can fall)."""
    out = {}
    for setting in SETTINGS:
        free, sched, _ = plain[setting]
        grams = Counter(text for _, body in bodies(free, sched, fixed_plan(BUDGETS))
                        for text in (body[a : a + 3] for a in range(len(body) - 3)) if text.strip() == text)
        top = [g for g, _ in grams.most_common(3)]
        patterns = check_patterns([f"(?i)({re.escape(top[0])}|{re.escape(top[1])})", f"{re.escape(top[2])}\\b"])
        got, gsched, steps = write(model, setting, [], sum(BUDGETS), patterns=patterns)
        ends = [sum(len(s.tokens) for s in steps[: k + 1]) for k in range(len(steps))]
        out[setting] = (free, sched), patterns, got, gsched, steps, ends
    return out


@pytest.mark.parametrize("setting", SETTINGS)
def test_with_an_outline_a_banned_pattern_is_never_matched_and_the_sections_keep_their_budgets(banned, setting):
    (free, free_sched), patterns, got, sched, steps, _ = banned[setting]
    assert all(found(free, free_sched, [p]) for p in patterns)
    assert len(got) == sum(BUDGETS)
    check_sections(got, sched, fixed_plan(BUDGETS), ENDERS)
    assert found(got, sched, patterns) is None
    assert sum(s.backtracks for s in steps) >= 3 and sum(s.let_through for s in steps) == 0


@pytest.mark.parametrize("setting", SETTINGS)
def test_with_an_outline_and_bans_speculative_equals_plain_and_resume_too(model, banned, setting):
    _, patterns, ref, ref_sched, ref_steps, ends = banned[setting]
    out, sched, steps = write(model, setting, DRAFTS["all"], sum(BUDGETS), patterns=patterns, budget=8)
    assert out == ref and sched.starts == ref_sched.starts
    assert sum(s.backtracks for s in steps) == sum(s.backtracks for s in ref_steps)
    assert max(len(s.tokens) for s in steps if not s.forced) >= 3
    for cut in sorted({ends[len(ends) // 3], ends[2 * len(ends) // 3], *ref_sched.starts[2:3]}):
        out, sched, _ = write(model, setting, DRAFTS["all"], len(ref) - cut, history=ref[:cut], patterns=patterns)
        assert out == ref and sched.starts == ref_sched.starts, cut


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_pattern_that_a_heading_completes_is_refused_before_the_heading(model, plain, setting):
    """The first section of the unbanned text ends in a word; that word's tail with a word boundary, banned: the
    heading's start completes it (the heading counts as the text's end), so decoding goes back there instead."""
    free, sched, _ = plain[setting]
    before, body = bodies(free, sched, fixed_plan(BUDGETS))[0]
    tail = re.search(r"\w{1,6}$", body).group(0)
    patterns = check_patterns([re.escape(body[-len(tail) - 2 :]) + "\\b"])
    n = sum(BUDGETS[:2])
    out, got_sched, steps = write(model, setting, [], n, patterns=patterns)
    assert any(s.backtracks and not s.forward_tokens for s in steps)  # end_text went back
    assert found(out, got_sched, patterns) is None and len(out) == n
    assert write(model, setting, DRAFTS["all"], n, patterns=patterns, budget=8)[0] == out


def test_without_an_outline_the_engine_is_unchanged(model):
    """pin_context() unset: the rebuilt context is the prompt and the recent tokens, as before outlines."""
    sources, stats = make_sources([], VOCAB)
    engine = Engine(model, Sampler(SETTINGS["greedy"], VOCAB), Window(CONTEXT, len(PROMPT)), sources, stats,
                    capacity=600)
    engine.start(PROMPT)
    got = [t for s in engine.run(300) for t in s.tokens]
    engine.n = len(PROMPT) + 250
    s, _ = engine.window.span(engine.n)
    ctx = engine._context_ids().tolist()
    assert ctx == PROMPT + (PROMPT + got)[s : engine.n]


def test_the_panel_and_the_progress_line_show_the_section(capsys):
    from rich.console import Console

    from swiftwrite.io.ui import Display, Progress

    p = Progress(500, 2000, 10.0, 500, 450, section=(2, 5, "The bottle", 130, 400))
    d = Display("live")
    console = Console(record=True, width=120)
    console.print(d._render(p, 50.0, 50.0))
    panel = console.export_text()
    assert "section" in panel and "2 of 5: The bottle   130/400 tokens" in panel
    Display("plain").update(p, force=True)
    assert "section 2/5 'The bottle' 130/400" in capsys.readouterr().err
    Display("plain").update(Progress(500, 2000, 10.0, 500, 450), force=True)
    assert "section" not in capsys.readouterr().err  # runs without an outline: unchanged


# ---------------------------------------------------------------------------------------------------------
# A round continued from an edited text (edits.continued_plan): one character is one token here


def edited_plan(text: str, more: int, budgets=(100, 100, 100, 100)):
    sections = [ol.Section(t) for t in ("The storm", "The bottle", "The reply", "The ship")]
    plan = schedule.Plan(sections, list(budgets), [[1]] * 4, [[2]] * 4)
    return continued_plan(plan, text, list(range(len(text))), lambda offset: offset, more, "outline.md")


def test_an_edited_text_is_in_the_section_of_its_last_heading_and_the_budgets_fit_the_new_length():
    text = "## The storm\n\n" + "a" * 86 + "\n\n## The bottle\n\n" + "b" * 30  # 102 + 45 characters
    plan = edited_plan(text, 200)
    assert plan.fixed_starts == [0, 102] and plan.fixed_length == len(text) == 147
    assert sum(plan.budgets) == len(text) + 200
    assert plan.budgets[0] == 102  # a finished section: the length the text gives it
    # what is left of each budget (100 - 45 for the current section, 100 for the next two) shares the 200, after
    # the sections to come have their minimum
    current, later = (plan.budgets[1] - 45) / 55, [(b - ol.MIN_SECTION) / 100 for b in plan.budgets[2:]]
    assert all(abs(current - x) < 0.03 for x in later), plan.budgets
    assert all(b >= ol.MIN_SECTION for b in plan.budgets[2:])


def test_a_heading_the_writer_typed_starts_its_section_and_a_deleted_one_leaves_its_section_empty():
    text = "## The storm\n\nabc\n\n## THE REPLY\n\nxyz"  # 'The bottle' is gone; 'The reply' typed in capitals
    plan = edited_plan(text, 50)
    at = text.index("## THE REPLY")
    assert plan.fixed_starts == [0, at, at]
    assert plan.budgets[1] == 0 and sum(plan.budgets) == len(text) + 50


def test_a_text_without_headings_is_the_first_section_and_too_few_tokens_for_the_rest_are_refused():
    plan = edited_plan("just prose, headings cut", 80)
    assert plan.fixed_starts == [0] and sum(plan.budgets) == len("just prose, headings cut") + 80
    with pytest.raises(UsageError, match="--tokens 40 leaves fewer than 16 tokens for each of the 3 sections"):
        edited_plan("just prose", 40)


def test_a_heading_out_of_the_outlines_order_or_not_in_it_is_text():
    text = "## The storm\n\nabc\n\n## The ship\n\n## An interlude\n\n## The bottle\n\nxyz"
    plan = edited_plan(text, 100)  # 'The ship' then 'The bottle': the ship is found first, the bottle not after it
    assert len(plan.fixed_starts) == 4
