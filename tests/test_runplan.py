"""The plan of a run (run/runplan.py): the context that fits, its memory from the backend that holds it, and the
estimate from kept costs. No model is loaded: the plan is made from a model's configuration alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from swiftwrite.base import measurements
from swiftwrite.base.config import Config
from swiftwrite.base.errors import UserError
from swiftwrite.base.modelconfig import ModelConfig
from swiftwrite.decoding.window import Window
from swiftwrite.models import backends, ggmlmodel
from swiftwrite.models.store import ModelRef
from swiftwrite.run import devices, runplan
from swiftwrite.run.records import Loaded

GB = 10**9


def llama31_8b(window: int = 131072) -> ModelConfig:
    """Llama-3.1-8B's shape and window."""
    return ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32,
                       n_heads=32, n_kv_heads=8, head_dim=128, rms_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                       max_positions=window, tie_embeddings=False, attn_bias=False, qk_norm=False)


def opened(mcfg: ModelConfig, backend: str, dtype=torch.float32) -> Loaded:
    return Loaded(ModelRef("llama3-8b", Path("/nowhere"), "fp"), None, mcfg, "cpu", dtype, backend=backend)


@pytest.fixture
def machine(monkeypatch):
    """A 24 GB machine with 22.7 GB free, an 8B Q4_0 GGUF of 4.4 GB."""
    monkeypatch.setattr(runplan, "free_memory", lambda device: int(22.7 * GB))
    monkeypatch.setattr(backends, "file_bytes", lambda name, path: int(4.4 * GB) if name in backends.LLAMA else 0)


def test_llamacpp_figures_are_float16_and_match_its_own_log():
    """llama.cpp's buffers as its log gave them for the default model's shape (2026-12-07)."""
    smol = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30, n_heads=9,
                       n_kv_heads=3, head_dim=64, rms_eps=1e-5, rope_theta=1e5, rope_scaling=None, max_positions=8192,
                       tie_embeddings=True, attn_bias=False, qk_norm=False)
    mib = 1 << 20
    for cells, kv, compute in ((8448, 185.62, 42.85), (33024, 725.62, 162.85)):
        got_kv, buffers = ggmlmodel.memory_bytes(smol, cells - ggmlmodel.MAX_ROWS)
        assert ggmlmodel.context_cells(cells - ggmlmodel.MAX_ROWS) == cells
        assert abs(got_kv / mib - kv) < 0.01
        assert abs(buffers / mib - (compute + 12.0)) < 0.5


def test_the_8b_window_that_does_not_fit_is_shrunk_to_one_that_does(machine):
    """Llama-3.1's 128K window on llama.cpp needs 17.2 GB of float16 cache plus its scores buffer beside 4.4 GB of
    weights: more than 22.7 GB less headroom. The plan picks the largest context that fits and says what it costs."""
    lm = opened(llama31_8b(), "ggml")
    context, mem, note = runplan.fit_context(0, lm, prompt=200)
    room = int(22.7 * GB) - runplan.headroom(int(22.7 * GB))
    assert 64_000 < context < 131_072 and context % 256 == 0
    assert mem.weights + mem.kv + mem.buffers <= room
    bigger = runplan.memory(lm, context + 256)
    assert bigger.weights + bigger.kv + bigger.buffers > room  # the largest that fits
    assert f"{context:,} of the model's 131,072 positions" in note
    assert f"rebuilt every {Window(context, 200).stride:,} tokens" in note
    # the float16 cache, not float32's 32 GB
    full = runplan.memory(lm, 131_072)
    assert 17.0 * GB < full.kv < 17.5 * GB


def test_a_window_that_fits_is_the_model_window(machine):
    lm = opened(llama31_8b(window=8192), "ggml")
    context, mem, note = runplan.fit_context(0, lm, prompt=200)
    assert context == 8192 and note is None
    assert mem.cells_on_disk == mem.kv  # llama.cpp's cells are saved at checkpoints


def test_an_asked_context_that_does_not_fit_is_refused_with_one_that_does(machine):
    lm = opened(llama31_8b(), "ggml")
    with pytest.raises(UserError, match=r"use --context (\d+) or less\.$") as e:
        runplan.fit_context(131_072, lm, prompt=200)
    fits = int(str(e.value).rsplit("--context ", 1)[1].split()[0])
    assert runplan.fit_context(fits, lm, prompt=200)[0] == fits


def test_torch_cache_is_sized_in_the_runs_dtype(machine):
    lm32, lm16 = opened(llama31_8b(8192), "torch"), opened(llama31_8b(8192), "torch", torch.bfloat16)
    assert runplan.memory(lm32, 8192).kv == 2 * runplan.memory(lm16, 8192).kv
    assert runplan.memory(lm16, 8192).weights == devices.weight_bytes(lm16.mcfg, torch.bfloat16)
    assert runplan.memory(lm32, 8192).cells_on_disk == 0


def test_the_contexts_an_estimate_walks_are_the_windows(tmp_path):
    window = Window(300, 40)
    got = runplan._contexts(window, 40, 1000)
    for i in range(40, 1040):
        s, _ = window.span(i)
        assert got[i - 40] == 40 + (i - s)


def test_estimate_adds_the_kept_rate_of_each_tokens_bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path))
    key = runplan.rate_key("fp", "ggml", "float", "float32", 2, "recycling", "auto")
    assert runplan.estimate(key, None, 4096, 100, 1000)[0] is None
    assert runplan.estimate(key, 20.0, 4096, 100, 1000)[0] == pytest.approx(20.0)  # the kept step time alone
    # 10 ms a token in bucket 0, 30 ms in bucket 2 (kept over two runs), prefill 1 ms a token
    runplan.keep_rates(key, {0: 5.0}, {0: 500}, (0.1, 100))
    runplan.keep_rates(key, {0: 5.0, 2: 30.0}, {0: 500, 2: 1000}, (0.0, 0))
    seconds, basis = runplan.estimate(key, None, 4096, 100, 3000)
    lengths = runplan._contexts(Window(4096, 100), 100, 3000)
    per_bucket = {0: 0.01, 1: 0.02, 2: 0.03, 3: 0.04}  # 1 and 3 on the line through 0 and 2
    assert seconds == pytest.approx(sum(per_bucket[int(c) // 1024] for c in lengths) + 100 * 0.001, rel=1e-6)
    assert "1,500 tokens in 2 context buckets" in basis  # bucket 0: the second run's 500 tokens replace the first's


def test_one_run_on_a_faster_machine_corrects_the_estimate_of_every_context(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path))
    key = "m/ggml/gguf/float32/2t/x/all/auto"
    for _ in range(3):  # a busy machine: 40 ms a token at short contexts, 120 ms past 2K
        runplan.keep_rates(key, {0: 20.0, 2: 60.0}, {0: 500, 2: 500}, (0.4, 100))
    runplan.keep_rates(key, {0: 5.0}, {0: 500}, (0.1, 100))  # then one short run on a quiet one: 4x faster
    seconds, _ = runplan.estimate(key, None, 4096, 100, 3000)
    lengths = runplan._contexts(Window(4096, 100), 100, 3000)
    per_bucket = {0: 0.01, 1: 0.02, 2: 0.03, 3: 0.04}  # every bucket at the quiet machine's speed
    assert seconds == pytest.approx(sum(per_bucket[int(c) // 1024] for c in lengths) + 100 * 0.001, rel=1e-6)


def test_the_plan_says_every_choice_and_fits_the_8b(machine, tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path))
    lm = opened(llama31_8b(), "auto")
    plan = runplan.make(Config(tokens=100_000), lm, prompt=200)
    assert plan.backend == "auto" and plan.context < 131_072
    d = plan.to_dict()
    assert d["memory"]["total"] == plan.memory.total and d["rebuild_every"] == plan.rebuild_every
    assert {"context", "backend", "time"} <= set(d["notes"])
    rows = dict((what, value) for what, value, _ in plan.rows())
    assert rows["drafting"] == "recycling, ngram" and "no trained heads match" in d["notes"]["drafting"]
    assert rows["time"] == "unknown"
    assert np.isfinite(plan.memory.total)


def test_a_resume_says_each_choice_it_makes_otherwise(machine, tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path))
    now = runplan.make(Config(), opened(llama31_8b(8192), "ggml"), prompt=100).to_dict()
    assert runplan.differences(dict(now), now) == []
    written = {**now, "backend": "torch", "dtype": "bfloat16", "threads_now": 7}
    assert runplan.differences(written, now) == [
        "resumed with the backend ggml where the run was written with torch.",
        "resumed with the dtype float32 where the run was written with bfloat16."]


def test_the_plan_as_run_is_what_the_stats_resolve_and_says_why_drafting_is_off(machine, tmp_path, monkeypatch):
    """Once the engine is built, the plan takes what it holds (the backend timed, the sources that run), and a probe
    that turned drafting off leaves its sentence as the drafting note: the stats' "resolved" reads it back."""
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path))
    plan = runplan.make(Config(), opened(llama31_8b(8192), "auto"), prompt=100)
    assert plan.drafting and plan.drafting_off is None
    why = "llama.cpp: trees change the last bits, so drafts could change the text; decoding without them ..."
    ran = plan.as_run("ggml", (), "none", 0, why)
    assert ran.drafting_off == dict(ran.notes)["drafting"] == why and ran.estimate == plan.estimate
    assert ran.resolved() == {
        "model": "llama3-8b", "fingerprint": "fp", "device": "cpu", "dtype": "float32", "weights": "float",
        "backend": "ggml", "attention": "auto", "cuda_graphs": False, "threads": 0, "tp": 1, "context": 8192,
        "drafting": (), "budget": "none", "drafting_off": why, "bans": 0}
    ran = plan.as_run("torch", ("recycling", "ngram"), "auto", 2, None)
    assert ran.drafting_off is None and dict(ran.notes)["drafting"] == dict(plan.notes)["drafting"]
    assert runplan.make(Config(draft="none"), opened(llama31_8b(8192), "ggml"), prompt=100).drafting_off is None


def test_the_settings_a_resume_runs_again_are_read_from_the_plan_as_run(machine, tmp_path, monkeypatch):
    """`auto` as it resolved, and the context only where the free memory made it less than asked (a resume
    rebuilds its context at the same tokens); a context that is the model's window stays as it was asked."""
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path))
    cfg = Config(tokens=100_000)
    fitted = runplan.make(cfg, opened(llama31_8b(), "auto"), prompt=200).as_run("ggml", (), "none", 0, None)
    settings = fitted.settings(cfg)
    assert fitted.context < 131_072 and settings["context"] == fitted.context
    assert (settings["backend"], settings["dtype"], settings["weights"], settings["threads"]) == \
        ("ggml", "float32", "float", 0)
    whole = runplan.make(cfg, opened(llama31_8b(8192), "ggml"), prompt=200).as_run("ggml", (), "none", 0, None)
    assert whole.settings(cfg)["context"] == cfg.context == 0
    assert whole.settings(Config(tokens=100_000, context=100_000))["context"] == 100_000  # past the window: as asked
