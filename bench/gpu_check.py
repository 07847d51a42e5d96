"""One GPU check, for a machine with an NVIDIA GPU, torch, triton and transformers installed and no network.

    bash bench/gpu_check.sh [MODEL_DIR] [OUT_DIR]          (the shell wrapper: time limit, defaults)
    python bench/gpu_check.py --model-dir DIR --out DIR     (this script; PYTHONPATH=. where swiftwrite is not
                                                             installed: the wrapper sets it)

MODEL_DIR: the converted default model (a Hugging Face directory as `swiftwrite models pull` writes it), or
a folder holding the model's GGUF file split into parts (`*.gguf.part-*`, reassembled here). Without one, a
random-weight model of the default model's shape is used, and every figure from it is labelled so: its
acceptance (and so the speed of drafting) means nothing, only the kernel, the equality and plain speed do.

Writes OUT/gpu_check.json and OUT/gpu_check.md:
  1. the Triton tree kernel against the torch reference (max abs error; bfloat16, float16, float32);
  2. speculative (`--draft all`) against plain output, token for token, greedy and seeded sampling, in the
     run's dtype (float32 by default) and in --half-dtype (bfloat16), where equality holds by construction if
     the start-up check passes on this GPU (its verdict, the products' piece sizes and pads are reported; the
     kernel table says whether every tree node got a single step's bits);
  3. CUDA graphs (--cuda-graphs): milliseconds per forward of n = 1, 2, 4 .. 64 tree nodes with and without
     graphs at two context lengths, and speculative output with graphs against plain output, token for token;
  4. tokens per second of transformers `generate`, swiftwrite `--draft none` and `--draft all` (and both with
     CUDA graphs), for short and long outputs (--short, --long new tokens; the long ones cross context rebuilds
     past the window), each under its own time budget so the whole script stays inside its limit.
  5. with --tp N (default 2 where the machine has two GPUs or more, else off): tensor parallelism over N ranks
     (NCCL, one GPU each; gloo on a CPU) on a random model of the default model's size whose heads divide
     (bench/tp_cost.py's shape): speculative against plain output under N ranks, greedy and sampled, token for
     token; N ranks' plain output against one process; tok/s; each rank's weights, KV cache and memory.
It also runs on a CPU (--device cpu --attention triton, small sizes) so that it can be checked where no GPU is:
the kernel then runs in Triton's interpreter and the graph sections run their static forward uncaptured.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # a CPU run of the script: the kernel goes through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import common  # noqa: E402
from swiftwrite.base.config import Config  # noqa: E402
from swiftwrite.base.metrics import distinct_n, first_divergence, longest_repeat  # noqa: E402
from swiftwrite.io.ui import dtype_name  # noqa: E402

ROOT = common.ROOT

# The default model's shape (SmolLM2-135M), for the random-weight stand-in.
DEFAULT_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def section(report: dict, name: str, out: Path, t_start: float):
    """One section of the check: a failure is recorded with its traceback and the next section runs, since a GPU
    lease is too short to rerun the whole script for one broken part."""
    log(name)
    try:
        yield
    except Exception:
        tb = traceback.format_exc()
        log(f"{name} FAILED:\n{tb}")
        report["errors"][name] = tb[-4000:]
    save(report, out, t_start)


def kernel_check(device: str) -> list[dict]:
    from swiftwrite.kernels import tree_attention as ta

    if not ta.available():
        return [{"error": "triton is not installed"}]
    rows = []
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else [torch.float32]
    shapes = [(9, 3, 64, 4096, 64), (9, 3, 64, 777, 17), (32, 8, 128, 8192, 32)] if device == "cuda" \
        else [(9, 3, 64, 100, 8)]  # the CPU runs it in Triton's interpreter: a small shape to prove the script
    for H, KV, D, T, n in shapes:
        for dt in dtypes:
            q = torch.randn(H, n, D, generator=g).to(device, dt)
            kc, vc = (torch.randn(KV, T, D, generator=g).to(device, dt) for _ in range(2))
            kt, vt = (torch.randn(KV, n, D, generator=g).to(device, dt) for _ in range(2))
            anc = torch.eye(n, dtype=torch.bool)
            for i in range(1, n):
                anc[i] |= anc[int(torch.randint(0, i, (1,), generator=g))]
            bits = ta.ancestry_bits(anc.to(device))
            want = ta.reference(q, kc, vc, kt, vt, bits, D ** -0.5).float()
            tree = ta.tree_attention(q, kc, vc, kt, vt, bits, D ** -0.5)
            # each node as a single decoding step computes it (the kernel over one node, its ancestors cached
            # before it): exactness by construction holds on this GPU when every node has the step's bits
            one = torch.ones(1, dtype=torch.long, device=device)
            differ = 0
            for i in range(n):
                before = anc[i].nonzero().flatten()[:-1].to(device)
                step = ta.tree_attention(q[:, i : i + 1], torch.cat([kc, kt[:, before]], 1),
                                         torch.cat([vc, vt[:, before]], 1), kt[:, i : i + 1], vt[:, i : i + 1], one,
                                         D ** -0.5)
                differ += not torch.equal(step[:, 0], tree[:, i])
            rows.append({"shape": f"H{H} KV{KV} D{D} T{T} n{n}", "dtype": dtype_name(dt),
                         "max_abs_error": float((tree.float() - want).abs().max()),
                         "nodes_not_step_bits": differ})
    return rows


def norm_rows_differ(rms_norm, hidden: int, device, dtype: torch.dtype, rows: int = 64) -> list[int]:
    """The row counts n in 2..rows at which `rms_norm` gives some row other bits among n rows than alone (a
    reduction whose order may follow the row count, as a CUDA reduction's launch shape does). 64 pools of rows
    per count: one difference in a few hundred rows is enough to change a token later."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(rows * 64, hidden, generator=g) * 3).to(device, dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(device, dtype)
    alone = torch.cat([rms_norm(r, w, 1e-5) for r in x.split(1)])
    return [n for n in range(2, rows + 1)
            if not torch.equal(torch.cat([rms_norm(part, w, 1e-5) for part in x[: x.shape[0] // n * n].split(n)]),
                               alone[: x.shape[0] // n * n])]


def invariance(lean, sizes=(2, 4, 8, 16, 32, 64)) -> dict:
    """Which part of a forward gives a tree's rows other bits than single steps: chains of each size against steps
    (exact.chain_probe: None, or which node differed),
    with the forward as loaded, with torch's RMSNorm (ops.rms_norm) in place of the one loaded, with every RMSNorm
    computed row by row, and with the products row by row as well (row by row is a single step's computation by
    definition). Where one variant differs and a row-by-row part removes it, that part is the cause."""
    from swiftwrite.models import model as model_module
    from swiftwrite.tensors.exact import chain_probe
    from swiftwrite.tensors.ops import rms_norm as torch_norm

    loaded_norm, stock_linear = lean.norm, model_module.linear

    def norm_rows(x, w, eps):
        return torch.cat([loaded_norm(r, w, eps) for r in x.reshape(-1, x.shape[-1]).split(1)]).view(x.shape)

    def linear_rows(x, w, b=None, rows=None, pad=False, grow=0):
        return torch.cat([stock_linear(r, w, b, None, pad) for r in x.split(1)])

    out = {"torch_norm_rows_differ_at": norm_rows_differ(torch_norm, lean.cfg.hidden_size, lean.device, lean.dtype),
           "loaded_norm_rows_differ_at": norm_rows_differ(loaded_norm, lean.cfg.hidden_size, lean.device, lean.dtype)}
    try:
        for name, norm, lin in (("as loaded", loaded_norm, stock_linear), ("torch norm", torch_norm, stock_linear),
                                ("norm row by row", norm_rows, stock_linear),
                                ("norm and products row by row", norm_rows, linear_rows)):
            lean.norm, model_module.linear = norm, lin
            out[name] = {n: chain_probe(lean, n) for n in sizes}
            log(f"  {name}: {out[name]}")
    finally:
        lean.norm, model_module.linear = loaded_norm, stock_linear
    # greedy's argmax over a batch of rows against one row, with exact ties (bfloat16 logits tie often)
    t = torch.zeros(8, 49152, device=lean.device)
    t[:, 3000] = t[:, 17] = t[:, 40000] = 1.0
    out["argmax_ties"] = {"batch": t.argmax(-1).tolist(), "one_row": t[:1].argmax(-1).tolist()}
    return out


def reassemble(model_dir: Path, work: Path) -> Path:
    parts = sorted(model_dir.glob("*.gguf.part-*"))
    if not parts:
        return model_dir
    out = work / parts[0].name.split(".part-")[0]
    with open(out, "wb") as fh:
        for p in parts:
            fh.write(p.read_bytes())
    log(f"reassembled {len(parts)} parts into {out} ({out.stat().st_size / 2**20:.0f} MiB)")
    return out


def random_model(work: Path, layers: int, vocab: int = DEFAULT_SHAPE["vocab_size"]) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = work / "random-smollm2-shape"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**DEFAULT_SHAPE, "num_hidden_layers": layers, "vocab_size": vocab})).save_pretrained(
        str(path))
    return path


def tp_check(work: Path, device: str, world: int, layers: int, n: int, budget: int) -> dict:
    """Section 5: N ranks of bench/tp_cost.py's rank_main, led by rank 0, against one process."""
    import torch.multiprocessing as mp
    from transformers import LlamaConfig, LlamaForCausalLM

    import tp_cost  # bench/tp_cost.py, a sibling

    from swiftwrite.models.model import load_lean

    path = work / "random-tp-shape"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**tp_cost.SHAPE, "num_hidden_layers": layers})).save_pretrained(str(path))
    out = str(work / "tp")
    mp.spawn(tp_cost.rank_main, args=(world, str(work / "tp-init"), str(path), out, n, budget, device), nprocs=world,
             join=True)
    lead = json.loads(Path(out + ".rank0").read_text())
    runs = lead["runs"]
    one = tp_cost.decode(load_lean(path, device), [], n, budget)["tokens"]
    return {"world": world, "backend": "nccl" if device == "cuda" else "gloo", "tokens": n, "budget": budget,
            "model": f"RANDOM, {layers} layers, {tp_cost.SHAPE['num_attention_heads']} query / "
                     f"{tp_cost.SHAPE['num_key_value_heads']} KV heads (drafting speed means nothing)",
            "equality": {"greedy": first_divergence(runs["drafts"]["tokens"], runs["none"]["tokens"]),
                         "sample": first_divergence(runs["drafts-sampled"]["tokens"], runs["none-sampled"]["tokens"])},
            "plain_leaves_one_process_at": first_divergence(runs["none"]["tokens"], one),
            "runs": {k: {m: v[m] for m in ("tok_s", "tok_per_forward", "distinct_4", "longest_repeat")}
                     for k, v in runs.items()},
            "memory": [lead["memory"], *(json.loads(Path(out + f".rank{r}").read_text()) for r in range(1, world))]}


def load(model: Path, device: str, dtype: str, attention: str):
    from swiftwrite.run import assembly
    from swiftwrite.run.devices import pick_device
    from swiftwrite.models.store import ModelRef
    from swiftwrite.io.ui import Display

    cfg = Config(model=str(model), device=device, dtype=dtype, attention=attention)
    display = Display("quiet")
    if model.suffix == ".gguf" or (model / "tokenizer.json").exists() or (model / "tokenizer_config.json").exists():
        return assembly.load(cfg, display), display
    # a random stand-in has no tokenizer: the engine needs only ids
    from swiftwrite.models.model import load_lean

    # the fingerprint keys cached cost curves: a random stand-in of another shape must not reuse them
    shape = hashlib.sha256((model / "config.json").read_bytes()).hexdigest()[:12]
    lm = assembly.Loaded(ModelRef(name="random", path=model, fingerprint=f"random-{shape}"), None, None, *pick_device(device, dtype),
                        attention=attention)
    lm.model = load_lean(model, lm.device, lm.dtype, attention)
    lm.mcfg = lm.model.cfg
    return lm, display


class graphs_on:
    """Within the block, the loaded model is replayed from CUDA graphs (uncaptured static forwards on a CPU)."""

    def __init__(self, lm):
        self.lm = lm

    def __enter__(self):
        from swiftwrite.models.graphs import GraphedModel

        self.lean = self.lm.model
        self.lm.model, self.lm.cuda_graphs = GraphedModel(self.lean), True
        return self.lm.model

    def __exit__(self, *exc):
        self.lm.model, self.lm.cuda_graphs = self.lean, False


def forward_costs(lm, contexts, sizes, reps: int) -> list[dict]:
    """ms per forward of an n-node tree (causal mask) at each context length, plain forward vs graph replay."""
    from swiftwrite.models.graphs import GraphedModel

    lean = lm.model
    graphed = GraphedModel(lean)
    sync = torch.cuda.synchronize if lean.device.type == "cuda" else (lambda: None)
    rows = []
    for ctx in contexts:
        cache = lean.new_cache(ctx + max(sizes) + 1)
        cache.length = ctx  # scratch contents: timing only
        for n in sizes:
            ids = torch.zeros(n, dtype=torch.long, device=lean.device)
            pos = torch.arange(ctx, ctx + n, device=lean.device).clamp_(max=lean.cfg.max_positions - 1)
            mask = torch.ones(n, n, dtype=torch.bool, device=lean.device).tril_() if n > 1 else None
            row = {"context": ctx, "nodes": n}
            for name, model in (("plain_ms", lean), ("graph_ms", graphed)):
                for _ in range(3):
                    model.forward(ids, pos, cache, mask)
                sync()
                t0 = time.perf_counter()
                for _ in range(reps):
                    model.forward(ids, pos, cache, mask)
                sync()
                row[name] = round((time.perf_counter() - t0) / reps * 1e3, 3)
            row["speedup"] = round(row["plain_ms"] / row["graph_ms"], 2)
            rows.append(row)
            log(f"  ctx {ctx} n {n}: {row['plain_ms']} ms plain, {row['graph_ms']} ms graph")
    return rows


def run_engine(lm, display, prompt: list[int], n: int, draft: str, settings: dict, budget_s: float,
               draft_budget: str = "auto"):
    from swiftwrite.run.assembly import build_engine, fit_budget

    cfg = Config(draft=draft, tokens=n, budget=draft_budget, **settings).validate()
    engine = build_engine(cfg, lm, len(prompt), len(prompt) + n, display)
    engine.start(prompt)
    fit_budget(engine, lm, upto=len(prompt) + n)
    out, t0 = [], time.perf_counter()
    sync = torch.cuda.synchronize if lm.model.device.type == "cuda" else (lambda: None)
    for step in engine.run(n):
        out += step.tokens
        if time.perf_counter() - t0 > budget_s:
            break
    sync()
    secs = time.perf_counter() - t0
    return out, secs, engine.forwards


def save(report: dict, out: Path, t_start: float) -> None:
    """Write gpu_check.json and gpu_check.md with what is done so far: a run cut by the time limit still
    leaves its finished sections (and says it is incomplete)."""
    report["seconds"] = round(time.time() - t_start, 1)
    cost = report["forward_cost"]
    md = [f"# GPU check, {report['date']}" + ("" if report["complete"] else " (INCOMPLETE: cut short)"), "",
          f"device {report['device']} ({report['gpu']}), torch {report['torch']}, triton {report['triton']}, "
          f"flash-attn {report['flash_attn']}; weights: {report.get('weights')}; {report['seconds']} s", "",
          "| kernel shape | dtype | max abs error vs reference | nodes without a step's bits |", "|---|---|---:|---:|",
          *[f"| {r.get('shape')} | {r.get('dtype')} | {r.get('max_abs_error', r.get('error'))} | "
            f"{r.get('nodes_not_step_bits', '-')} |" for r in report["kernel"]],
          *(_tp_lines(report["tp"]) if report.get("tp") else []),
          *([f"", f"exact {report['exact_half']['dtype']}: start-up check {report['exact_half']['check']}; "
             f"tree rows per product piece {report['exact_half']['pieces']}; single rows padded to two "
             f"{report['exact_half']['pads']}"] if report.get("exact_half") else []),
          "", "| equality | first divergence (None = identical) |", "|---|---|",
          *[f"| {k} ({v['tokens']} tokens) | {v['first_divergence']} |" for k, v in report["equality"].items()],
          *(["", "| context | tree nodes | plain forward ms | " + ("CUDA graph ms" if report["device"] == "cuda" else
              "static forward ms (uncaptured: no CUDA)") + " | speedup |", "|---:|---:|---:|---:|---:|",
              *[f"| {r['context']} | {r['nodes']} | {r['plain_ms']} | {r['graph_ms']} | {r['speedup']} |" for r in cost]]
            if cost else ["", "CUDA graphs: not measured (no tree kernel, or not reached)."]),
          "", "| method | new tokens (target) | tok/s | tok/forward | Distinct-4 | longest repeat |",
          "|---|---:|---:|---:|---:|---:|",
          *[f"| {r['method']} | {r['tokens']} ({r['target_tokens']}) | {r['tokens_per_second']} | "
            f"{r['tokens_per_forward'] or '-'} | {r.get('distinct_4', '-')} | {r.get('longest_repeat', '-')} |"
            for r in report["speed"]],
          *([f"", f"**{len(report['errors'])} section(s) failed:**", ""] +
            [f"- {k}: `{v.strip().splitlines()[-1]}`" for k, v in report["errors"].items()]
            if report.get("errors") else []), ""]
    common.write_report(out / "gpu_check.json", report, "\n".join(md))


def _tp_lines(tp: dict) -> list[str]:
    mem = ", ".join(f"rank {r}: weights {m['weight_bytes'] >> 20} MiB, KV {m['kv_bytes_per_1k_tokens'] >> 20} MiB/1K "
                    f"tokens" + (f", CUDA allocated {m['cuda_allocated_bytes'] >> 20} MiB" if "cuda_allocated_bytes" in m
                                 else f", resident {m['rss_bytes'] >> 20} MiB") for r, m in enumerate(tp["memory"]))
    return ["", f"tensor parallelism, {tp['world']} ranks ({tp['backend']}), {tp['model']}, {tp['tokens']} tokens: "
            f"drafts vs plain under {tp['world']} ranks first differ at greedy {tp['equality']['greedy']}, sampled "
            f"{tp['equality']['sample']}; plain vs one process at {tp['plain_leaves_one_process_at']}; tok/s "
            + ", ".join(f"{k} {v['tok_s']} (D-4 {v['distinct_4']}, repeat {v['longest_repeat']})"
                        for k, v in tp["runs"].items()) + f"; {mem}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32",
                    help="the dtype of every section but the next one (float32: the dtype before exact half precision)")
    ap.add_argument("--half-dtype", default="bfloat16",
                    help="also check exactness and equality in this dtype, what --dtype auto takes on a GPU with "
                         "bfloat16 (none: skip)")
    ap.add_argument("--attention", default="auto", help="auto | torch | triton | flash (CPU check: triton)")
    ap.add_argument("--cost-contexts", default="2048,16384", help="context lengths of the forward-cost table")
    ap.add_argument("--cost-sizes", default="1,2,4,8,16,32,64", help="tree sizes of the forward-cost table")
    ap.add_argument("--random-layers", type=int, default=DEFAULT_SHAPE["num_hidden_layers"],
                    help="layers of the random stand-in (fewer: a quick CPU check of the script)")
    ap.add_argument("--random-vocab", type=int, default=DEFAULT_SHAPE["vocab_size"],
                    help="vocabulary of the random stand-in (smaller: a quicker CPU check; the LM head's start-up "
                         "measurements dominate it)")
    ap.add_argument("--random-prompt", type=int, default=64,
                    help="ids in the random model's prompt (the CPU test: 16, since Triton's interpreter takes ~5 s "
                         "to prefill 64 through the kernel in bfloat16, at each of its engine runs)")
    ap.add_argument("--short", type=int, default=2000)
    ap.add_argument("--long", type=int, default=32000)
    ap.add_argument("--equal-tokens", type=int, default=500)
    ap.add_argument("--draft-budget", default="auto",
                    help="draft nodes per step: auto (measures this machine's cost curve first) or 1..63; the CPU "
                         "test fixes it, since the curve through Triton's interpreter takes minutes")
    ap.add_argument("--tp", type=int, default=2 if torch.cuda.device_count() >= 2 else 0,
                    help="tensor-parallel ranks of section 5 (0 = skip; default 2 with two GPUs or more)")
    ap.add_argument("--tp-tokens", type=int, default=300)
    ap.add_argument("--invariance-only", action="store_true",
                    help="only find which part of a --half-dtype forward gives a tree's rows other bits than single "
                         "steps (a minute: for a short lease after the equality table showed a divergence)")
    ap.add_argument("--budget-s", type=float, default=30.0,
                    help="seconds each speed run may take at most (tok/s is over the tokens it wrote by then)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "work"
    work.mkdir(exist_ok=True)
    t_start = time.time()
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": a.device,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__, "python": platform.python_version(), "machine": common.machine()}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    try:
        import flash_attn

        report["flash_attn"] = flash_attn.__version__
    except ImportError:
        report["flash_attn"] = None
    report.update(kernel=[], equality={}, forward_cost=None, speed=[], errors={}, complete=False)
    if a.invariance_only:  # the half-precision section alone, equality and its row-invariance table
        with section(report, "load", a.out, t_start):
            model = reassemble(a.model_dir, work) if a.model_dir and a.model_dir.exists() else random_model(
                work, a.random_layers, a.random_vocab)
            report["weights"] = "real" if a.model_dir else f"RANDOM, {a.random_layers} layers"
        half_section(a, report, model, t_start)
        report["complete"] = True
        save(report, a.out, t_start)
        print(json.dumps({k: report.get(k) for k in ("exact_half", "equality", "invariance", "errors")}, indent=1))
        subprocess.run(["rm", "-rf", str(work)], check=False)
        return
    with section(report, "kernel vs reference", a.out, t_start):
        report["kernel"] = kernel_check(a.device)

    lm = None
    with section(report, "load", a.out, t_start):
        model = reassemble(a.model_dir, work) if a.model_dir and a.model_dir.exists() else None
        report["weights"] = "real" if model else f"RANDOM, {a.random_layers} layers (acceptance and drafting speed mean nothing)"
        if model is None:
            log("no model directory: a random-weight model of the default model's shape")
            model = random_model(work, a.random_layers, a.random_vocab)
        lm, display = load(model, a.device, a.dtype, a.attention)
        report["model"] = str(model)
        report["attention"] = {"tree_kernel": lm.model.gpu.tree is not None,
                               "flash_attn": lm.model.gpu.flash is not None, "notes": lm.model.gpu.notes}
        prompt = prompt_for(lm, a.random_prompt)
    if lm is not None:
        graphs = lm.model.gpu.tree is not None  # the static forward behind the graphs is built on the tree kernel
        sections_after_load(a, report, lm, display, model, prompt, graphs, t_start)
    if a.tp > 1:
        with section(report, f"tensor parallelism over {a.tp} ranks", a.out, t_start):
            report["tp"] = tp_check(work, a.device, a.tp, a.random_layers, a.tp_tokens,
                                    4 if a.draft_budget == "auto" else int(a.draft_budget))
    report["complete"] = True
    save(report, a.out, t_start)
    print((a.out / "gpu_check.md").read_text())
    subprocess.run(["rm", "-rf", str(work)], check=False)


SETTINGS = {"greedy": dict(temperature=0.0, min_p=0.0, penalty=1.2),
            "sample": dict(temperature=0.7, min_p=0.1, penalty=1.2, seed=7)}


def prompt_for(lm, random_ids: int = 64) -> list[int]:
    """The lighthouse brief as the novel template frames it, or `random_ids` random ids for a model without a
    tokenizer."""
    if lm.tok is None:
        g = torch.Generator().manual_seed(1)
        return torch.randint(100, min(lm.model.cfg.vocab_size, 20000), (random_ids,), generator=g).tolist()
    from swiftwrite.io.prompt import apply_template, prompt_ids

    return prompt_ids(lm.tok, apply_template((ROOT / "prompts" / "lighthouse.txt").read_text(), "novel"), False)


def equality(a, report: dict, lm, display, prompt: list[int], settings: dict, name: str, graphs: bool,
             note: str = "") -> None:
    """Speculative output (`--draft all`, eager, then from CUDA graphs where `graphs`) against plain output, each
    recorded under `name` as the first token where they part (None: equal throughout)."""
    plain, _, _ = run_engine(lm, display, prompt, a.equal_tokens, "none", settings, 1e9, a.draft_budget)
    spec, _, fwd = run_engine(lm, display, prompt, a.equal_tokens, "all", settings, 1e9, a.draft_budget)
    report["equality"][name + note] = {"tokens": a.equal_tokens, "first_divergence": first_divergence(spec, plain),
                                       "tokens_per_forward": round(len(spec) / fwd, 3) if fwd else None}
    if graphs:
        with graphs_on(lm):
            spec, _, _ = run_engine(lm, display, prompt, a.equal_tokens, "all", settings, 1e9, a.draft_budget)
        report["equality"][name + ", all with CUDA graphs"] = {"tokens": a.equal_tokens,
                                                               "first_divergence": first_divergence(spec, plain)}


def half_section(a, report: dict, model: Path, t_start: float) -> None:
    """Speculative against plain output in --half-dtype, where equality holds by construction if the start-up check
    passes (swiftwrite/tensors/exact.py: the products' piece sizes and pads measured on this GPU, single steps and trees
    through the same kernels); a run whose check fails drafts nothing, so its equality would be trivial: the
    check's verdict goes beside the figures. Then the row-invariance table of that forward (`invariance`)."""
    from swiftwrite.tensors.exact import check

    with section(report, f"equality in {a.half_dtype}", a.out, t_start):
        half, display = load(model, a.device, a.half_dtype, a.attention)
        prompt = prompt_for(half, a.random_prompt)
        why = check(half.model)
        report["exact_half"] = {"dtype": a.half_dtype, "check": why or "passed", "pieces": half.model.rows,
                                "pads": half.model.pads, "step_kernel": half.model.gpu.tree is not None,
                                "norm": half.model.norm.__module__}
        for name, s in SETTINGS.items():
            equality(a, report, half, display, prompt, s, f"{name} in {a.half_dtype}", half.model.gpu.tree is not None,
                     "" if why is None else " (check failed: no drafts)")
            save(report, a.out, t_start)
    # the table takes minutes through Triton's CPU interpreter: on a CPU only where the equality failed
    if a.device == "cuda" or a.invariance_only or any(v["first_divergence"] is not None for v in report["equality"].values()):
        with section(report, f"row invariance in {a.half_dtype}", a.out, t_start):
            report["invariance"] = invariance(half.model)


def sections_after_load(a, report: dict, lm, display, model: Path, prompt: list[int], graphs: bool,
                        t_start: float) -> None:
    settings = SETTINGS
    for name, s in settings.items():
        with section(report, f"equality, {name}", a.out, t_start):
            equality(a, report, lm, display, prompt, s, name, graphs)

    if a.half_dtype != "none" and a.half_dtype != dtype_name(lm.model.dtype):
        half_section(a, report, model, t_start)

    if graphs:
        with section(report, "forward cost, plain vs CUDA graphs", a.out, t_start):
            contexts = [min(int(c), lm.model.cfg.max_positions - 65) for c in a.cost_contexts.split(",")]
            report["forward_cost"] = forward_costs(lm, contexts, [int(n) for n in a.cost_sizes.split(",")],
                                                   reps=50 if a.device == "cuda" else 1)

    hf = None
    methods = ("hf", "none", "all", "none+graphs", "all+graphs") if graphs else ("hf", "none", "all")
    for n in (a.short, a.long) if a.long else (a.short,):  # --long 0: the short outputs alone
        for method in methods:
            if method == "hf" and n == a.long:
                continue  # generate has no context rebuild: past the window it would fail
            with section(report, f"speed {method} {n}", a.out, t_start):
                if method == "hf":
                    from transformers import AutoModelForCausalLM

                    if hf is None:
                        from swiftwrite.tensors.weightfiles import keep_float_copy

                        keep_float_copy(model if model.is_dir() else lm.ref.path)
                        hf = AutoModelForCausalLM.from_pretrained(str(model) if model.is_dir() else str(lm.ref.path),
                                                                  dtype=lm.model.dtype).to(a.device).eval()
                    x = torch.tensor([prompt], device=a.device)
                    m = min(n, lm.model.cfg.max_positions - len(prompt))
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m, min_new_tokens=m,
                                        do_sample=False, repetition_penalty=1.2, pad_token_id=0, max_time=a.budget_s)
                    if a.device == "cuda":
                        torch.cuda.synchronize()
                    secs, out, fwd = time.perf_counter() - t0, y[0, x.shape[1]:].tolist(), None
                elif method.endswith("+graphs"):
                    with graphs_on(lm):
                        out, secs, fwd = run_engine(lm, display, prompt, n, method.split("+")[0], settings["greedy"],
                                                    a.budget_s, a.draft_budget)
                else:
                    out, secs, fwd = run_engine(lm, display, prompt, n, method, settings["greedy"], a.budget_s,
                                                a.draft_budget)
                made = len(out)
                # quality beside speed: a speed-up that comes from a loop is not a speed-up
                report["speed"].append({
                    "method": method, "target_tokens": n, "tokens": made, "seconds": round(secs, 2),
                    "tokens_per_second": round(made / secs, 1), "tokens_per_forward": round(made / fwd, 3) if fwd else None,
                    "distinct_4": round(distinct_n(out, 4), 3), "longest_repeat": longest_repeat(out)})
                log(f"  {made / secs:.1f} tok/s")


if __name__ == "__main__":
    main()
