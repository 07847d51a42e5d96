"""Outlines end to end: `swiftwrite generate --outline / --plan / --plan-only` and `resume` as subprocesses, on the
kill sweep's tiny random model (tests/killsweep.py: the default model's tokenizer, an LM head that writes the
ids of an English sentence, sentence ends included), with a small --context so the context is rebuilt several
times. Properties: headings once each, in order, at sentence ends where the grace allows; sections within ±10%
of their budgets; drafting = plain decoding; a run killed mid-section resumes to the same bytes; --plan's
outline is one the parser reads back.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from collections import Counter

import pytest

from swiftwrite.run import outline as ol
from swiftwrite.run import schedule
import killsweep
from gates import Holds
from test_cli import Background, clean_env, read_tokens, state_tokens, sw, text_of

TOKENS = 300
CONTEXT = 192  # the prompt with its outline is ~90 tokens: rebuilt every ~50 tokens
OUTLINE = """# The lighthouse

## The storm {tokens: 90}
The keeper fights to keep the lamp lit.

## The bottle
A bottle washes up with a letter.

## The reply {tokens: 70}

## The ship
"""
GREEDY = ["--temperature", "0"]
SAMPLED = ["--temperature", "0.8", "--seed", "5"]


@pytest.fixture(scope="module")
def work(tmp_path_factory, default_model_dir):
    w = tmp_path_factory.mktemp("outline-cli")
    model = killsweep.build_tiny_model(w / "tiny", default_model_dir)["path"]
    (w / "outline.md").write_text(OUTLINE)
    (w / "prompt.txt").write_text("A lighthouse keeper finds a message in a bottle.\n")
    return w, model


def args(work, name, *extra, draft="all"):
    w, model = work
    return ["generate", w / "prompt.txt", "--model", model, "--run-dir", w / name, "--tokens", TOKENS, "--chunk", 8,
            "--context", CONTEXT, "--outline", w / "outline.md", "--draft", draft, "--budget", 16, "--threads", 1,
            "--quiet", *extra]


def env(work, **extra):
    return clean_env(SWIFTWRITE_HOME=str(work[0] / "home"), **extra)


@pytest.fixture(scope="module")
def refs(work):
    out = {}
    for mode, flags in (("greedy", GREEDY), ("sampled", SAMPLED)):
        for draft in ("none", "all"):
            proc = sw(*args(work, f"{mode}-{draft}", *flags, draft=draft), env=env(work), cwd=work[0])
            assert proc.returncode == 0, proc.stderr.decode(errors="replace")
            out[mode, draft] = (work[0] / f"{mode}-{draft}", proc)
    return out


def sections_of(run_dir):
    plan = schedule.Plan.from_json(json.loads((run_dir / "outline.json").read_text()))
    starts = json.loads((run_dir / "state.json").read_text())["stats"]["sections"]["starts"]
    return plan, starts


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_drafting_equals_plain_decoding_with_an_outline(refs, mode):
    plain, spec = refs[mode, "none"][0], refs[mode, "all"][0]
    assert read_tokens(spec) == read_tokens(plain) and text_of(spec) == text_of(plain)
    assert sections_of(spec)[1] == sections_of(plain)[1]
    stats = json.loads((spec / "state.json").read_text())["stats"]
    assert stats["mean_tokens_per_forward"] > 1.1  # drafts were accepted, so steps could cross boundaries


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_headings_appear_once_in_order_and_sections_keep_their_budgets(refs, work, mode):
    run, proc = refs[mode, "all"]
    text = text_of(run)
    assert proc.stdout.decode() == text
    plan, starts = sections_of(run)
    assert [s.title for s in plan.sections] == ["The storm", "The bottle", "The reply", "The ship"]
    assert plan.budgets == [90, 70, 70, 70] and sum(plan.budgets) == TOKENS
    at = [text.find(f"## {s.title}\n\n") for s in plan.sections]
    assert at[0] == 0 and at == sorted(at) and all(text.count(f"## {s.title}") == 1 for s in plan.sections), text
    tokens = read_tokens(run)
    assert len(tokens) == TOKENS and len(starts) == 4
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(work[1])
    sched = schedule.Schedule(plan, schedule.ender_ids(tok, len(tok)))
    sched.replay(tokens)  # the rule, applied to the tokens afresh, finds the boundaries the run recorded
    assert sched.starts == starts
    for k, s in enumerate(starts):
        assert tokens[s : s + len(plan.headings[k])] == plan.headings[k]
    lengths = [b - a for a, b in zip(starts, starts[1:] + [TOKENS])]
    assert all(abs(n - b) <= 0.1 * b for n, b in zip(lengths, plan.budgets)), (lengths, plan.budgets)
    # each section before the last ends at a sentence end, unless the grace ran out (the tiny model's sentences
    # are long: at least one must still end at a full stop for the rule to have been exercised)
    before = [text[: at[k]].rstrip(" ") for k in range(1, 4)]
    assert any(b.endswith((".", "!", "?")) or b.endswith("\n") for b in before), before
    md = (run / "outline.md").read_text()
    assert [s.title for s in ol.parse(md)] == [s.title for s in plan.sections]


def test_bans_by_pattern_with_an_outline_hold_in_every_section_and_drafting_equals_plain(refs, work):
    """Ban the words the sampled text uses most (a pattern with word boundaries, any case): with drafts and
    without, the same bytes; no section's text matches; every heading still once, in order."""
    text = text_of(refs["sampled", "all"][0])
    titles = [s.title for s in sections_of(refs["sampled", "all"][0])[0].sections]
    words = re.findall(r"[a-z]{4,}", text.lower())
    top = [w for w, _ in Counter(w for w in words if w not in " ".join(titles).lower()).most_common(2)]
    pattern = f"(?i)\\b({top[0]}|{top[1]})\\b"
    runs = {}
    for draft in ("none", "all"):
        proc = sw(*args(work, f"banned-{draft}", *SAMPLED, "--ban-pattern", pattern, draft=draft), env=env(work),
                  cwd=work[0])
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        runs[draft] = work[0] / f"banned-{draft}"
    assert read_tokens(runs["all"]) == read_tokens(runs["none"]) and text_of(runs["all"]) == text_of(runs["none"])
    banned = text_of(runs["all"])
    at = [banned.find(f"## {t}\n\n") for t in titles]
    assert at[0] == 0 and at == sorted(at) and all(banned.count(f"## {t}") == 1 for t in titles), banned
    bodies = re.split("|".join(f"## {t}\n\n" for t in titles), banned)
    rx = re.compile(pattern[4:], re.I | re.A)
    assert rx.search(text) and not any(rx.search(b) for b in bodies), banned
    stats = json.loads((runs["all"] / "state.json").read_text())["stats"]
    assert stats["banned_phrases"]["backtracks"] >= 1 and stats["banned_phrases"]["patterns"] == 1


def test_the_context_was_rebuilt_several_times(refs, work):
    w, _ = work
    run = refs["greedy", "all"][0]
    prompt = len(json.loads((run / "meta.json").read_text())["prompt_ids"])
    plan, _ = sections_of(run)
    from swiftwrite.decoding.window import Window

    win = Window(CONTEXT, prompt + plan.pin_max)
    rebuilds = len({win.span(prompt + i)[0] for i in range(TOKENS)}) - 1
    assert rebuilds >= 3, rebuilds
    assert json.loads((run / "meta.json").read_text())["format"] == 2


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_killed_mid_section_then_resumed_gives_the_same_bytes(refs, work, tmp_path, mode):
    ref = refs[mode, "all"][0]
    _, starts = sections_of(ref)
    name = f"killed-{mode}"
    run = work[0] / name
    with Holds(tmp_path / "holds") as holds:  # killed inside the first checkpoint past that point, held there
        bg = Background(tmp_path, args(work, name, *(GREEDY if mode == "greedy" else SAMPLED)),
                        env=env(work, **holds.env()))
        assert holds.until(bg.proc, lambda: state_tokens(run) >= starts[1] + 20), "the run ended too soon"
        bg.proc.send_signal(signal.SIGKILL)
        bg.finish()
    at = state_tokens(run)
    inside = [k for k in range(4) if starts[k] < at < (starts + [TOKENS])[k + 1]]
    assert inside and at not in starts, (at, starts)
    proc = sw("resume", run, "--out", tmp_path / "out.md", "--quiet", env=env(work), cwd=work[0])
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert read_tokens(run) == read_tokens(ref)
    assert (run / "output.txt").read_bytes() == (ref / "output.txt").read_bytes()
    assert (tmp_path / "out.md").read_bytes() == (ref / "output.txt").read_bytes()
    assert sections_of(run)[1] == starts


def test_plan_only_writes_an_outline_the_parser_reads_back_and_no_run(work, tmp_path):
    w, model = work
    proc = sw("generate", w / "prompt.txt", "--model", model, "--plan-only", "--sections", 4, "--tokens", 400,
              "--run-dir", tmp_path / "nothing", "--threads", 1, env=env(work), cwd=tmp_path)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, err
    got = ol.parse(proc.stdout.decode())
    assert len(got) == 4 and all(s.title for s in got)
    if any(s.title.startswith("Part ") for s in got):  # the tiny model writes no list: say so
        assert "'Part k'" in err and "--outline" in err
    assert not (tmp_path / "nothing").exists() and not list(tmp_path.rglob("meta.json"))


def test_plan_writes_the_document_from_its_own_outline(work, tmp_path):
    w, model = work
    run = tmp_path / "planned"
    proc = sw("generate", w / "prompt.txt", "--model", model, "--plan", "--sections", 3, "--tokens", 150,
              "--run-dir", run, "--threads", 1, "--quiet", *GREEDY, env=env(work), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    sections = ol.parse((run / "outline.md").read_text())
    assert len(sections) == 3
    text = text_of(run)
    at = [text.find(f"## {s.title}\n\n") for s in sections]
    assert at[0] == 0 and at == sorted(at), text


# ---------------------------------------------------------------------------------------------------------
# A round continued from the writer's edit of an outlined document (resume --edited)

MORE = 120


def edited_text(text: str) -> str:
    """The writer's edit: the text cut 60 characters into 'The bottle', a word changed, the next heading typed."""
    at = text.find("## The bottle\n\n")
    cut = text[: at + len("## The bottle\n\n") + 60].replace(" the ", " a ", 1)
    return cut + "\n\n## The reply\n\nThe keeper wrote back at once, and"


def round_two(run):
    plan = schedule.Plan.from_json(json.loads((run / "rounds/2/outline.json").read_text()))
    return plan, json.loads((run / "state.json").read_text())["stats"]["sections"]["starts"]


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_an_edited_round_stays_in_the_section_its_text_ends_in_and_drafting_equals_plain(refs, work, tmp_path, mode):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(work[1])
    got = {}
    for draft in ("none", "all"):
        run, doc = tmp_path / draft, tmp_path / f"{draft}.md"
        shutil.copytree(refs[mode, draft][0], run)
        (run / "lock").unlink()
        edited = edited_text(text_of(run))
        doc.write_text(edited, encoding="utf-8")
        proc = sw("resume", run, "--edited", doc, "--tokens", MORE, "--quiet", env=env(work), cwd=work[0])
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        text, tokens = doc.read_text(encoding="utf-8"), read_tokens(run)
        assert text.startswith(edited) and text == text_of(run)
        plan, starts = round_two(run)
        assert len(tokens) == plan.fixed_length + MORE == sum(plan.budgets)
        # sections 1-3 start where the edited text has them (3: the heading the writer typed), 4 where the rule puts it
        assert starts[:3] == plan.fixed_starts and len(starts) == 4 and starts[3] > plan.fixed_length
        typed = edited.find("## The reply")
        assert len(tok.decode(tokens[: starts[2]])) <= typed < len(tok.decode(tokens[: starts[2] + 1]))
        assert text.count("## The reply") == 1 and text.count("## The ship") == 1 and text.find("## The ship") > len(edited)
        end = sum(plan.budgets[:3])  # the section being written ends on its adjusted budget (within the grace)
        assert end <= starts[3] <= end + schedule.GRACE_MAX, (starts, plan.budgets)
        got[draft] = tokens
    assert got["all"] == got["none"]


def test_a_sigkill_inside_an_edited_outlined_round_resumes_to_the_same_bytes(refs, work, tmp_path):
    runs = {}
    for name in ("ref", "killed"):
        runs[name] = run = tmp_path / name
        shutil.copytree(refs["greedy", "all"][0], run)
        (run / "lock").unlink()
        (tmp_path / f"{name}.md").write_text(edited_text(text_of(run)), encoding="utf-8")
    proc = sw("resume", runs["ref"], "--edited", tmp_path / "ref.md", "--tokens", MORE, "--quiet", env=env(work),
              cwd=work[0])
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    killed = runs["killed"]
    (tmp_path / "proc").mkdir()

    def inside_the_round() -> bool:
        try:
            state = json.loads((killed / "state.json").read_text())
        except (OSError, ValueError):
            return False
        return state.get("round") == 2 and state["stats"].get("tokens", 0) >= 16  # two chunks of the round written

    with Holds(tmp_path / "holds") as holds:  # killed inside the first checkpoint that finds them, held there
        bg = Background(tmp_path / "proc", ["resume", killed, "--edited", tmp_path / "killed.md", "--tokens", MORE,
                                            "--quiet"], env=env(work, **holds.env()))
        assert holds.until(bg.proc, inside_the_round), "the run ended too soon"
        bg.proc.send_signal(signal.SIGKILL)
        rc, _, err = bg.finish()
    assert rc == -signal.SIGKILL, err
    proc = sw("resume", killed, "--quiet", env=env(work), cwd=work[0])
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert read_tokens(killed) == read_tokens(runs["ref"])
    assert text_of(killed) == text_of(runs["ref"]) == (tmp_path / "ref.md").read_text(encoding="utf-8")
    assert round_two(killed)[1] == round_two(runs["ref"])[1]
