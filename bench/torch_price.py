"""How close `auto`'s price of a torch step (backends.torch_step_ms: models of the first 1 and 8 layers, the line
through the two at the model's layer count) comes to timing the whole model, on this machine.

    python bench/torch_price.py --out bench/results/torch_price-DATE.json                 # the default model
    python bench/torch_price.py --model DIR --weights int4 --out ...                       # another store model

Alternates, `--reps` times: the whole model loaded and its plain step timed (backends.step_ms, what `auto` timed
before 2026-12-07), then the price. Each figure is a median of step_ms's 24 timed steps; the report has every
repetition, their medians and the price / whole ratio, with the machine and date beside them.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import common
from swiftwrite.models import backends
from swiftwrite.models.model import lean_config, load_lean, load_lean_layers
from swiftwrite.models.store import DEFAULT_MODEL, resolve

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", default=DEFAULT_MODEL)
ap.add_argument("--weights", default="float", choices=["float", "int8", "int4"])
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--out", default=None)
a = ap.parse_args()

torch.set_num_threads(a.threads)
ref = resolve(a.model)
layers = lean_config(ref.path).n_layers
whole, priced = [], []
for _ in range(a.reps):
    whole.append(backends.step_ms(load_lean(ref.path, weights=a.weights)))
    priced.append(backends.torch_step_ms(lambda k: load_lean_layers(ref.path, k, weights=a.weights), layers))
    print(f"whole {whole[-1]:.2f} ms, priced {priced[-1]:.2f} ms", flush=True)
report = {
    "date": common.now(), "machine": common.machine(), "model": ref.name, "layers": layers, "weights": a.weights,
    "threads": a.threads, "priced_from_layers": [1, min(layers, backends.PRICED_LAYERS)],
    "whole_ms": whole, "priced_ms": priced,
    "median_whole_ms": statistics.median(whole), "median_priced_ms": statistics.median(priced),
    "priced_over_whole": round(statistics.median(priced) / statistics.median(whole), 3),
}
common.write_report(a.out, report, indent=2, newline=True)
print({k: v for k, v in report.items() if k not in ("machine",)})
