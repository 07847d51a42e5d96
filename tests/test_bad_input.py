"""The bad-input battery: every option given nonsense, prompts, YAML, models and run directories that are
wrong. Each case must exit non-zero (2 for a usage error, 1 for anything else), print exactly one readable
line on stderr and no traceback, and leave nothing behind that looks like a run.

Almost every case is refused before the model is loaded, so the battery runs in seconds; the few that need
a real tokenizer or transformers (a truncated weight file, a garbage .gguf) say so in their id.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swiftwrite.models import store
from swiftwrite.base.config import Config
from swiftwrite.io.rundir import RunDir

HAS_CUDA = torch.cuda.is_available()
NUMERIC_BAD = [  # (option, value): every numeric option given a non-number, a negative and an out-of-range value
    ("tokens", "abc"), ("tokens", "0"), ("tokens", "-5"), ("tokens", "1.5"), ("tokens", "99999999999"),
    ("temperature", "abc"), ("temperature", "-1"), ("temperature", "inf"),
    ("top-p", "abc"), ("top-p", "1.5"), ("top-p", "0"), ("top-p", "-0.5"),
    ("min-p", "abc"), ("min-p", "-0.1"), ("min-p", "2"),
    ("top-k", "abc"), ("top-k", "-1"),
    ("penalty", "abc"), ("penalty", "0.5"), ("penalty", "-2"),
    ("penalty-window", "abc"), ("penalty-window", "-1"),
    ("chunk", "abc"), ("chunk", "0"), ("chunk", "-8"),
    ("budget", "abc"), ("budget", "0"), ("budget", "-4"),
    ("context", "abc"), ("context", "-1"),
    ("threads", "abc"), ("threads", "-1"), ("threads", "4096"),  # 4096: more than this machine's cores
    ("seed", "abc"), ("seed", "-1"), ("seed", "1.5"),
    ("draft-kv-budget", "abc"), ("draft-kv-budget", "16"), ("draft-kv-budget", "-1"),  # 16: no room past the sinks
    ("dry-multiplier", "-1"), ("dry-base", "0.5"), ("dry-allowed-length", "0"), ("dry-window", "-1"),
    ("stop-on-loop", "8"),  # under the loop tracker's floor of 16
]
NAMES_BAD = [("draft", "everything"), ("template", "poem"), ("device", "tpu"), ("dtype", "int4"), ("head-mode", "sideways"),
             ("attention", "cuda-magic"), ("weights", "int3"), ("weights", "float32"), ("backend", "vulkan"),
             ("dry-breakers", ""), ("dry-breakers", "\\n,")]  # an empty breaker: nothing, or after the last comma

# (id, argv, expected exit status, stdin). {placeholders} are paths from the `world` fixture; {run} is a fresh
# path per case that must not exist afterwards. Every generate gets --draft none and a tiny --tokens.
GEN = ["generate", "{prompt}", "--run-dir", "{run}", "--draft", "none", "--tokens", "4"]
CASES = [
    *[(f"--{o}={v}", [*GEN, f"--{o}={v}"], 2, None) for o, v in NUMERIC_BAD],
    *[(f"--{o}={v}", [*GEN, f"--{o}", v], 2, None) for o, v in NAMES_BAD],
    ("missing-option-value", ["generate", "{prompt}", "--run-dir", "{run}", "--tokens"], 2, None),
    ("unknown-option", [*GEN, "--speed", "fast"], 2, None),
    ("context-smaller-than-the-prompt", [*GEN, "--context", "16"], 1, None),
    ("heads-two-pass-kv-budget-below-sinks", [*GEN[:-4], "--draft", "heads", "--head-mode", "two-pass",
                                              "--draft-kv-budget", "8", "--tokens", "4"], 2, None),
    ("no-prompt-argument", ["generate"], 2, None),
    ("unknown-command", ["write", "{prompt}"], 2, None),
    ("env-wrong-type", [*GEN[:-2], "SWIFTWRITE_TEMPERATURE=hot"], 2, None),
    ("env-out-of-range", [*GEN[:-2], "SWIFTWRITE_TOP_P=7"], 2, None),
    ("env-dry-base-below-1", [*GEN, "SWIFTWRITE_DRY_BASE=0.5"], 2, None),
    ("env-stop-on-loop-under-16", [*GEN, "SWIFTWRITE_STOP_ON_LOOP=8"], 2, None),
    ("env-dry-breakers-empty-one", [*GEN, "SWIFTWRITE_DRY_BREAKERS=\\n,"], 2, None),
    # prompts
    ("prompt-missing", [*GEN[:1], "{tmp}/no-such-prompt.txt", *GEN[2:]], 1, None),
    ("prompt-empty", [*GEN[:1], "{empty}", *GEN[2:]], 1, None),
    ("prompt-whitespace-only", [*GEN[:1], "{blank}", *GEN[2:]], 1, None),
    ("prompt-binary", [*GEN[:1], "{binary}", *GEN[2:]], 1, None),
    ("prompt-not-utf8", [*GEN[:1], "{latin1}", *GEN[2:]], 1, None),
    ("prompt-directory", [*GEN[:1], "{tmp}", *GEN[2:]], 1, None),
    ("prompt-over-1MB", [*GEN[:1], "{huge}", *GEN[2:]], 1, None),
    ("stdin-empty", [*GEN[:1], "-", *GEN[2:]], 1, b""),
    ("stdin-binary", [*GEN[:1], "-", *GEN[2:]], 1, b"\x7fELF\x00\x00\x01"),
    # --source: the document a run draws on
    ("source-missing", [*GEN, "--source", "{tmp}/no-such-source.md"], 1, None),
    ("source-empty", [*GEN, "--source", "{blank}"], 1, None),
    ("source-binary", [*GEN, "--source", "{binary}"], 1, None),
    ("source-not-utf8", [*GEN, "--source", "{latin1}"], 1, None),
    ("source-directory", [*GEN, "--source", "{tmp}"], 1, None),
    ("source-over-1MB", [*GEN, "--source", "{huge}"], 1, None),
    ("source-stdin", [*GEN, "--source", "-"], 1, None),
    ("revise-without-a-source", [*GEN, "--template", "revise"], 2, None),
    # YAML
    ("yaml-malformed", [*GEN, "--config", "{yaml_malformed}"], 2, None),
    ("yaml-a-list", [*GEN, "--config", "{yaml_list}"], 2, None),
    ("yaml-wrong-type", [*GEN, "--config", "{yaml_wrong_type}"], 2, None),
    ("yaml-unknown-key", [*GEN, "--config", "{yaml_unknown}"], 2, None),
    ("yaml-out-of-range", [*GEN, "--config", "{yaml_range}"], 2, None),
    ("yaml-dry-multiplier-negative", [*GEN, "--config", "{yaml_dry}"], 2, None),
    ("yaml-stop-on-loop-under-16", [*GEN, "--config", "{yaml_loop}"], 2, None),
    ("yaml-dry-breakers-empty-one", [*GEN, "--config", "{yaml_breakers}"], 2, None),
    ("yaml-missing-file", [*GEN, "--config", "{tmp}/absent.yaml"], 2, None),
    ("yaml-directory", [*GEN, "--config", "{tmp}"], 2, None),
    # models
    ("model-unknown-alias", [*GEN, "--model", "gpt-17"], 1, None),
    ("model-missing-path", [*GEN, "--model", "{tmp}/no-such-model"], 1, None),
    ("model-missing-hub-id", [*GEN, "--model", "nobody/no-such-model"], 1, None),
    ("model-dir-without-config", [*GEN, "--model", "{model_noconfig}"], 1, None),
    ("model-dir-corrupt-config", [*GEN, "--model", "{model_badjson}"], 1, None),
    ("model-dir-config-not-a-model", [*GEN, "--model", "{model_notmodel}"], 1, None),
    ("model-dir-fallback-arch-without-weights", [*GEN, "--model", "{model_gpt2}"], 1, None),
    ("model-dir-no-tokenizer [loads transformers]", [*GEN, "--model", "{model_notok}"], 1, None),
    ("model-dir-truncated-safetensors [loads tokenizer]", [*GEN, "--model", "{model_truncated}"], 1, None),
    ("model-gguf-garbage", [*GEN, "--model", "{gguf}"], 1, None),
    ("model-gguf-missing", [*GEN, "--model", "{tmp}/absent.gguf"], 1, None),
    ("backend-ggml-safetensors-model", [*GEN, "--model", "{model_truncated}", "--backend", "ggml"], 1, None),
    ("backend-ggml-with-tp", [*GEN, "--backend", "ggml", "--tp", "2"], 2, None),
    ("backend-ggml-with-int4", [*GEN, "--backend", "ggml", "--weights", "int4"], 1, None),
    ("backend-ggml-with-heads", [*GEN[:-4], "--backend", "ggml", "--draft", "heads", "--tokens", "4"], 1, None),
    ("weights-int4-layer-the-kernel-cannot-pack", [*GEN, "--model", "{model_int4_unpackable}", "--weights", "int4"], 1, None),
    ("models-pull-unknown", ["models", "pull", "gpt-17"], 1, None),
    # bench: refused before any long work
    ("bench-unknown-method", ["bench", "--methods", "none,warp9"], 2, None),
    ("bench-zero-repeats", ["bench", "--methods", "none", "--repeats", "0"], 2, None),
    ("bench-missing-prompt", ["bench", "--methods", "none", "--prompts", "no-such-prompt.txt"], 2, None),
    ("bench-unknown-workload", ["bench", "--methods", "none", "--prompts", "creative,poetry"], 2, None),
    ("bench-out-under-a-file", ["bench", "--methods", "none", "--out", "{binary}/results"], 1, None),
    ("bench-tokens-past-the-window [loads the model]", ["bench", "--methods", "none", "--tokens", "9000"], 2, None),
    # outlines: refused before the model is opened
    ("outline-without-headings", [*GEN, "--outline", "{outline_none}"], 2, None),
    ("outline-empty", [*GEN, "--outline", "{empty}"], 2, None),
    ("outline-budgets-over-tokens", [*GEN[:-2], "--tokens", "100", "--outline", "{outline_over}"], 2, None),
    ("outline-budgets-leave-nothing-to-share", [*GEN[:-2], "--tokens", "200", "--outline", "{outline_over}"], 2, None),
    ("outline-budget-zero", [*GEN[:-2], "--tokens", "100", "--outline", "{outline_zero}"], 2, None),
    ("outline-budget-negative", [*GEN[:-2], "--tokens", "100", "--outline", "{outline_negative}"], 2, None),
    ("outline-missing-file", [*GEN, "--outline", "{tmp}/no-such-outline.md"], 2, None),
    ("outline-a-directory", [*GEN, "--outline", "{tmp}"], 2, None),
    ("outline-not-utf8", [*GEN, "--outline", "{latin1}"], 2, None),
    ("outline-binary", [*GEN, "--outline", "{binary}"], 2, None),
    ("outline-with-plan", [*GEN, "--outline", "{outline_ok}", "--plan"], 2, None),
    ("outline-with-plan-only", [*GEN, "--outline", "{outline_ok}", "--plan-only"], 2, None),
    ("env-outline-with-plan", [*GEN, "--plan", "SWIFTWRITE_OUTLINE={outline_ok}"], 2, None),
    ("yaml-outline-without-headings", [*GEN, "--config", "{yaml_outline}"], 2, None),
    ("sections-without-plan", [*GEN, "--sections", "3"], 2, None),
    ("sections-negative", [*GEN, "--plan", "--sections", "-1"], 2, None),
    ("sections-too-many-for-tokens", [*GEN, "--plan", "--sections", "9"], 2, None),
    # memory and lore (run/memory.py): files refused before the model is opened, room against the context after
    ("memory-missing", [*GEN, "--memory", "{tmp}/no-such-memory.md"], 1, None),
    ("memory-empty", [*GEN, "--memory", "{blank}"], 1, None),
    ("memory-binary", [*GEN, "--memory", "{binary}"], 1, None),
    ("lore-missing", [*GEN, "--lore", "{tmp}/no-such-lore.md"], 1, None),
    ("lore-empty", [*GEN, "--lore", "{empty}"], 1, None),
    ("lore-binary", [*GEN, "--lore", "{binary}"], 1, None),
    ("lore-without-keys", [*GEN, "--lore", "{lore_nokeys}"], 1, None),
    ("lore-key-longer-than-the-context [loads tokenizer]", [*GEN[:-2], "--tokens", "400", "--context", "128",
                                                            "--lore", "{lore_longkey}"], 1, None),
    ("memory-and-brief-past-the-context [loads tokenizer]", [*GEN[:-2], "--tokens", "400", "--context", "160",
                                                             "--memory", "{memory_long}"], 1, None),
    ("recall-unknown", [*GEN, "--recall", "everything"], 2, None),
    ("lore-budget-under-16", [*GEN, "--lore-budget", "4"], 2, None),
    ("resume-memory-on-a-run-without-one", ["resume", "{good_run}", "--tokens", "8", "--memory", "{prompt}"], 1, None),
    ("resume-memory-on-a-batch", ["resume", "{batch_like}", "--memory", "{prompt}"], 2, None),
    # outputs and run directories
    ("out-into-missing-dir", [*GEN, "--out", "{tmp}/no/such/dir/out.txt"], 1, None),
    ("out-is-a-directory", [*GEN, "--out", "{tmp}"], 1, None),
    ("stats-json-into-missing-dir", [*GEN, "--stats-json", "{tmp}/no/such/stats.json"], 1, None),
    ("run-dir-is-an-existing-run", [*GEN[:3], "{good_run}", *GEN[4:]], 1, None),
    ("run-dir-is-a-file", [*GEN[:3], "{prompt}", *GEN[4:]], 1, None),
    ("run-dir-under-a-file", [*GEN[:3], "{prompt}/run", *GEN[4:]], 1, None),
    pytest.param("device-cuda-without-gpu", [*GEN, "--device", "cuda"], 1, None,
                 marks=pytest.mark.skipif(HAS_CUDA, reason="a GPU is present")),
    # resume
    ("resume-missing-path", ["resume", "{tmp}/no-such-run"], 1, None),
    ("resume-a-file", ["resume", "{prompt}"], 1, None),
    ("resume-an-empty-dir", ["resume", "{empty_dir}"], 1, None),
    ("resume-garbage-meta", ["resume", "{run_garbage_meta}"], 1, None),
    ("resume-truncated-tokens", ["resume", "{run_truncated_tokens}"], 1, None),
    ("resume-flipped-tokens", ["resume", "{run_flipped_tokens}"], 1, None),
    ("resume-both-states-garbage", ["resume", "{run_bad_state}"], 1, None),
    ("resume-damaged-config", ["resume", "{run_bad_config}"], 1, None),
    ("resume-tokens-abc", ["resume", "{good_run}", "--tokens", "abc"], 2, None),
    ("resume-tokens-zero", ["resume", "{good_run}", "--tokens", "0"], 2, None),
    ("resume-threads-above-the-cores", ["resume", "{good_run}", "--threads", "4096"], 2, None),
    ("resume-tokens-below-written", ["resume", "{good_run}", "--tokens", "2"], 2, None),
    ("resume-out-into-missing-dir", ["resume", "{good_run}", "--out", "{tmp}/no/such/out.txt"], 1, None),
]


def _ids(case) -> str:
    return case.values[0] if hasattr(case, "values") else case[0]


def make_run(path: Path, n_tokens: int = 6) -> Path:
    """A small valid run directory, written through the real RunDir (no model needed)."""
    with RunDir.create(path, Config(tokens=n_tokens, draft="none").to_dict(), "a brief", [1, 2, 3], "fingerprint0") as rd:
        rd.append(list(range(10, 10 + n_tokens)), "x" * n_tokens)
        rd.checkpoint({"target": n_tokens}, finished=True)
    (path / "lock").unlink()
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    t = tmp_path_factory.mktemp("bad-input")
    w = {"tmp": t}

    def file(name, data: bytes) -> Path:
        (t / name).write_bytes(data)
        w[name.split(".")[0]] = t / name
        return t / name

    file("prompt.txt", b"Write one sentence about rain.\n")
    file("empty.txt", b"")
    file("blank.txt", b"  \n\t\n   ")
    file("binary.txt", b"Write about \x00\x01\x02 rain")
    file("latin1.txt", "Écris une phrase sur la pluie, café.".encode("latin-1"))
    file("huge.txt", b"word " * ((1 << 20) // 5 + 1))
    file("yaml_malformed.yaml", b"tokens: [4\ndraft: none\n")
    file("yaml_list.yaml", b"- tokens\n- 4\n")
    file("yaml_wrong_type.yaml", b"tokens: many\n")
    file("yaml_unknown.yaml", b"tokens: 4\nspeed: fast\n")
    file("yaml_range.yaml", b"top_p: 3\n")
    file("yaml_dry.yaml", b"dry_multiplier: -1\n")
    file("yaml_loop.yaml", b"stop_on_loop: 8\n")
    file("yaml_breakers.yaml", b"dry_breakers: '\\n,'\n")
    file("gguf.gguf", b"GGUF" + os.urandom(4096))
    file("outline_none.md", b"An outline in prose: first the storm, then the bottle.\n")
    file("outline_over.md", b"## The storm {tokens: 120}\n## The bottle {tokens: 80}\n## The reply\n")
    file("outline_zero.md", b"## The storm {tokens: 0}\n## The bottle\n")
    file("outline_negative.md", b"## The storm {tokens: -50}\n## The bottle\n")
    file("outline_ok.md", b"## The storm\n## The bottle\n")
    file("yaml_outline.yaml", f"outline: {t / 'outline_none.md'}\n".encode())
    file("lore_nokeys.md", b"## Mara\nThe keeper.\n")
    file("lore_longkey.md", ("## Mara {keys: " + "lighthouse keeper " * 80 + "}\nThe keeper.\n").encode())
    file("memory_long.md", b"The keeper Mara keeps the light on the island; her brother drowned. " * 12)
    (t / "batch_like").mkdir()
    (t / "batch_like" / "manifest.json").write_text("{}")
    w["batch_like"] = t / "batch_like"

    def model_dir(name, files: dict[str, bytes]) -> Path:
        d = t / name
        d.mkdir()
        for f, data in files.items():
            (d / f).write_bytes(data)
        w[name] = d
        return d

    real = Path(default_model_dir)
    config = (real / "config.json").read_bytes()
    tokenizer = {f.name: f.read_bytes() for f in real.iterdir() if f.name.startswith(("tokenizer", "chat_template"))}
    with open(real / "model.safetensors", "rb") as fh:
        head = fh.read(200_000)  # header and the start of the first tensor, nothing more
    model_dir("model_noconfig", {"model.safetensors": head})
    model_dir("model_badjson", {"config.json": b'{"model_type": "llama", "vocab_size": ', "model.safetensors": head})
    model_dir("model_notmodel", {"config.json": b'["llama"]', "model.safetensors": head})
    model_dir("model_gpt2", {"config.json": b'{"model_type": "gpt2", "vocab_size": 10, "hidden_size": 8, '
                                            b'"intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}'})
    model_dir("model_notok", {"config.json": config, "model.safetensors": head})
    model_dir("model_truncated", {"config.json": config, "model.safetensors": head, **tokenizer})
    odd = {**json.loads(config), "intermediate_size": 1540}  # K = 1540 inputs of the down projection: not a multiple of 32
    model_dir("model_int4_unpackable", {"config.json": json.dumps(odd).encode(), "model.safetensors": head, **tokenizer})

    (t / "empty_dir").mkdir()
    w["empty_dir"] = t / "empty_dir"
    w["good_run"] = make_run(t / "good_run")
    g = make_run(t / "run_garbage_meta")
    (g / "meta.json").write_bytes(b"\x00garbage{")
    w["run_garbage_meta"] = g
    g = make_run(t / "run_truncated_tokens")
    with open(g / "tokens.bin", "r+b") as fh:
        fh.truncate(10)
    w["run_truncated_tokens"] = g
    g = make_run(t / "run_flipped_tokens")
    data = bytearray((g / "tokens.bin").read_bytes())
    data[5] ^= 0xFF
    (g / "tokens.bin").write_bytes(bytes(data))
    w["run_flipped_tokens"] = g
    g = make_run(t / "run_bad_state")
    (g / "state.json").write_text("{")
    (g / "state.prev.json").write_text("[]")
    w["run_bad_state"] = g
    g = make_run(t / "run_bad_config")
    (g / "config.yaml").write_text("tokens: 6\ntemperature: warm\n")
    w["run_bad_config"] = g
    return w


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (lock files aside: taking a lock is not a change) and a hash of its bytes."""
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.name != "lock":
            out[str(f.relative_to(root))] = hashlib.sha256(f.read_bytes()).hexdigest()
        elif f.is_dir():
            out[str(f.relative_to(root)) + "/"] = ""
    return out


@pytest.mark.parametrize("case_id, argv, code, stdin", CASES, ids=[_ids(c) for c in CASES])
def test_bad_input_fails_with_one_sentence_and_leaves_nothing(world, tmp_path, case_id, argv, code, stdin):
    run = tmp_path / "run"
    paths = {k: str(v) for k, v in world.items()} | {"run": str(run)}
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # no case reaches the internet: a Hub name not here is refused offline
    args = []
    for a in argv:
        if "=" in a and a.split("=")[0].startswith("SWIFTWRITE_"):
            env[a.split("=")[0]] = a.split("=", 1)[1].format(**paths)
        else:
            args.append(a.format(**paths))
    models = store.home() / "models"
    before_world, before_models = snapshot(world["tmp"]), sorted(p.name for p in models.iterdir()) if models.is_dir() else []

    proc = subprocess.run([sys.executable, "-m", "swiftwrite.cli", *args], input=stdin or b"", capture_output=True,
                          cwd=tmp_path, env=env, timeout=120)

    err = proc.stderr.decode("utf-8", errors="replace")
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}; stderr: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert "Traceback" not in err and lines[0].startswith("swiftwrite: ") and len(lines[0]) < 400, err
    assert len(lines[0].split()) >= 4, err  # a sentence, not a bare exception name
    assert proc.stdout == b"", "nothing goes to standard output when nothing was written"
    # nothing behind that looks valid: no new run, no file in the fixtures touched, no half-imported model
    assert not run.exists(), f"{run} was created"
    assert not list(tmp_path.rglob("meta.json")), "a run directory was created"
    assert snapshot(world["tmp"]) == before_world, "the fixtures were modified"
    assert (sorted(p.name for p in models.iterdir()) if models.is_dir() else []) == before_models


def test_the_battery_is_big_enough():
    assert len(CASES) >= 40


# ---------------------------------------------------------------------------------------------------------
# Asked for what this machine cannot do, where a fallback exists: a notice, the fallback, the same text.


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present: these requests would be honoured")
def test_gpu_requests_on_a_cpu_fall_back_with_a_notice_and_the_same_text(world, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a user's CPU: no interpreter

    def gen(name, *extra):
        run = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "swiftwrite.cli", "generate", world["prompt"], "--run-dir", str(run),
                               "--draft", "all", "--budget", "4", "--tokens", "24", "--temperature", "0", "--no-live", *extra],
                              capture_output=True, cwd=tmp_path, env=env, timeout=300)
        err = proc.stderr.decode()
        assert proc.returncode == 0 and "Traceback" not in err, err
        return proc.stdout, err

    plain, _ = gen("plain")
    asked, err = gen("asked", "--dtype", "float16", "--attention", "triton", "--cuda-graphs")
    assert asked == plain
    assert "--dtype float16" in err and "using float32" in err
    assert "--attention triton" in err and "needs a CUDA GPU" in err and "using torch attention" in err
    assert "--cuda-graphs" in err and "running without graphs" in err
    _, err = gen("flash", "--attention", "flash")
    assert "--attention flash: it needs a CUDA GPU" in err


def test_device_and_dtype_choices(monkeypatch):
    """auto is bfloat16 on a GPU that has it and float32 elsewhere (README "Half precision"); a half dtype needs no
    warning about
    drafting (exact.py makes it exact against its own plain decoding, or the run drafts nothing and says why); a
    pre-Ampere GPU asked for bfloat16 gets float16, a CPU asked for float16 gets float32, each with a notice.
    torch.cuda is asked, not used, so this runs anywhere."""
    from swiftwrite.run.devices import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    said = []
    assert pick_device("auto", "auto", said.append) == ("cuda", torch.float32) and said == []
    assert pick_device("auto", "bfloat16", said.append) == ("cuda", torch.float16)
    assert said == ["--dtype bfloat16: Tesla T4 cannot compute in bfloat16; using float16."]
    said.clear()
    assert pick_device("cpu", "float16", said.append) == ("cpu", torch.float32)
    assert len(said) == 1 and "using float32" in said[0]
    said.clear()
    assert pick_device("cpu", "bfloat16", said.append) == ("cpu", torch.bfloat16)
    assert said == []
    assert pick_device("cpu", "auto", said.append) == ("cpu", torch.float32)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert pick_device("auto", "auto", said.append) == ("cuda", torch.bfloat16) and said == []
    assert pick_device("cpu", "auto", said.append) == ("cpu", torch.float32)
    assert pick_device("auto", "float32", said.append) == ("cuda", torch.float32)


def test_quantized_weights_are_refused_where_they_cannot_run(tmp_path):
    """--weights int8/int4 needs the lean forward, the CPU and torch's kernels; anywhere else one sentence says
    what to use instead (the text of a float run would not be the quantized one, so there is no silent switch)."""
    from types import SimpleNamespace

    from swiftwrite.tensors import quant
    from swiftwrite.run.devices import pick_weights
    from swiftwrite.base.errors import UserError
    from swiftwrite.models.model import ModelConfig, read_hf_config
    from tiny import tiny_hf_model

    path, _ = tiny_hf_model("llama", out_dir=tmp_path / "m")
    mcfg = ModelConfig.from_hf(read_hf_config(path))
    assert pick_weights("auto", "cuda", mcfg, False) == "float"  # auto: float everywhere
    assert pick_weights("int4", "cpu", mcfg, True) == "int4"
    with pytest.raises(UserError, match="CPU kernels only; use --device cpu"):
        pick_weights("int8", "cuda", mcfg, True)
    with pytest.raises(UserError, match="needs the lean forward.*use --weights float"):
        pick_weights("int4", "cpu", mcfg, False)
    old_torch = SimpleNamespace(_weight_int8pack_mm=None)  # int8's kernel, not int4's
    assert quant.kernel_missing("int8", old_torch) is None
    assert "_convert_weight_to_int4pack_for_cpu" in quant.kernel_missing("int4", old_torch)
    assert quant.kernel_missing("int4") is None  # this torch has both


def test_attention_choices_say_why_they_fall_back(monkeypatch):
    from swiftwrite.tensors.attention import attention_plan

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert attention_plan("auto", "cpu", torch.float32) == (False, False, [])
    assert attention_plan("torch", "cpu", torch.float32) == (False, False, [])
    tree, flash, notes = attention_plan("triton", "cpu", torch.float32)
    assert (tree, flash) == (False, False) and len(notes) == 1 and "using torch attention" in notes[0]
    tree, flash, notes = attention_plan("flash", "cpu", torch.bfloat16)
    assert (tree, flash) == (False, False) and notes == [
        "--attention flash: it needs a CUDA GPU; using torch attention for prefill and single steps."]
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the tests' way of running the kernel on a CPU
    pytest.importorskip("triton")
    assert attention_plan("triton", "cpu", torch.float32) == (True, False, [])
    assert attention_plan("auto", "cpu", torch.float32) == (False, False, [])  # auto never picks the interpreter


# ---------------------------------------------------------------------------------------------------------
# Memory: weights and KV cache are checked against what is free before any weight is read.


class Said:
    def __init__(self):
        self.lines = []

    def info(self, msg):
        self.lines.append(msg)


def test_float32_weights_that_do_not_fit_fall_back_to_bfloat16_and_the_run_records_it(monkeypatch, tmp_path):
    """`--dtype auto` is float32 unless its weights do not fit while half-size ones do (an 8B model on a 24 GB
    GPU); then bfloat16, said as such. An explicit float32 that does not fit is refused with what to do."""
    from swiftwrite.run import devices, assembly
    from tiny import tiny_hf_model

    path, _ = tiny_hf_model("llama", out_dir=tmp_path / "m")
    (path / "tokenizer.json").write_text("")  # not read: open_model is stopped before the tokenizer
    mcfg_bytes = {}

    def stop(ref, mcfg, device, dtype, attention, graphs, **choices):
        mcfg_bytes["f32"] = devices.weight_bytes(mcfg, torch.float32)
        return assembly.Loaded(ref, None, mcfg, device, dtype, attention=attention, cuda_graphs=graphs, **choices)

    monkeypatch.setattr(assembly, "_loaded", stop)
    said = Said()
    lm = assembly.open_model(Config(model=str(path)), said)
    assert lm.dtype == torch.float32 and said.lines == []
    f32 = mcfg_bytes["f32"]
    monkeypatch.setattr(devices, "_available_memory", lambda: int(f32 * 0.8))  # float32 no, bfloat16 yes
    lm = assembly.open_model(Config(model=str(path)), said)
    assert lm.dtype == torch.bfloat16
    assert len(said.lines) == 1 and "float32 weights" in said.lines[0] and "--dtype float32 to insist" in said.lines[0]
    lm = assembly.open_model(Config(model=str(path), dtype="float32"), Said())
    assert lm.dtype == torch.float32
    with pytest.raises(Exception, match="weights need .* free in RAM; use a smaller model, or --dtype bfloat16"):
        assembly.make_window(Config(), lm, 8, Said())
    monkeypatch.setattr(devices, "_available_memory", lambda: int(f32 * 0.3))  # neither fits: float32, then refused
    lm = assembly.open_model(Config(model=str(path)), Said())
    assert lm.dtype == torch.float32


def test_weights_and_kv_cache_are_checked_against_gpu_memory(monkeypatch, tmp_path):
    """On CUDA the free memory is the GPU's (torch.cuda.mem_get_info); weights already loaded are not counted
    twice. A context asked for that does not fit is refused with one that does; without --context the most that
    fits runs, said in one line. torch.cuda is asked, not used."""
    from swiftwrite.run import devices, assembly, runplan
    from tiny import tiny_hf_model

    path, _ = tiny_hf_model("llama", out_dir=tmp_path / "m", max_position_embeddings=4096)
    monkeypatch.setattr(assembly, "_loaded", lambda ref, mcfg, device, dtype, attention, graphs, **choices:
                        assembly.Loaded(ref, None, mcfg, device, dtype, attention=attention, cuda_graphs=graphs,
                                        **choices))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 << 30, 80 << 30))
    lm = assembly.open_model(Config(model=str(path), device="cuda", attention="torch"), Said())
    assert lm.dtype == torch.bfloat16  # auto, on a GPU that computes in bfloat16
    weights = devices.weight_bytes(lm.mcfg, lm.dtype)
    full = runplan.memory(lm, 4096)
    assert full.weights == weights
    half = weights + runplan.MIN_HEADROOM + (full.kv + full.buffers) // 2  # half the window's cache fits
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (half, 80 << 30))
    with pytest.raises(Exception, match=r"the weights .* and the KV cache .* free on the GPU; use --context \d+ or less"):
        assembly.make_window(Config(context=4096), lm, 8, Said())  # asked for: refused with a number that fits
    said = Said()
    fitted = assembly.make_window(Config(), lm, 8, said).context  # not asked: the most that fits, said
    assert 1024 < fitted < 4096 and len(said.lines) == 1 and "rebuilt every" in said.lines[0]
    lm.model = object()  # loaded: its weights are no longer free memory, and no longer needed
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (half - weights, 80 << 30))
    with pytest.raises(Exception, match=r"^the KV cache .* free on the GPU; use --context"):
        assembly.make_window(Config(context=4096), lm, 8, Said())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 << 30, 80 << 30))
    assert assembly.make_window(Config(), lm, 8, Said()).context == 4096
