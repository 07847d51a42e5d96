"""The command line end to end, on the real default model, as a user runs it: a subprocess per command.

Properties: stdout carries only the text; stderr is clean when it is not a terminal; greedy decoding equals
transformers; same seed, same text, with or without drafting; an interrupted or killed run resumes to exactly
the tokens of an uninterrupted one; a run directory is never overwritten or shared.

Each model run costs a few seconds of loading, so the runs are short (T tokens, a checkpoint every CHUNK) and
the uninterrupted reference runs are made once per module and shared by the tests that compare against them.
"""

from __future__ import annotations

import json
import os
import pty
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import pytest

from gates import FullPipe, Holds

T = 32  # tokens per reference run
CHUNK = 8  # tokens between checkpoints: four checkpoints per run, so there is a "between" to interrupt
GREEDY = ["--temperature", "0"]  # the penalty stays on (its default): that is how people run it
SAMPLED = ["--temperature", "0.8", "--seed", "7"]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
KILL_SEED = int(os.environ.get("SWIFTWRITE_TEST_KILL_SEED", "20260101"))  # the "random" kill delays


# ---------------------------------------------------------------------------------------------------------
# helpers


def clean_env(**extra) -> dict[str, str]:
    """The caller's environment (SWIFTWRITE_HOME included, so the model is found where the fixture put it),
    minus anything that would change what is tested: option variables, colour forcing."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("SWIFTWRITE_") and k != "SWIFTWRITE_HOME") and k not in ("NO_COLOR", "FORCE_COLOR")}
    # Without this, OpenMP's worker threads spin while they wait; on a machine where anything else runs (a
    # shared CI runner, the test's own polling) two spinning threads on two cores slowed a 32-token run from
    # 8 s to 30-50 s. The waiting policy changes no number the model computes.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["SWIFTWRITE_BACKEND"] = os.environ.get("SWIFTWRITE_BACKEND", "torch")  # the path under test (conftest.py)
    env.update(extra)
    return env


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "swiftwrite.cli", *map(str, args)]


def sw(*args, stdin: bytes = b"", env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), input=stdin, capture_output=True, env=env or clean_env(), cwd=cwd, timeout=timeout)


def read_tokens(run_dir: Path) -> list[int]:
    a = array("i")
    a.frombytes((run_dir / "tokens.bin").read_bytes())
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def text_of(run_dir: Path) -> str:
    return (run_dir / "output.txt").read_text(encoding="utf-8")


def state_tokens(run_dir: Path) -> int:
    return json_tokens(run_dir / "state.json")


def json_tokens(state: Path) -> int:
    """n_tokens of a state file (state.json, or the state.json.tmp of a checkpoint held in its window); -1: none."""
    try:
        return json.loads(state.read_text())["n_tokens"]
    except (OSError, ValueError, KeyError):
        return -1


def wait_for(pred, proc: subprocess.Popen, timeout=240.0, every=0.01) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before the moment the test waits for")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(every)


@dataclass
class Run:
    dir: Path
    proc: subprocess.CompletedProcess

    @property
    def stderr(self) -> str:
        return self.proc.stderr.decode("utf-8", errors="replace")


class Background:
    """A generate in a subprocess, stdout and stderr to files (or stdout to a pipe the test holds, `stdout`), so
    the test can signal it mid-run."""

    def __init__(self, tmp: Path, args, env=None, stdout: int | None = None):
        self.out = open(tmp / "stdout", "w+b") if stdout is None else None
        self.err = open(tmp / "stderr", "w+b")
        self.proc = subprocess.Popen(cli(*args), stdin=subprocess.DEVNULL, stdout=self.out or stdout, stderr=self.err,
                                     env=env or clean_env(), cwd=tmp)

    def finish(self, timeout=300) -> tuple[int, bytes, str]:
        """Exit status, stdout (b"" when it went to the test's pipe), stderr."""
        rc = self.proc.wait(timeout=timeout)
        self.err.seek(0)
        out = b""
        if self.out is not None:
            self.out.seek(0)
            out = self.out.read()
        return rc, out, self.err.read().decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------------
# fixtures: the prompt and the uninterrupted reference runs


@pytest.fixture(scope="module")
def work(tmp_path_factory, default_model_dir) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def prompt(work) -> Path:
    p = work / "prompt.txt"
    p.write_text(PROMPT + "\n")
    return p


def generate(work: Path, name: str, prompt: Path, *args, stdin=b"", env=None) -> Run:
    d = work / name
    proc = sw("generate", prompt, "--run-dir", d, "--tokens", T, "--chunk", CHUNK, *args, stdin=stdin, env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return Run(d, proc)


@pytest.fixture(scope="module")
def greedy_ref(work, prompt) -> Run:
    """Greedy, penalty on, drafting on; the prompt comes from standard input; statistics as JSON."""
    return generate(work, "greedy-all", "-", *GREEDY, "--draft", "all", "--stats-json", work / "greedy-all.json",
                    stdin=prompt.read_bytes())


@pytest.fixture(scope="module")
def sampled_ref(work, prompt) -> Run:
    """Seeded sampling, penalty on, drafting on, --quiet."""
    return generate(work, "sampled-all", prompt, *SAMPLED, "--draft", "all", "--quiet")


# ---------------------------------------------------------------------------------------------------------
# streams


def test_stdin_prompt_and_stdout_carries_only_the_text(greedy_ref, prompt):
    out = greedy_ref.proc.stdout.decode("utf-8")
    assert out == text_of(greedy_ref.dir) and out.strip()
    assert (greedy_ref.dir / "prompt.txt").read_text() == prompt.read_text()  # the prompt came through stdin
    assert "run directory" not in out and "run directory" in greedy_ref.stderr


def test_stderr_that_is_not_a_terminal_has_no_escape_codes(greedy_ref):
    assert "\x1b" not in greedy_ref.stderr
    assert f"{T}/{T} tokens" in greedy_ref.stderr  # the plain progress line, final state


def test_auto_weights_say_the_default_models_own_4_bit_layers_are_an_option(greedy_ref):
    """The default model comes as a Q4_1 GGUF: auto runs it de-quantized to float32 and names the faster setting."""
    assert "de-quantized from the model's Q4_1 GGUF; --weights int4 keeps its own bits" in greedy_ref.stderr
    assert "weights: float\n" in (greedy_ref.dir / "config.yaml").read_text()  # what a resume will use


def test_quiet_prints_nothing_on_stderr(sampled_ref):
    assert sampled_ref.proc.stderr == b""
    assert sampled_ref.proc.stdout.decode("utf-8") == text_of(sampled_ref.dir)


def test_stats_json_has_the_promised_keys(greedy_ref, work):
    stats = json.loads((work / "greedy-all.json").read_text())
    for key in ("tokens", "seconds", "tokens_per_second", "forward_passes", "mean_tokens_per_forward",
                "per_source", "peak_rss_bytes"):
        assert key in stats, key
    assert stats["tokens"] == T == len(read_tokens(greedy_ref.dir))
    assert stats["forward_passes"] >= 1 and stats["mean_tokens_per_forward"] >= 1.0
    # "all" = recycling + ngram, plus the shipped heads when they match the model (they do for the default model)
    assert set(stats["per_source"]) == {"recycling", "ngram", "heads"}
    assert stats["peak_rss_bytes"] > 0 and stats["seconds"] > 0
    # text quality beside the speed: the figures of the tokens on disk, and no loop in a short healthy run
    from swiftwrite.base.metrics import distinct, distinct_per_window, longest_repeat

    toks = read_tokens(greedy_ref.dir)
    assert stats["distinct_1_per_500"] == distinct_per_window(toks, 500) and len(stats["distinct_1_per_500"]) == T // 500
    assert stats["distinct"] == distinct(toks) and set(stats["distinct"]) == {f"distinct_{n}" for n in range(1, 5)}
    assert 0.5 < stats["distinct"]["distinct_4"] <= 1.0
    assert stats["longest_repeat"] == longest_repeat(toks) < 16 and stats["longest_current_repeat"] == 0
    assert "stopped" not in stats and "repeating itself" not in greedy_ref.stderr


def test_progress_log_records_the_recent_distinct_4_distinct_1_and_the_current_repeat(greedy_ref):
    from swiftwrite.base.metrics import distinct_n
    from swiftwrite.decoding.repetition import LoopWatch

    toks = read_tokens(greedy_ref.dir)
    records = [json.loads(line) for line in (greedy_ref.dir / "progress.jsonl").read_text().splitlines()]
    assert len(records) >= 2 and records[-1]["total_tokens"] == T
    for r in records:
        upto = toks[: r["total_tokens"]]
        assert r["distinct_4_last_2000"] == round(distinct_n(upto[-2000:], 4), 4)
        assert r["distinct_1_last_500"] == (round(distinct_n(upto[-500:], 1), 3) if len(upto) >= 500 else None)
        assert r["longest_current_repeat"] == LoopWatch(upto).current


def test_no_color_is_honoured_on_a_terminal(work, prompt, sampled_ref):
    """stderr on a pseudo-terminal gets the live panel; with NO_COLOR it carries no colour codes. The same run
    doubles as "seeded sampling without drafting equals seeded sampling with it"."""
    d = work / "sampled-none-tty"
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.run(cli("generate", prompt, "--run-dir", d, "--tokens", T, "--chunk", CHUNK, *SAMPLED,
                              "--draft", "none"), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                          env=clean_env(NO_COLOR="1", TERM="xterm-256color", COLUMNS="100"), cwd=work, timeout=300)
    os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    err = b"".join(chunks).decode("utf-8", errors="replace")
    assert proc.returncode == 0, err
    assert "\x1b" in err, "expected the live panel on a terminal"
    colours = [c for params in re.findall(r"\x1b\[([0-9;]*)m", err) for c in params.split(";")
               if c and (30 <= int(c) <= 38 or 40 <= int(c) <= 48 or 90 <= int(c) <= 107)]
    assert not colours, f"colour codes despite NO_COLOR: {sorted(set(colours))}"
    assert proc.stdout.decode("utf-8") == text_of(d)
    assert read_tokens(d) == read_tokens(sampled_ref.dir)


# ---------------------------------------------------------------------------------------------------------
# exactness


def test_greedy_without_penalty_equals_transformers_generate(work, prompt, default_model_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    n = 60
    d = work / "greedy-hf"
    proc = sw("generate", prompt, "--run-dir", d, "--tokens", n, "--temperature", 0, "--penalty", 1, "--draft", "none",
              "--quiet", cwd=work)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    ours = read_tokens(d)
    assert len(ours) == n

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    ids = tok.apply_chat_template([{"role": "user", "content": prompt.read_text()}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    assert json.loads((d / "meta.json").read_text())["prompt_ids"] == ids  # the chat template, as transformers applies it
    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, repetition_penalty=1.0, num_beams=1,
                             pad_token_id=tok.eos_token_id)
    theirs = out[0, len(ids):].tolist()
    # swiftwrite suppresses end-of-text until --tokens are written; transformers stops there. Compare up to it.
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    upto = next((i for i, t in enumerate(theirs) if t in eos), len(theirs))
    assert upto >= 40, "the prompt should let transformers write at least 40 tokens before end-of-text"
    assert ours[:upto] == theirs[:upto]


def test_greedy_drafting_equals_plain_decoding(work, prompt, greedy_ref):
    plain = generate(work, "greedy-none", prompt, *GREEDY, "--draft", "none", "--quiet")
    assert read_tokens(plain.dir) == read_tokens(greedy_ref.dir)
    assert text_of(plain.dir) == text_of(greedy_ref.dir)


def test_seeded_sampling_gives_identical_text_twice(work, prompt, sampled_ref):
    again = generate(work, "sampled-all-again", prompt, *SAMPLED, "--draft", "all", "--quiet")
    assert text_of(again.dir) == text_of(sampled_ref.dir)
    assert read_tokens(again.dir) == read_tokens(sampled_ref.dir)


# ---------------------------------------------------------------------------------------------------------
# interruption and resume


def killed_between_checkpoints(d: Path, bg: Background, holds: Holds, pipe: FullPipe, tokens: int) -> None:
    """Hold `bg` (started with `holds.env()` and `pipe.w` as its stdout) between its first checkpoint of at least
    `tokens` tokens and the next: that checkpoint waits while the test fills the pipe, then finishes; the run's next
    write of text waits for a reader, so the next checkpoint cannot come."""
    assert holds.until(bg.proc, lambda: json_tokens(d / "state.json.tmp") >= tokens), "the run ended too soon"
    pipe.fill()
    holds.open()
    wait_for(lambda: state_tokens(d) >= tokens, bg.proc)


def interrupted(work: Path, name: str, prompt: Path, mode_args, signum: int, while_running=None) -> tuple[Path, int, bytes, str]:
    """Start a run, hold it inside its first checkpoint, send `signum` there; returns (dir, exit status, stdout,
    stderr). The run waits for the test at that checkpoint (gates.Holds) until the signal has reached it, so however
    long `while_running` or a busy machine takes, the signal lands mid-run, never after the last token."""
    d = work / name
    tmp = work / f"{name}.proc"
    tmp.mkdir()
    with Holds(tmp / "holds") as holds:
        bg = Background(tmp, ["generate", prompt, "--run-dir", d, "--tokens", T, "--chunk", CHUNK, *mode_args,
                              "--draft", "all", "--no-live"], env=clean_env(**holds.env()))
        wait_for(lambda: (d / "meta.json").exists(), bg.proc)
        if while_running:
            while_running(d)
        assert holds.next(bg.proc), "the run ended before its first checkpoint"
        bg.proc.send_signal(signum)
        assert holds.signalled(bg.proc, signum), "the run ended before the signal reached it"
        holds.open()
        rc, out, err = bg.finish()
    return d, rc, out, err


def test_sigint_checkpoints_prints_the_resume_command_and_resume_completes_it(work, prompt, greedy_ref):
    second: dict = {}

    def try_to_share(d: Path):  # a second process on the same run directory, while the first holds it
        second["resume"] = sw("resume", d, cwd=work, timeout=60)
        second["generate"] = sw("generate", prompt, "--run-dir", d, "--tokens", 4, cwd=work, timeout=60)

    d, rc, out1, err = interrupted(work, "sigint", prompt, GREEDY, signal.SIGINT, while_running=try_to_share)
    assert rc == 130, err
    assert f"swiftwrite resume {d}" in err
    n = len(read_tokens(d))
    assert CHUNK <= n < T
    assert out1.decode("utf-8") == text_of(d)  # everything shown was checkpointed

    for what in ("resume", "generate"):
        p = second[what]
        assert p.returncode == 1 and p.stderr.count(b"\n") == 1, (what, p.stderr)
    assert b"in use" in second["resume"].stderr and b"already exists" in second["generate"].stderr

    shutil.copytree(d, work / "sigint-copy", ignore=shutil.ignore_patterns("lock"))  # for the fingerprint test
    p = sw("resume", d, "--no-live", cwd=work)
    assert p.returncode == 0, p.stderr
    assert read_tokens(d) == read_tokens(greedy_ref.dir)
    assert text_of(d) == text_of(greedy_ref.dir)
    assert out1.decode("utf-8") + p.stdout.decode("utf-8") == text_of(greedy_ref.dir)  # resume prints the rest


def test_sigterm_exits_143_and_resumes_to_the_same_sampled_text(work, prompt, sampled_ref):
    d, rc, _, err = interrupted(work, "sigterm", prompt, SAMPLED, signal.SIGTERM)
    assert rc == 143, err
    assert "swiftwrite resume" in err
    p = sw("resume", d, "--quiet", cwd=work)
    assert p.returncode == 0, p.stderr
    assert read_tokens(d) == read_tokens(sampled_ref.dir)
    assert text_of(d) == text_of(sampled_ref.dir)


@pytest.mark.parametrize("moment, kind", [("before-first-checkpoint", "greedy"),
                                          ("between-checkpoints", "greedy"),
                                          ("inside-a-slow-checkpoint", "sampled")])
def test_sigkill_at_any_moment_then_resume_gives_the_uninterrupted_tokens(work, prompt, greedy_ref, sampled_ref, moment, kind):
    ref, args = (greedy_ref, GREEDY) if kind == "greedy" else (sampled_ref, SAMPLED)
    d = work / f"kill-{moment}"
    tmp = work / f"kill-{moment}.proc"
    tmp.mkdir()
    # Each moment is held by a gate the test opens (tests/gates.py), never reached by timing: the run's stdout is a
    # pipe the test fills (its next write of text waits), and its checkpoints can wait inside their window.
    with Holds(tmp / "holds") as holds, FullPipe() as pipe:
        bg = Background(tmp, ["generate", prompt, "--run-dir", d, "--tokens", T, "--chunk", CHUNK, *args, "--draft",
                              "all", "--quiet"], env=clean_env(**holds.env()), stdout=pipe.w)
        rng = random.Random(f"{KILL_SEED}-{moment}")
        if moment == "before-first-checkpoint":
            pipe.fill()  # before any text: the first step's write waits, and every checkpoint comes after a write
            wait_for(lambda: (d / "meta.json").exists(), bg.proc)
            time.sleep(rng.uniform(0.0, 0.3))  # where the kill lands in that stretch; the gate keeps it before
            assert state_tokens(d) < CHUNK
        elif moment == "between-checkpoints":
            killed_between_checkpoints(d, bg, holds, pipe, CHUNK)
            time.sleep(rng.uniform(0.0, 0.3))  # where the kill lands between them; the full pipe keeps it there
        else:  # the second checkpoint's state.json.tmp is written and fsynced, the rename has not happened
            assert holds.next(bg.proc), "the run ended before its first checkpoint"
            holds.release()
            assert holds.next(bg.proc), "the run ended before its second checkpoint"
        bg.proc.kill()
        rc, _, err = bg.finish()
    assert rc == -signal.SIGKILL, err
    assert (d / "lock").exists()  # left by the dead process: a stale lock the resume must take over
    p = sw("resume", d, "--no-live", cwd=work)
    assert p.returncode == 0, p.stderr
    assert read_tokens(d) == read_tokens(ref.dir)
    assert text_of(d) == text_of(ref.dir)


def test_resume_with_tokens_extends_a_finished_run(work, prompt, greedy_ref):
    short = work / "extend"
    p = sw("generate", prompt, "--run-dir", short, "--tokens", T // 2, "--chunk", CHUNK, *GREEDY, "--draft", "all",
           "--quiet", cwd=work)
    assert p.returncode == 0, p.stderr
    p = sw("resume", short, "--tokens", T, "--quiet", cwd=work)
    assert p.returncode == 0, p.stderr
    assert read_tokens(short) == read_tokens(greedy_ref.dir)
    assert text_of(short) == text_of(greedy_ref.dir)


def test_resume_of_a_finished_run_says_it_is_complete(work, greedy_ref):
    before = read_tokens(greedy_ref.dir)
    p = sw("resume", greedy_ref.dir, cwd=work, timeout=60)
    assert p.returncode == 0 and p.stdout == b""
    assert b"already complete" in p.stderr
    assert read_tokens(greedy_ref.dir) == before


def test_resume_with_another_model_is_refused_without_force(work, greedy_ref):
    d = work / "sigint-copy"
    if not d.exists():
        pytest.skip("needs the interrupted run of the SIGINT test")
    meta = json.loads((d / "meta.json").read_text())
    meta["fingerprint"] = "0123456789abcdef"
    (d / "meta.json").write_text(json.dumps(meta))
    before = read_tokens(d)
    p = sw("resume", d, cwd=work, timeout=60)
    assert p.returncode == 1
    err = p.stderr.decode()
    assert err.count("\n") == 1 and "another model" in err and "--force" in err
    assert read_tokens(d) == before
    p = sw("resume", d, "--force", "--quiet", cwd=work)
    assert p.returncode == 0, p.stderr
    assert read_tokens(d) == read_tokens(greedy_ref.dir)  # same weights in truth, so the same text


def test_an_existing_run_directory_is_never_overwritten(work, prompt, greedy_ref):
    snapshot = {f.name: f.read_bytes() for f in greedy_ref.dir.iterdir() if f.name != "lock"}
    p = sw("generate", prompt, "--run-dir", greedy_ref.dir, "--tokens", 4, "--draft", "none", cwd=work, timeout=60)
    assert p.returncode == 1 and b"already exists" in p.stderr
    assert {f.name: f.read_bytes() for f in greedy_ref.dir.iterdir() if f.name != "lock"} == snapshot


# ---------------------------------------------------------------------------------------------------------
# text across a checkpoint


def test_a_character_cut_by_a_checkpoint_is_completed_after_resume(default_model_dir):
    """A checkpoint can fall between the tokens of one character (an emoji, CJK). Those tokens are in
    tokens.bin but not in output.txt; the resumed stream must pick them up, or the character is lost."""
    from transformers import AutoTokenizer

    from swiftwrite.io.prompt import TextStream

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    history = tok("The keeper wrote:", add_special_tokens=False)["input_ids"]
    ids = tok(" 灯台守は🌊🐚を見た。 Done.", add_special_tokens=False)["input_ids"]
    whole = TextStream(tok, history)
    expected = "".join(whole.push([t]) for t in ids) + whole.flush()
    assert "🌊" in expected
    cut_mid_character = 0
    for k in range(1, len(ids)):
        first = TextStream(tok, history)
        text = "".join(first.push([t]) for t in ids[:k])
        pending = len(first.pending)
        cut_mid_character += pending > 0
        second = TextStream(tok, history + ids[:k], pending=pending)
        text += "".join(second.push([t]) for t in ids[k:]) + second.flush()
        assert text == expected, k
    assert cut_mid_character, "the sample text should have characters spanning several tokens"


# ---------------------------------------------------------------------------------------------------------
# a source document


def test_a_source_document_goes_in_the_prompt_and_drafting_and_resume_keep_the_text(work):
    """--source with the revise template: the draft is in the run's prompt; drafting over it (the n-gram table
    and the recycling matrix see the draft) writes exactly what plain decoding writes; and a run resumed past
    its first target continues with the same tokens (the resumed run counts the penalties from the same
    position, after the prompt)."""
    # the shipped draft's opening (its first three paragraphs): the whole of it (~1,300 tokens) prefilled three times
    # on one thread was most of this test's minute, and the property does not depend on the length
    shipped = (Path(__file__).resolve().parent.parent / "prompts" / "grid-draft.md").read_text(encoding="utf-8")
    draft = work / "grid-draft-opening.md"
    draft.write_text("\n\n".join(shipped.split("\n\n")[:5]) + "\n", encoding="utf-8")
    brief = work / "revise.txt"
    brief.write_text("Light edits only.\n")
    args = ["--template", "revise", "--source", draft, *GREEDY]
    plain = generate(work, "revise-none", brief, *args, "--draft", "none", "--quiet")
    prompt_text = (plain.dir / "prompt.txt").read_text(encoding="utf-8")
    assert draft.read_text(encoding="utf-8").strip() in prompt_text and "Light edits only." in prompt_text
    d = work / "revise-all"  # drafted, stopped at half the tokens, resumed to all of them
    p = sw("generate", brief, "--run-dir", d, "--tokens", T // 2, "--chunk", CHUNK, *args, "--draft", "all",
           "--budget", "8", "--quiet", cwd=work)
    assert p.returncode == 0, p.stderr
    p = sw("resume", d, "--tokens", T, "--quiet", cwd=work)
    assert p.returncode == 0, p.stderr
    assert read_tokens(d) == read_tokens(plain.dir)
