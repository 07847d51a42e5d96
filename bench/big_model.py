"""Does an 8B-shaped quantized GGUF fit and run on this machine? Memory and speed of `swiftwrite generate` on it,
beside llama.cpp's own loop on the same file.

    python bench/big_model.py --out bench/results/big_model-DATE.json            # ggml backend vs llama.cpp
    python bench/big_model.py --torch --out ...                                   # also the torch int4 path

Builds, in --dir, a model with Llama-3-8B's layers (hidden 4096, 32 layers, 32 query / 8 key-value heads,
feed-forward 14336, rope theta 500000) and the default model's tokenizer (49,152 ids, so 7.4B parameters
instead of 8.0B), laid out as the store lays out an imported GGUF: config.json, the tokenizer, `model.gguf`.
The GGUF's matrices are random Q4_0 blocks (a fixed fp16 scale, random 4-bit codes: the bytes and the
de-quantizing work of a real Q4_0 file), its norms float32, and it carries the default model's tokenizer metadata,
so llama.cpp loads the same file. Nothing is downloaded; the text it writes is noise.

Then, in fresh processes (so each peak resident memory is its own), one after the other:
  1. llama.cpp plain: llama-cpp-python's own loop on the GGUF, greedy (the peer);
  2. `swiftwrite generate --backend ggml` (the same kernels behind our engine);
  3. with --torch: `swiftwrite generate --backend torch --weights int4`, twice (the first run quantizes the GGUF to
     the int4 kernel's layout a layer at a time; the second reads the stored int4 file).
  4. with --window 131072 --planned (Llama-3.1's window): `swiftwrite generate --dry-run --json` with default
     settings, then the same run for real in a store of its own: the context the plan chose and why, its memory
     figure against the run's peak resident memory.
  5. with --auto: `swiftwrite generate` with the default `--backend auto`, twice, in a store of its own: the first
     run probes llama.cpp, times its two loadings and prices torch from models of its first 1 and 8 layers (since
     2026-12-07: before, it converted the whole GGUF to int4 to time it), the second reads what the first kept.
     The times it kept (milliseconds a step) are in the report.
Each row: wall seconds, the process's peak resident memory (its own rusage, from wait4), the run's own
tokens/s, and the bytes on disk (the GGUF, the int4 file). Writes machine, date and
settings beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common

ROOT = common.ROOT

SHAPE = dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, rope_theta=500000.0, context=8192)


def write_model(d: Path, layers: int, default_dir: Path) -> int:
    """config.json, the default tokenizer and a random Q4_0 `model.gguf` in `d`; returns the parameter count."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter

    from swiftwrite.models import store

    d.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((default_dir / "config.json").read_text())
    vocab = cfg["vocab_size"]
    h, f, hd = SHAPE["hidden"], SHAPE["ffn"], SHAPE["hidden"] // SHAPE["heads"]
    cfg.update(hidden_size=h, intermediate_size=f, num_hidden_layers=layers, num_attention_heads=SHAPE["heads"],
               num_key_value_heads=SHAPE["kv_heads"], head_dim=hd, rope_theta=SHAPE["rope_theta"],
               max_position_embeddings=SHAPE["context"], tie_word_embeddings=False, rms_norm_eps=1e-5)
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_theta": SHAPE["rope_theta"], "rope_type": "default"}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    for p in default_dir.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(p, d / p.name)

    mats = {"token_embd.weight": (vocab, h), "output.weight": (vocab, h)}
    for i in range(layers):
        mats.update({f"blk.{i}.attn_q.weight": (h, h), f"blk.{i}.attn_k.weight": (SHAPE["kv_heads"] * hd, h),
                     f"blk.{i}.attn_v.weight": (SHAPE["kv_heads"] * hd, h), f"blk.{i}.attn_output.weight": (h, h),
                     f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
                     f"blk.{i}.ffn_down.weight": (h, f)})
    norms = [f"blk.{i}.{n}.weight" for i in range(layers) for n in ("attn_norm", "ffn_norm")] + ["output_norm.weight"]
    w = GGUFWriter(str(d / "model.gguf"), "llama")
    w.add_context_length(SHAPE["context"])
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(f)
    w.add_head_count(SHAPE["heads"])
    w.add_head_count_kv(SHAPE["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(SHAPE["rope_theta"])
    for key, value, types in tokenizer_fields(default_dir / store.GGUF_FILE):  # so llama.cpp can load the file
        w.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    for name, (rows, cols) in mats.items():  # Q4_0: per 32 inputs an fp16 scale and 16 bytes of 4-bit codes
        w.add_tensor_info(name, (rows, cols // 32 * 18), np.dtype(np.uint8), rows * cols // 32 * 18, raw_dtype=T.Q4_0)
    for name in norms:
        w.add_tensor_info(name, (h,), np.dtype(np.float32), h * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    scale = np.frombuffer(np.float16(0.004).tobytes(), dtype=np.uint8)  # codes -8..7 -> weights within ±0.032
    for name, (rows, cols) in mats.items():  # one matrix at a time (at most 113 MB of blocks): the writer streams
        blocks = rng.integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)
        blocks[:, :, :2] = scale
        w.write_tensor_data(blocks.reshape(rows, -1))
    for _ in norms:
        w.write_tensor_data(np.ones(h, dtype=np.float32))
    w.close()
    meta = {"name": d.name, "source": "bench/big_model.py (random Q4_0)", "gguf_weights": "Q4_0"}
    meta["fingerprint"] = store._compute_fingerprint(d)
    (d / store.META_FILE).write_text(json.dumps(meta, indent=2))
    return sum(r * c for r, c in mats.values()) + len(norms) * h


def tokenizer_fields(gguf: Path) -> list:
    """(key, value, types) of every tokenizer.* field of a GGUF."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    return [(k, f.contents(), f.types) for k, f in r.fields.items() if k.startswith("tokenizer.")]


def peer(d: Path, tokens: int, threads: int, stats: Path) -> None:
    """In a child process: llama.cpp's own greedy loop on the GGUF, its tokens/s written to `stats`."""
    from swiftwrite.models import peers

    prompt = list(range(100, 132))
    llm = peers.load_llamacpp(d / "model.gguf", threads, len(prompt) + tokens + 16)
    secs, toks = peers.llamacpp_generate(llm, prompt, tokens, dict(temperature=0.0, min_p=0.0, penalty=1.0))
    stats.write_text(json.dumps({"tokens": len(toks), "seconds": round(secs, 3), "tokens_per_second": len(toks) / secs}))


def run_once(d: Path, prompt: Path, tokens: int, threads: int, stats: Path, backend: str, home: Path | None = None) -> dict:
    if backend == "llama.cpp":
        cmd = [sys.executable, str(Path(__file__)), "--peer", str(d), "--tokens", str(tokens), "--threads",
               str(threads), "--out", str(stats)]
    else:
        cmd = [sys.executable, "-m", "swiftwrite.cli", "generate", str(prompt), "--model", str(d), "--backend",
               backend, "--tokens", str(tokens), "--draft", "none", "--threads", str(threads), "--temperature", "0",
               "--run-dir", str(stats.with_suffix("")), "--stats-json", str(stats), "--quiet",
               "--out", str(stats.with_suffix(".txt"))] + (["--weights", "int4"] if backend == "torch" else [])
    t0 = time.perf_counter()
    err = open(stats.with_suffix(".stderr"), "w+")
    env = {**os.environ, **({"SWIFTWRITE_HOME": str(home)} if home else {})}
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
    rc, peak = common.wait_child(p.pid)  # this child's own rusage: its peak resident memory, loading included
    wall = time.perf_counter() - t0
    err.seek(0)
    said = err.read()
    row = {"command": " ".join(cmd[3:]), "rc": rc, "wall_s": round(wall, 1), "peak_rss_mib": round(peak / 2**20),
           "stderr_tail": said[-600:]}
    if row["rc"] == 0 and stats.is_file():
        s = json.loads(stats.read_text())
        row.update(tokens=s.get("tokens"), tok_s=s.get("tokens_per_second"), seconds=s.get("seconds"))
    return row


def planned_against_run(d: Path, prompt: Path, tokens: int) -> dict:
    """--dry-run's plan of a default run, then the run (in a store of its own: the first run here, backend timed),
    its peak resident memory beside the plan's figure."""
    home = d / "home-planned"
    shutil.rmtree(home, ignore_errors=True)
    env = {**os.environ, "SWIFTWRITE_HOME": str(home)}
    base = [sys.executable, "-m", "swiftwrite.cli", "generate", str(prompt), "--model", str(d), "--tokens", str(tokens)]
    dry = subprocess.run(base + ["--dry-run", "--json"], cwd=ROOT, capture_output=True, env=env, text=True)
    if dry.returncode != 0:
        return {"dry_run_rc": dry.returncode, "stderr_tail": dry.stderr[-600:]}
    plan = json.loads(dry.stdout)
    stats = d / "stats-planned.json"
    cmd = base + ["--run-dir", str(d / "run-planned"), "--stats-json", str(stats), "--quiet", "--out",
                  str(d / "planned.txt")]
    shutil.rmtree(d / "run-planned", ignore_errors=True)
    err = open(d / "planned.stderr", "w+")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
    rc, peak = common.wait_child(p.pid)
    err.seek(0)
    row = {"plan": {k: plan[k] for k in ("context", "window", "backend", "memory", "notes", "rebuild_every")},
           "rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "peak_rss_bytes": peak,
           "peak_over_plan": round(peak / plan["memory"]["total"], 3), "stderr_tail": err.read()[-1500:]}
    if rc == 0:
        s = json.loads(stats.read_text())
        row.update(tokens=s["tokens"], tok_s=s["tokens_per_second"], context=s["resolved"]["context"],
                   backend=s["backend"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default="/tmp/swiftwrite-big-8b")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the model directory and its int4 file")
    ap.add_argument("--torch", action="store_true", help="also run the torch path with --weights int4 (twice)")
    ap.add_argument("--auto", action="store_true",
                    help="also run the default --backend auto twice in a store of its own: the first run probes "
                         "llama.cpp and times both backends, the second reads what the first kept")
    ap.add_argument("--window", type=int, default=SHAPE["context"],
                    help="the model's positions (131072: Llama-3.1's window); default %(default)s")
    ap.add_argument("--planned", action="store_true",
                    help="only the plan against the run: --dry-run, then generate with default settings")
    ap.add_argument("--peer", type=Path, help=argparse.SUPPRESS)  # the llama.cpp child (run_once)
    a = ap.parse_args()
    if a.peer:
        return peer(a.peer, a.tokens, a.threads, Path(a.out))
    SHAPE["context"] = a.window

    from swiftwrite.tensors import quant
    from swiftwrite.models import store

    default_dir = store.pull(store.DEFAULT_MODEL)
    d = Path(a.dir)
    t0 = time.perf_counter()
    params = write_model(d, a.layers, default_dir)
    build_s = time.perf_counter() - t0
    prompt = d / "prompt.txt"
    prompt.write_text("A lighthouse keeper finds a message in a bottle.\n")
    report = {
        "date": common.now(),
        "machine": common.machine(),  # a dict (cpu, cores, memory_gib, isa ...) since 2026-12; a string before
        "shape": {**SHAPE, "layers": a.layers, "vocab": json.loads((d / "config.json").read_text())["vocab_size"]},
        "parameters": params, "gguf_bytes": (d / "model.gguf").stat().st_size, "gguf_build_s": round(build_s, 1),
        "settings": {"tokens": a.tokens, "threads": a.threads, "draft": "none", "greedy": True, "penalty": "off"},
        "runs": [],
    }
    if a.planned:
        report["settings"] = {"tokens": a.tokens, "everything else": "default"}
        report["planned"] = planned_against_run(d, prompt, a.tokens)
        common.write_report(a.out, report, indent=2, newline=True)
        print(json.dumps(report["planned"], indent=2))
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
        return
    runs = [("llama.cpp", "llama.cpp plain (the peer)"), ("ggml", "swiftwrite --backend ggml")]
    if a.torch:
        runs += [("torch", "swiftwrite --backend torch --weights int4, first (quantizes the GGUF)"),
                 ("torch", "swiftwrite --backend torch --weights int4, second (reads the int4 file)")]
    if a.auto:
        shutil.rmtree(d / "home-auto", ignore_errors=True)
        runs += [("auto", "swiftwrite --backend auto, first run (probe, both backends timed)"),
                 ("auto", "swiftwrite --backend auto, second run")]
    for backend, label in runs:
        home = d / "home-auto" if backend == "auto" else None
        row = run_once(d, prompt, a.tokens, a.threads, d / f"stats-{len(report['runs'])}.json", backend, home)
        row["run"] = label
        report["runs"].append(row)
        print(json.dumps(row)[:400], flush=True)
    peer_row, ggml_row = report["runs"][0], report["runs"][1]
    if peer_row.get("tok_s") and ggml_row.get("tok_s"):
        report["ggml_vs_llamacpp"] = {"speed": round(ggml_row["tok_s"] / peer_row["tok_s"], 3),
                                      "peak_memory": round(ggml_row["peak_rss_mib"] / peer_row["peak_rss_mib"], 3)}
    autos = [r for r in report["runs"] if "--backend auto" in r["command"] and r.get("tok_s")]
    if peer_row.get("tok_s") and autos:
        report["auto_vs_llamacpp"] = [{"run": r["run"], "speed": round(r["tok_s"] / peer_row["tok_s"], 3),
                                       "peak_memory": round(r["peak_rss_mib"] / peer_row["peak_rss_mib"], 3)}
                                      for r in autos]
    if a.auto:  # what auto's first run measured: llama.cpp's loadings timed, torch priced
        kept = json.loads(next((d / "home-auto").rglob("backends.json")).read_text())
        report["auto_times_ms"] = {k: v for k, v in kept.items() if "/rows" not in k}
    packed = quant.packed_path(d, "int4")
    report["int4_bytes"] = packed.stat().st_size if packed.is_file() else None
    report["float_copy_written"] = any(d.glob("*.safetensors"))
    common.write_report(a.out, report, indent=2, newline=True)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    if not a.keep:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(packed.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
