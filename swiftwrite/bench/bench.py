"""`swiftwrite bench`: every decoding method on the same prompts and settings, interleaved, side by side.

Each repeat runs every method once, in turn, so machine drift hits all of them alike; a method's speed is
its median over repeats. Speedups are ratios measured in the same process against two baselines:
swiftwrite's own plain decoding (`none`) and transformers `generate`. Every swiftwrite method is also
checked against `none` token for token (the first diverging position; None expected).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base.errors import UsageError
from ..base.options import OPTIONS, defaults
from ..base.hf import transformers
from ..base.metrics import distinct, distinct_n, first_divergence, longest_repeat, median, speedup
from ..io import prompt
from ..io.ui import Display
from ..models.backends import cpu_extensions, gguf_path, torch_capability
from ..models.peers import llamacpp_generate, load_llamacpp
from ..tensors.weightfiles import keep_float_copy
from ..run import assembly
from ..run.assembly import build_engine, fit_budget
from .choices import DEFAULT, QUICK  # noqa: F401 (bench.DEFAULT and QUICK: the command line reads them here)
from .choices import METHODS, PEERS, SETTINGS, WORKLOADS, check_workloads, find_prompt, validate, workload

PENALTY_WINDOW = defaults(OPTIONS)["penalty_window"]  # swiftwrite's; transformers' penalty counts the whole text


def workload_ids(tok, name: str) -> tuple[list[int], int]:
    """A workload's prompt ids and where its written text starts for the penalties (as assembly.text_start_for:
    with a source, after the prompt; without, 0)."""
    w = workload(name)
    brief = prompt.read_prompt(str(find_prompt(w.brief)))
    source = prompt.read_source(str(find_prompt(w.source))) if w.source else None
    ids = prompt.prompt_ids(tok, prompt.apply_template(brief, w.template, source), False)
    return ids, len(ids) if source else 0


@dataclass
class Result:
    method: str
    setting: str
    prompt: str
    seconds: list
    tokens: list  # ids of the last repeat
    forwards: int = 0
    per_source: dict | None = None
    draft_forwards: int = 0  # two-pass heads: the extra one-token forwards over the partial cache
    trace: list | None = None  # [tokens, seconds, forward passes] each time another TRACE_BIN tokens are out
    peak_mib: float | None = None  # resident high-water mark during the method's last repeat (whole process)


@dataclass
class One:
    seconds: float
    tokens: list
    forwards: int = 0
    per_source: dict | None = None
    draft_forwards: int = 0
    trace: list | None = None
    peak_mib: float | None = None


def _reset_peak_rss() -> None:
    """Linux: restart the process's resident high-water mark, so each method's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _peak_rss_mib() -> float | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError):
        pass
    return None


TRACE_BIN = 100  # tokens per point of the throughput / acceptance trace along the generated position
QUALITY_WINDOW = 500  # tokens of the sliding Distinct-4 at each trace point: a loop shows within it


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "isa": cpu_extensions(), "torch_kernels": torch_capability(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def run(methods: list[str], settings: list[str], prompts: list[str], tokens: int, repeats: int, out: Path | None,
        model: str = "smollm2-135m", log=print) -> dict:
    """`prompts`: workload names (WORKLOADS) or prompt files."""
    validate(methods, settings, repeats, tokens, out)
    check_workloads(prompts)
    display = Display("quiet")
    lm = assembly.open_model(assembly.settings(model=model), display)  # tokenizer and shape: the prompts are checked first
    prompt_ids, text_start = {}, {}
    for p in prompts:
        ids, start = workload_ids(lm.tok, p)
        if len(ids) + tokens > lm.mcfg.max_positions:
            raise UsageError(f"{p} ({len(ids)} tokens) plus {tokens} new tokens does not fit the model's "
                             f"{lm.mcfg.max_positions} positions; use fewer --tokens.")
        name = p if p in WORKLOADS else Path(p).name
        prompt_ids[name] = ids
        text_start[name] = start
    hf = None
    if any(m.startswith("hf") for m in methods):
        keep_float_copy(lm.ref.path)  # transformers reads safetensors: a GGUF store model's float copy
        hf = transformers().AutoModelForCausalLM.from_pretrained(str(lm.ref.path), dtype=torch.float32).eval()
    llamas = {}
    for method in [m for m in methods if m.startswith("llama.cpp")]:
        gguf = gguf_path(lm.ref.path)
        if gguf is None:
            raise UsageError(f"{method} runs the model's GGUF, and {lm.ref.path} holds none; leave it out of --methods.")
        llamas[method] = None  # loaded below, once the prompts' lengths are known
    assembly.load_weights(lm, display.info)
    context = max(len(ids) for ids in prompt_ids.values()) + tokens + 16
    for method in llamas:
        llamas[method] = load_llamacpp(gguf_path(lm.ref.path), torch.get_num_threads(), context,
                                       lookup=method.endswith("lookup"))
    peers = {"hf": hf, **llamas}
    # Warm-up, untimed: the first forwards of each shape pay for allocator and kernel set-up.
    first = next(iter(prompt_ids.values()))
    for method in {"none", "all", *(m for m in methods if m in PEERS)} & set(methods) | {"none"}:
        run_one(method, SETTINGS["greedy"], first, 16, lm, peers, display, 0)
    results: dict[tuple, Result] = {}
    for rep in range(repeats):
        for setting in settings:
            for pname, ids in prompt_ids.items():
                for method in methods:
                    r = results.setdefault((method, setting, pname), Result(method, setting, pname, [], []))
                    _reset_peak_rss()
                    o = run_one(method, SETTINGS[setting], ids, tokens, lm, peers, display, text_start[pname])
                    r.seconds.append(o.seconds)
                    r.tokens, r.forwards, r.per_source, r.draft_forwards, r.trace = \
                        o.tokens, o.forwards, o.per_source, o.draft_forwards, o.trace
                    r.peak_mib = _peak_rss_mib()
                    log(f"repeat {rep + 1}/{repeats} {setting:>16} {pname:>14} {method:>16}: {tokens / o.seconds:6.1f} tok/s")
    report = _report(results, methods, settings, prompt_ids, tokens, repeats, lm)
    if out is not None:
        (out / "bench.json").write_text(json.dumps(report, indent=1))
        (out / "bench.md").write_text(markdown(report))
        for png in plot(report, out):
            log(f"wrote {png}")
    return report


def run_one(method, setting, ids, n, lm, peers, display, text_start=0):
    """One generation of `n` tokens by `method` (a swiftwrite draft method, or a peer: hf, hf-lookup, llama.cpp,
    llama.cpp-lookup, loaded in `peers` by name) under `setting`."""
    if method.startswith("llama.cpp"):
        secs, toks = llamacpp_generate(peers[method], ids, n, setting)
        return One(secs, toks)
    hf = peers["hf"] if isinstance(peers, dict) else peers
    if method.startswith("hf"):
        kw = dict(max_new_tokens=n, min_new_tokens=n, repetition_penalty=setting["penalty"], pad_token_id=lm.tok.eos_token_id)
        if setting["temperature"] > 0:
            kw.update(do_sample=True, temperature=setting["temperature"], min_p=setting["min_p"] or None, top_k=None, top_p=None)
            torch.manual_seed(0)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if method == "hf-lookup":
            kw["prompt_lookup_num_tokens"] = 10
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.inference_mode():
            y = hf.generate(x, attention_mask=torch.ones_like(x), **kw)
        secs = time.perf_counter() - t
        return One(secs, y[0, len(ids):].tolist())
    cfg = assembly.settings(tokens=n, **METHODS[method], **setting)
    engine = build_engine(cfg, lm, len(ids), len(ids) + n, display, text_start)
    engine.start(ids)
    fit_budget(engine, lm, upto=len(ids) + n)
    per = {s.name: 0 for s in engine.sources}
    toks, trace = [], []
    t = time.perf_counter()
    for step in engine.run(n):
        toks += step.tokens
        for mask in step.accepted_sources:
            for s in engine.sources:
                per[s.name] += mask >> s.id & 1
        if len(toks) // TRACE_BIN > len(trace) or len(toks) == n:
            trace.append([len(toks), round(time.perf_counter() - t, 4), engine.forwards])
    secs = time.perf_counter() - t
    return One(secs, toks, engine.forwards, per, sum(getattr(s, "draft_forwards", 0) for s in engine.sources), trace)


def _report(results, methods, settings, prompt_ids, tokens, repeats, lm) -> dict:
    rows = []
    for (method, setting, pname), r in results.items():
        rate = tokens / median(r.seconds)
        base = results.get(("none", setting, pname))
        hf = results.get(("hf", setting, pname))
        llama = results.get(("llama.cpp", setting, pname))
        rows.append({
            "method": method, "setting": setting, "prompt": pname,
            "tokens_per_second": round(rate, 2),
            "seconds": [round(s, 2) for s in r.seconds],
            "speedup_vs_none": speedup(rate, tokens / median(base.seconds)) if base else None,
            "speedup_vs_generate": speedup(rate, tokens / median(hf.seconds)) if hf else None,
            "speedup_vs_llamacpp": speedup(rate, tokens / median(llama.seconds)) if llama else None,
            "mean_tokens_per_forward": round(tokens / r.forwards, 3) if r.forwards else None,
            "draft_forwards": r.draft_forwards,
            "trace": r.trace,
            "peak_rss_mib": r.peak_mib,
            "accepted_per_forward": {k: round(v / r.forwards, 3) for k, v in r.per_source.items()} if r.per_source else None,
            "first_divergence_vs_none": (first_divergence(r.tokens, base.tokens) if base and method not in PEERS else "n/a"),
            **distinct(r.tokens),
            "longest_repeat": longest_repeat(r.tokens),
            # beside the speed trace: a method that got faster because the text looped shows it here
            "trace_distinct_4": [round(distinct_n(r.tokens[max(0, n - QUALITY_WINDOW) : n], 4), 4)
                                 for n, *_ in r.trace] if r.trace else None,
        })
    return {
        "date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": lm.ref.name, "fingerprint": lm.ref.fingerprint,
        "backend": lm.backend,
        "tokens": tokens, "repeats": repeats, "prompts": {k: len(v) for k, v in prompt_ids.items()},
        "settings": {s: SETTINGS[s] for s in settings}, "penalty_window": PENALTY_WINDOW,
        "note": "hf methods: transformers generate, repetition_penalty over the whole sequence (swiftwrite: last "
                f"{PENALTY_WINDOW} tokens); llama.cpp methods: llama-cpp-python's own loop and sampler on the "
                "same GGUF (repeat penalty over its last 256 tokens, no DRY); "
                "peers' text differs, so no divergence check.",
        "rows": rows,
    }


def markdown(report: dict) -> str:
    head = ("| setting | prompt | method | tok/s | × none | × llama.cpp | × generate | tok/forward | accepted/forward | D-1 | "
            "D-4 | longest repeat | peak MiB | first diff |\n"
            "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|\n")
    lines = []
    for r in report["rows"]:
        acc = ", ".join(f"{k} {v}" for k, v in (r["accepted_per_forward"] or {}).items()) or "-"
        extra = f" (+{r['draft_forwards']} draft fwd)" if r.get("draft_forwards") else ""
        lines.append(f"| {r['setting']} | {r['prompt']} | {r['method']} | {r['tokens_per_second']} | {r['speedup_vs_none'] or '-'} | "
                     f"{r.get('speedup_vs_llamacpp') or '-'} | "
                     f"{r['speedup_vs_generate'] or '-'} | {r['mean_tokens_per_forward'] or '-'}{extra} | {acc} | {r['distinct_1']} | "
                     f"{r['distinct_4']} | {r.get('longest_repeat', '-')} | {r.get('peak_rss_mib') or '-'} | {r['first_divergence_vs_none']} |")
    m = report["machine"]
    meta = (f"{report['date']}, {m['cpu']} ({'/'.join(m.get('isa') or [])}; torch's kernels {m.get('torch_kernels', '?')}; "
            f"{m['cores']} cores, {m['torch_threads']} "
            f"threads), torch {m['torch']}, model {report['model']} on the {report.get('backend', 'torch')} backend, "
            f"{report['tokens']} new tokens, {report['repeats']} repeat(s), penalty window "
            f"{report['penalty_window']}.\n\n")
    return meta + head + "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> list[Path]:
    """Throughput, tokens per forward pass and Distinct-4 over the last QUALITY_WINDOW tokens along the
    generated position, one PNG per setting and prompt (from each method's last repeat). Needs matplotlib (`pip install swiftwrite[plot]`); without it, none."""
    try:
        import matplotlib  # optional (the plot extra): the bench's PNGs only

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional, as above
    except ImportError:
        return []
    made = []
    groups: dict[tuple, list] = {}
    for r in report["rows"]:
        if r.get("trace"):
            groups.setdefault((r["setting"], r["prompt"]), []).append(r)
    for (setting, prompt), rows in groups.items():
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
        for ax in (ax1, ax2, ax3):
            ax.set_prop_cycle(color=plt.cm.tab20.colors)  # a dozen methods: no two in one colour
        for r in rows:
            pts = [[0, 0.0, 0], *r["trace"]]
            x = [b[0] for b in pts[1:]]
            rate = [(b[0] - a[0]) / max(b[1] - a[1], 1e-9) for a, b in zip(pts, pts[1:])]
            tpf = [(b[0] - a[0]) / max(b[2] - a[2], 1) for a, b in zip(pts, pts[1:])]
            ax1.plot(x, rate, label=r["method"])
            ax2.plot(x, tpf, label=r["method"])
            if r.get("trace_distinct_4"):
                ax3.plot(x, r["trace_distinct_4"], label=r["method"])
        ax1.set(xlabel="generated tokens", ylabel=f"tokens/s (per {TRACE_BIN} tokens)", title=f"throughput, {setting}")
        ax2.set(xlabel="generated tokens", ylabel="tokens per forward pass", title=f"acceptance, {setting}")
        ax3.set(xlabel="generated tokens", ylabel=f"Distinct-4 of the last {QUALITY_WINDOW} tokens", ylim=(0, 1.02),
                title=f"text quality, {setting}")
        ax1.legend(fontsize=7)
        m = report["machine"]
        fig.suptitle(f"{report['model']} on {m['cpu']} ({m['torch_threads']} threads), {prompt}, {report['date']}", fontsize=9)
        fig.tight_layout()
        path = out / f"trace-{setting}-{Path(prompt).stem}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made
