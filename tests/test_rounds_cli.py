"""`resume --edited` end to end on the real default model, a subprocess per command (slow tier).

Properties: the edited text is the continuation's prefix byte for byte; the continued round is token-identical
with drafting on and off (greedy and sampled); a SIGKILL inside the continued round resumes to the same bytes.
"""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from gates import Holds
from test_cli import GREEDY, SAMPLED, Background, clean_env, read_tokens, sw, text_of

T, MORE, CHUNK = 32, 40, 8


@pytest.fixture(scope="module")
def work(tmp_path_factory, default_model_dir):
    w = tmp_path_factory.mktemp("rounds")
    (w / "prompt.txt").write_text("Write a short story about a lighthouse keeper who finds a message in a bottle.\n")
    return w


def first_round(work, name: str, args) -> tuple:
    """A finished first round and the writer's edit of it (a name changed, a line added), in <name>.md."""
    d, doc = work / name, work / f"{name}.md"
    p = sw("generate", work / "prompt.txt", "--run-dir", d, "--tokens", T, "--chunk", CHUNK, "--out", doc, *args,
           "--quiet", cwd=work)
    assert p.returncode == 0, p.stderr
    text = doc.read_text(encoding="utf-8")
    words = text.split(" ")
    edited = " ".join(words[:4] + ["Ada"] + words[5:]) + "\n\nThe bottle was green, and"
    doc.write_text(edited, encoding="utf-8")
    return d, doc, edited


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_continued_round_is_the_same_with_drafting_on_and_off_and_starts_with_the_edit(work, mode):
    args = GREEDY if mode == "greedy" else SAMPLED
    results = {}
    for draft in ("none", "all"):
        d, doc, edited = first_round(work, f"{mode}-{draft}", [*args, "--draft", draft])
        p = sw("resume", d, "--edited", doc, "--tokens", MORE, "--no-live", "--stats-json", work / f"{mode}-{draft}.json",
               cwd=work)
        assert p.returncode == 0, p.stderr
        assert doc.read_bytes().startswith(edited.encode()) and len(doc.read_bytes()) > len(edited.encode())
        assert doc.read_bytes() == (d / "output.txt").read_bytes()
        assert (d / "rounds/2/edited.txt").read_text(encoding="utf-8") == edited
        stats = json.loads((work / f"{mode}-{draft}.json").read_text())
        assert stats["round"] == 2 and stats["tokens"] == MORE
        results[draft] = read_tokens(d)
    assert results["all"] == results["none"]


def test_a_sigkill_inside_a_continued_round_resumes_to_the_same_bytes(work):
    ref, doc, edited = first_round(work, "kill-ref", [*GREEDY, "--draft", "all"])
    killed = work / "kill-run"
    shutil.copytree(ref, killed)
    (killed / "lock").unlink()
    kdoc = work / "kill-run.md"
    shutil.copy(doc, kdoc)
    p = sw("resume", ref, "--edited", doc, "--tokens", MORE, "--no-live", cwd=work)
    assert p.returncode == 0, p.stderr
    tmp = work / "kill.proc"
    tmp.mkdir()

    def in_round_two_past_a_checkpoint() -> bool:
        try:
            state = json.loads((killed / "state.json").read_text())
        except (OSError, ValueError):
            return False
        return state.get("round") == 2 and state["stats"].get("tokens", 0) > 0  # a chunk of the round checkpointed

    # killed inside the first checkpoint that finds one: the run waits there for the test (gates.Holds)
    with Holds(tmp / "holds") as holds:
        bg = Background(tmp, ["resume", killed, "--edited", kdoc, "--tokens", MORE, "--quiet"],
                        env=clean_env(**holds.env()))
        assert holds.until(bg.proc, in_round_two_past_a_checkpoint), "the run ended too soon"
        bg.proc.kill()
        rc, _, err = bg.finish()
    assert rc == -signal.SIGKILL, err
    p = sw("resume", killed, "--no-live", cwd=work)
    assert p.returncode == 0, p.stderr
    assert read_tokens(killed) == read_tokens(ref)
    assert text_of(killed) == text_of(ref)
    assert text_of(killed).encode().startswith(edited.encode())
