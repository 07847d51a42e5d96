"""What matching banned phrases and patterns costs per token, apart from the model: a finished run's tokens pushed
through `Bans` alone, once while the patterns' DFA is still being made (cold), then five times more (warm: the
fastest of the five, the machine's other work least in it).

    python bench/ban_cost.py RUN_DIR --ban-file bans.txt --out bench/results/ban_cost-DATE.json

RUN_DIR: a `swiftwrite generate` run directory (its tokens.bin and prompt); the ban file as `--ban-file` reads it
(phrases, and patterns on `re:` lines). A position where a ban matches is passed over (the token is not appended),
as only the cost is asked. The tokenizer is the default model's from the model store unless `--model` names a
folder. Machine, date and figures go in the JSON.
"""

from __future__ import annotations

import argparse
import array
import json
import time
from pathlib import Path

import common
from transformers import AutoTokenizer

from swiftwrite.base.paths import home
from swiftwrite.base.patterns import check_patterns
from swiftwrite.decoding.bans import Bans, check_phrases, read_ban_file, split_lines, token_bytes


def per_token(bans: Bans, prompt: list[int], ids: list[int]) -> float:
    """Microseconds a token, pushing `ids` after `prompt`."""
    bans.reset(len(prompt), prompt)
    t0 = time.perf_counter()
    for t in ids:
        bans.push(bans.floor + len(bans.state) - 1, t)
    return (time.perf_counter() - t0) * 1e6 / len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--ban-file", required=True)
    ap.add_argument("--model", type=Path, default=None, help="a model folder with its tokenizer")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model or home() / "models" / "smollm2-135m")
    ids = array.array("i")
    ids.frombytes((a.run_dir / "tokens.bin").read_bytes())
    prompt = json.loads((a.run_dir / "meta.json").read_text())["prompt_ids"]
    phrases, patterns = split_lines(read_ban_file(a.ban_file))
    table = token_bytes(tok, len(tok))
    rows = {}
    for name, ph, pt in (("patterns", (), check_patterns(patterns)), ("phrases", check_phrases(phrases), ())):
        if not ph and not pt:
            continue
        bans = Bans(ph, table, pt)
        cold = per_token(bans, prompt, list(ids))
        warm = min(per_token(bans, prompt, list(ids)) for _ in range(5))  # the least disturbed of five
        rows[name] = {"count": len(ph) + len(pt), "us_per_token_cold": round(cold, 2), "us_per_token_warm": round(warm, 2),
                      **({"dfa_states": sum(len(m.states) for m in bans.match)} if bans.match else {})}
        print(f"{name}: {rows[name]}")
    common.write_report(a.out, {"run_dir": str(a.run_dir), "tokens": len(ids), "ban_file": a.ban_file, "rows": rows,
                                "date": common.now()})


if __name__ == "__main__":
    main()
