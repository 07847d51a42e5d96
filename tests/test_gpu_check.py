"""bench/gpu_check.py runs rarely, on a GPU machine a task may or may not be lent, with minutes to spare; it must
not rot in between. Here it runs end to end on the CPU, small: a one-layer random model of the default width
(a 4,096-token vocabulary, which took this test from 117 s to 100 s here),
the kernel in Triton's interpreter, a 16-id prompt (the interpreter prefilled 64 in ~5 s in bfloat16, at each of the
check's engine runs: the test took 129 s with 64 and 59 s with 16 here), the CUDA-graph sections through the
uncaptured static forward, a fixed draft
budget (the automatic one would first measure a cost curve up to 64 nodes through the interpreter: 95 s). What it
proves: every section runs and reports, equality holds in each, and the report says what it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the check's kernel and graph sections need triton (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_end_to_end_on_a_cpu(tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, TRITON_INTERPRET="1", SWIFTWRITE_HOME=str(tmp_path / "home"))  # its own cost-curve cache
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out), "--device", "cpu",
                           "--attention", "triton", "--random-layers", "1", "--random-vocab", "4096", "--random-prompt", "16", "--short", "8",
                           "--long", "0", "--equal-tokens", "8", "--cost-contexts", "32", "--cost-sizes", "1,2",
                           "--draft-budget", "4", "--tp", "2", "--tp-tokens", "12"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["complete"] and report["weights"].startswith("RANDOM")
    assert report["errors"] == {}  # each section catches its own failure so that a GPU lease still gets the rest
    assert report["attention"]["tree_kernel"] and report["kernel"][0]["max_abs_error"] < 1e-5
    assert report["kernel"][0]["nodes_not_step_bits"] == 0
    assert set(report["equality"]) == {f"{s}{d}{g}" for s in ("greedy", "sample") for d in ("", " in bfloat16")
                                       for g in ("", ", all with CUDA graphs")}
    assert report["exact_half"]["check"] == "passed" and report["exact_half"]["step_kernel"]
    assert all(v["first_divergence"] is None for v in report["equality"].values())
    assert [(r["context"], r["nodes"]) for r in report["forward_cost"]] == [(32, 1), (32, 2)]
    # --long 0: the long outputs' rows run the same code as the short ones, through the interpreter at ~2 tok/s
    assert [(r["method"], r["target_tokens"]) for r in report["speed"]] == [
        (m, 8) for m in ("hf", "none", "all", "none+graphs", "all+graphs")]
    assert all(r["tokens"] == r["target_tokens"] for r in report["speed"])
    assert all(0 < r["distinct_4"] <= 1 and r["longest_repeat"] >= 0 for r in report["speed"])
    tp = report["tp"]
    assert tp["world"] == 2 and tp["backend"] == "gloo" and tp["equality"] == {"greedy": None, "sample": None}
    assert [m["weight_bytes"] for m in tp["memory"]][0] == tp["memory"][1]["weight_bytes"]
    md = (out / "gpu_check.md").read_text()
    assert "tensor parallelism, 2 ranks (gloo)" in md
    assert "RANDOM" in md and "uncaptured: no CUDA" in md and "INCOMPLETE" not in md
    assert "exact bfloat16: start-up check passed" in md
    assert not (out / "work").exists()  # the random model is removed
