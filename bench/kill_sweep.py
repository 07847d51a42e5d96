"""Kill anywhere: start a real `swiftwrite generate` in a subprocess, SIGKILL it at a random moment, resume,
and check that the run directory ends with exactly the tokens and text of an uninterrupted run, and exactly
--tokens of them.

    python bench/kill_sweep.py --kills 40 --out bench/results/kill_sweep-YYYY-MM-DD.json

The machinery is tests/killsweep.py (tests/test_kill_sweep.py runs a small sweep in CI). The model is a
tiny random Llama (tests/tiny.py: 2 layers, hidden 64) with the default model's tokenizer, so
a run takes seconds and a sweep of a hundred kills takes minutes on a CPU. Its LM head is zero outside ~40
ids taken from an English sentence (with CJK and an emoji in it, so characters span tokens) and sharpened
inside them: the output repeats itself the way real text does, so both draft sources get tokens accepted and
steps commit several tokens at once (the case that could run past --tokens or a checkpoint). The tokenizer
files are copied from the default model (`store.locate`, pulled once if absent, or --tokenizer-from DIR).

For each kill point, per mode (greedy, and seeded sampling; the penalty is on and drafting is `all` in
both), the kinds cycle through (W: the reference run's wall time, R: when its run directory appeared)
    plain   SIGKILL after a delay drawn uniformly from a seeded RNG over [0, W];
    loop    over [0, W - R] after the run directory appears: the writing loop, its checkpoints and the exit
            (on the tiny model, loading is most of W);
    slow    the same over [0, W - R + the pauses], with SWIFTWRITE_SLOW_CHECKPOINT (every state.json.tmp
            waits before its rename), so a good share of the kills lands inside a checkpoint write;
    double  as loop, then the resume killed over [0, W] from its start, then resumed again;
plus --create-kills per mode that kill the moment the run directory's staging directory appears (inside
RunDir.create, which builds the run in a hidden sibling and renames it into place).
Each kill is classified by what the run directory held once the process was dead: no directory yet (killed
while loading), only a staging directory (killed inside RunDir.create), a *.tmp file (inside a
checkpoint write), no checkpoint yet, between checkpoints, or after the final checkpoint. The run is then
completed the way a user would: `swiftwrite resume DIR` (a fresh `generate` when there is no run directory
to resume). A second variant repeats the sweep with --context 128 and enough tokens for many context
rebuilds, so kills and resumes fall on both sides of rebuilds.

Checks per kill point: tokens.bin (int32 little-endian) and output.txt equal the reference, the text that
`resume --out` writes equals it, len(tokens) == --tokens, the final checkpoint is finished with
n_tokens == --tokens, and at every kill tokens.bin held no more than --tokens ids. Any failure is a
mismatch; the exit status is 1 if there is one.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import common

ks = common.from_tests("killsweep")


def machine() -> dict:
    m = common.machine()
    m["load_average_at_end"] = m["load_average"]  # the field's name in earlier reports
    return m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=40, help="kill points per mode (greedy, sampled) (default 40)")
    ap.add_argument("--tokens", type=int, default=300, help="tokens per run (default 300)")
    ap.add_argument("--chunk", type=int, default=16, help="tokens between checkpoints (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (default 0)")
    ap.add_argument("--slow", type=float, default=0.2, help="SWIFTWRITE_SLOW_CHECKPOINT of the slow kills (default 0.2)")
    ap.add_argument("--context", type=int, default=128, help="--context of the rebuild variant (default 128)")
    ap.add_argument("--context-tokens", type=int, default=600, help="tokens per run of the rebuild variant (default 600)")
    ap.add_argument("--context-kills", type=int, default=None, help="kill points per mode of the rebuild variant "
                    "(default kills/4; 0 skips the variant)")
    ap.add_argument("--create-kills", type=int, default=1, help="extra kill points per mode that kill as soon as "
                    "the run directory appears, inside RunDir.create (default 1)")
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="model directory to copy the tokenizer from "
                    "(default: the default model, pulled once if absent)")
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one, removed "
                    "unless a point failed)")
    ap.add_argument("--weights", default="auto", choices=("auto", "float", "int8", "int4"),
                    help="--weights of every run: int8 / int4 sweep the quantized path (default auto)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    a = ap.parse_args(argv)
    if min(a.kills, a.create_kills, a.context_kills or 0) < 0 or min(a.tokens, a.chunk, a.context_tokens) < 1:
        ap.error("--kills, --create-kills and --context-kills must be >= 0; --tokens, --chunk, --context-tokens >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the running child is killed too
    tok_dir = a.tokenizer_from or ks.tokenizer_source()
    work = a.work or Path(tempfile.mkdtemp(prefix="swiftwrite-kill-sweep-"))
    report = None
    try:
        report = ks.sweep(work, tok_dir, kills=a.kills, tokens=a.tokens, chunk=a.chunk, seed=a.seed, slow=a.slow,
                          context=a.context, context_tokens=a.context_tokens, context_kills=a.context_kills,
                          create_kills=a.create_kills, weights=a.weights,
                          log=lambda m: print(m, file=sys.stderr, flush=True), machine=machine,
                          command=" ".join([Path(sys.executable).name, *sys.argv]))
    finally:
        if a.work is None:
            if report is not None and not report["mismatches"]:
                shutil.rmtree(work, ignore_errors=True)
            else:  # the run directories of the failed points are the evidence
                print(f"kill sweep: the working directory {work} is kept", file=sys.stderr)
    common.write_report(a.out, report, newline=True)
    print(ks.summary(report))
    return 1 if report["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
