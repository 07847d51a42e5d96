#!/usr/bin/env bash
# What a batch spends per document outside the prompt's prefill and the writing itself: 4 documents of 50 tokens
# at --parallel 1 (the default model, default settings, seeds 1-4) against one `generate` process of the first.
#   per document = (batch wall - generate's fixed cost - the 4 documents' writing and prefill) / 4
# where generate's fixed cost = its wall - its writing - its prefill (start-up, model load, probe: paid once by both).
# Run it alone (two benchmarks on two cores measure each other); prints the machine, then one line a round.
set -euo pipefail
prompt="$(cd "$(dirname "$0")/.." && pwd)/prompts/lighthouse.txt"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
for s in 1 2 3 4; do echo "{\"prompt\": \"$prompt\", \"out\": \"d$s.md\", \"seed\": $s}"; done > jobs.jsonl
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores," \
     "ISA $(grep -o -w -E 'avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')$(date -Is)"
for round in 1 2 3; do
    rm -rf g b ./*.md ./*.json
    t0=$(date +%s.%N)
    swiftwrite generate "$prompt" --tokens 50 --seed 1 --run-dir g --out g.md --quiet --stats-json g.json
    t1=$(date +%s.%N)
    swiftwrite batch jobs.jsonl --out-dir b --tokens 50 --parallel 1 --quiet --stats-json b.json
    t2=$(date +%s.%N)
    python3 - "$t0" "$t1" "$t2" <<'PY'
import json, sys
t0, t1, t2 = map(float, sys.argv[1:])
g, b = json.load(open("g.json")), json.load(open("b.json"))
fixed = (t1 - t0) - g["seconds"] - g["prefill_seconds"]
docs = b["per_document"]
writing = sum(d["seconds"] for d in docs) + len(docs) * g["prefill_seconds"]  # the same prompt: the same prefill
per = ((t2 - t1) - fixed - writing) / len(docs)
print(f"generate {t1 - t0:.2f} s (writing {g['seconds']:.2f}, prefill {g['prefill_seconds']:.2f}, fixed {fixed:.2f}); "
      f"batch of {len(docs)} {t2 - t1:.2f} s (writing {sum(d['seconds'] for d in docs):.2f}); "
      f"outside prefill and writing: {per:.3f} s a document")
PY
done
