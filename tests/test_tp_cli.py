"""Tensor parallelism from the command line (`swiftwrite generate --tp 2`, ranks.py), as a user runs it: real
subprocesses, 2 gloo ranks on this CPU, a tiny random Llama (4 query heads, 2 KV heads, 96 MLP columns: each divides
by 2) with the default model's tokenizer (bench/kill_sweep.py builds it).

Shown: drafting under 2 ranks writes what plain decoding under 2 ranks writes; SIGKILL of rank 0, SIGKILL of rank 1
and SIGTERM to the command, each mid-run, then `swiftwrite resume`, give the uninterrupted run's tokens and text;
bad input gets one sentence, every rank exits, and nothing is half-written.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from gates import Holds
from test_kill_sweep import load_sweep

ks = load_sweep()
TOKENS = 400
RUN = ["--tokens", str(TOKENS), "--chunk", "16", "--temperature", "0.8", "--seed", "5", "--quiet"]


@pytest.fixture(scope="module")
def work(tmp_path_factory, default_model_dir):
    work = tmp_path_factory.mktemp("tp-cli")
    ks.build_tiny_model(work / "model", default_model_dir)
    (work / "prompt.txt").write_text(ks.PROMPT)
    return work


def env(work: Path, **extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SWIFTWRITE_")}
    e.update(SWIFTWRITE_HOME=str(work / "home"), OMP_WAIT_POLICY="PASSIVE", **extra)
    return e


def start(work: Path, *args: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "swiftwrite", *args], cwd=work, env=env(work, **extra),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run(work: Path, *args: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "swiftwrite", *args], cwd=work, env=env(work), stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    return p.returncode, p.stderr


def generate(work: Path, name: str, *extra: str) -> list[str]:
    return ["generate", "prompt.txt", "--model", "model", "--run-dir", name, *RUN, *extra]


def ranks_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the processes a `--tp` launcher started (its children, named by their RANK)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            environ = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
            found[int(environ["RANK"])] = int(d.name)
        except (OSError, ValueError, IndexError, KeyError):
            continue
    return found


def no_ranks_left(work: Path) -> bool:
    """No process still runs in `work` (each rank's working directory is the test's)."""
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.readlink(d / "cwd") == str(work) and int(d.name) != os.getpid():
                return False
        except OSError:
            continue
    return True


@pytest.fixture(scope="module")
def reference(work):
    """The uninterrupted run under 2 ranks, drafting (recycling + n-gram, fixed budget)."""
    rc, err = run(work, *generate(work, "ref", "--tp", "2", "--budget", "16"))
    assert rc == 0, err
    return ks.read_tokens(work / "ref"), (work / "ref" / "output.txt").read_text()


def test_drafting_under_two_ranks_writes_what_plain_decoding_under_two_ranks_writes(work, reference):
    rc, err = run(work, *generate(work, "plain", "--tp", "2", "--draft", "none"))
    assert rc == 0, err
    assert len(reference[0]) == TOKENS
    assert ks.read_tokens(work / "plain") == reference[0]
    assert (work / "plain" / "output.txt").read_text() == reference[1]
    state = ks.read_state(work / "ref")
    assert state["stats"]["tp"] == 2 and state["finished"]
    assert state["stats"]["forward_passes"] < TOKENS, "no drafted token was accepted: the comparison proves little"


def test_bans_under_two_ranks_hold_and_drafting_writes_what_plain_decoding_writes(work, reference):
    """The two words the reference writes most, banned (one as a phrase, one as a pattern): drafting = plain under
    2 ranks, neither in the text."""
    (phrase, _), (word, _) = Counter(re.findall(r"[a-z]{3,}", reference[1].lower())).most_common(2)
    pattern = re.compile(f"(?i)\\b{word}\\b")
    for name, extra in (("ban-plain", ["--draft", "none"]), ("ban-drafted", ["--budget", "16"])):
        rc, err = run(work, *generate(work, name, "--tp", "2", "--ban", phrase, "--ban-pattern", pattern.pattern, *extra))
        assert rc == 0, err
    text = (work / "ban-plain" / "output.txt").read_text()
    assert ks.read_tokens(work / "ban-drafted") == ks.read_tokens(work / "ban-plain")
    assert (work / "ban-drafted" / "output.txt").read_text() == text and len(ks.read_tokens(work / "ban-plain")) == TOKENS
    assert phrase not in text.lower() and not pattern.search(text) and pattern.search(reference[1])
    stats = ks.read_state(work / "ban-drafted")["stats"]
    assert stats["tp"] == 2 and stats["banned_phrases"]["backtracks"] >= 2
    assert stats["forward_passes"] < TOKENS, "no drafted token was accepted: the comparison proves little"


@pytest.mark.parametrize("victim", ["rank 0", "rank 1", "the command"])
def test_a_run_ended_mid_way_resumes_to_the_uninterrupted_text(work, reference, victim):
    """SIGKILL of rank 0 or rank 1, or SIGTERM to the `--tp 2` command, once 64 tokens are checkpointed; then
    `swiftwrite resume` (which starts 2 ranks again, as the run recorded) completes it. Rank 0 waits for the test
    inside the first checkpoint past 64 tokens (gates.Holds; the ranks inherit the launcher's environment) until
    the kill, or until the forwarded SIGTERM has reached it, so the run is cut there however busy the machine."""
    name = "killed-" + victim.replace(" ", "")
    with Holds(work / f"{name}.holds") as holds:
        launcher = start(work, *generate(work, name, "--tp", "2", "--budget", "16"), **holds.env())
        past_64 = holds.until(launcher, lambda: ks.read_state(work / name).get("n_tokens", 0) >= 64)
        assert past_64, launcher.stderr.read()
        if victim == "the command":
            launcher.send_signal(signal.SIGTERM)
            assert holds.signalled(launcher, signal.SIGTERM), launcher.stderr.read()  # forwarded to rank 0
        else:
            os.kill(ranks_of(launcher.pid)[int(victim[-1])], signal.SIGKILL)
        holds.open()
        rc = launcher.wait(timeout=120)
    err = launcher.stderr.read()
    assert rc != 0 and f"swiftwrite resume" in err, err
    assert len(err.strip().splitlines()) == 1, err  # one sentence, from rank 0 or the launcher
    written = len(ks.read_tokens(work / name))
    assert 64 <= written < TOKENS, f"the run was not cut mid-way ({written} tokens)"
    time.sleep(0.5)
    assert no_ranks_left(work)
    rc, err = run(work, "resume", name, "--quiet")
    assert rc == 0, err
    assert ks.read_tokens(work / name) == reference[0]
    assert (work / name / "output.txt").read_text() == reference[1]


def test_resume_keeps_the_number_of_ranks_unless_forced(work, reference):
    rc, err = run(work, "resume", "ref", "--tp", "1", "--tokens", str(TOKENS + 16))
    assert rc == 1 and "written by 2 tensor-parallel ranks" in err and "--force" in err, err
    assert len(ks.read_tokens(work / "ref")) == TOKENS  # refused before anything was written
    rc, err = run(work, "resume", "ref", "--tp", "1", "--force", "--tokens", str(TOKENS + 16), "--quiet")
    assert rc == 0, err
    assert ks.read_tokens(work / "ref")[:TOKENS] == reference[0] and len(ks.read_tokens(work / "ref")) == TOKENS + 16
    assert ks.read_state(work / "ref")["stats"]["tp"] == 1


def test_bad_input_gets_one_sentence_and_every_rank_exits(work, default_model_dir):
    cores = os.cpu_count()
    cases = {
        "over": (["--model", "model", "--tp", str(cores + 1)], f"needs {cores + 1} CPU cores"),
        # the default model's 9 query heads and 3 KV heads do not divide by 2
        "divide": (["--model", str(default_model_dir), "--tp", "2"], "9 attention heads do not divide by 2 ranks"),
        "quantized": (["--model", "model", "--tp", "2", "--weights", "int8"], "not split across ranks"),
    }
    bad = work / "bad-model"
    bad.mkdir()
    for f in (work / "model").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = bad / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)
    cases["shard"] = (["--model", "bad-model", "--tp", "2"], "could not load its shard")
    for name, (args, said) in cases.items():
        rc, err = run(work, "generate", "prompt.txt", "--run-dir", f"bad-{name}", "--tokens", "50", "--quiet", *args)
        assert rc == 1 and said in err and len(err.strip().splitlines()) == 1, (name, err)
        assert not (work / f"bad-{name}").exists(), name  # nothing half-written
        assert no_ranks_left(work), name
