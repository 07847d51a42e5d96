"""Text quality of finished (or stopped) run directories, from their token files: what a reader would notice
that Distinct-4 and the longest verbatim repeat do not.

    python bench/text_quality.py runs/long-100k-dry runs/dry_sweep/off-novel-sample-s0 ... \\
        --out bench/results/text_quality-DATE.json

Per run: tokens written, Distinct-1..4 and the longest verbatim repeat of the whole text and of every
--segment tokens, and Distinct-1 over every 500 tokens. This model's prose reads 0.55-0.7 there; word salad
(lists of words without sentences, glued words, emoji) 0.85-1.0, and a template loop ("The light was going
to be water. ... The light was going to be fire. ...") under 0.3. Both failures leave Distinct-4 high and the
longest repeat short, so a run can look healthy by those two and be unreadable. Per 500 tokens of decoded text
too: the glued share (`metrics.glued_share`: characters in 'words' of 17+ letters; 0 for prose, 0.3-0.6 where
words run together without spaces) and the capitalised share (`metrics.capitalised_share`: words starting with
a capital; 0.05-0.15 for prose, 0.3-0.6 in streams of Capitalised Words), with where each first passes 0.15
and 0.25. A run written from an outline gets the same per section too: its title, where its heading starts,
its length against its budget, whether its heading sits at a paragraph or sentence boundary, and how often the
heading's line occurs in the whole text (1 = only where it was forced; the outline is in the prompt, so the model
may write a heading itself). Reads the token files and the default model's tokenizer: no model runs.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import common
from swiftwrite.base.metrics import capitalised_share, distinct, distinct_per_window, glued_share, longest_repeat
from swiftwrite.io.rundir import RunDir

WINDOW = 500


def quality(run: Path, segment: int) -> dict:
    with RunDir.open(run) as rd:
        toks, config, outline = list(rd.tokens), dict(rd.config), rd.outline
    d1 = distinct_per_window(toks, WINDOW)
    segs = [{"from": a, "to": min(a + segment, len(toks)), "longest_repeat": longest_repeat(toks[a : a + segment]),
             **distinct(toks[a : a + segment])} for a in range(0, len(toks), segment)]
    keys = ("temperature", "min_p", "penalty", "penalty_window", "penalty_by", "context", "weights", "dry_multiplier", "dry_base", "dry_allowed_length",
            "dry_window", "seed", "template", "draft")
    return {"run": str(run), "tokens": len(toks), "settings": {k: config.get(k) for k in keys},
            "longest_repeat": longest_repeat(toks), **distinct(toks),
            f"distinct_1_per_{WINDOW}": d1,
            f"first_{WINDOW}_window_over_0.85": next((i * WINDOW for i, x in enumerate(d1) if x > 0.85), None),
            **text_shares(toks), "segments": segs, **({"sections": sections(toks, outline)} if outline else {})}


def sections(toks: list[int], outline: dict) -> list[dict]:
    """Per section of an outlined run: where the rule put its heading (replayed from the tokens, as resume does),
    its length against its budget, and the text measures of what the model wrote under it."""
    from swiftwrite.run import schedule

    plan = schedule.Plan.from_json(outline)
    sched = schedule.Schedule(plan, schedule.ender_ids(tokenizer(), len(tokenizer())))
    sched.replay(toks)
    starts = sched.starts + [len(toks)]
    full = tokenizer().decode(toks)
    out = []
    for k, (sec, budget) in enumerate(zip(plan.sections, plan.budgets)):
        if k >= len(sched.starts):
            break
        a, b = starts[k], starts[k + 1]
        body = toks[a + len(plan.headings[k]) : b]
        body_text = tokenizer().decode(body)
        before = tokenizer().decode(toks[max(0, a - 1) : a]) if a else ""
        out.append({"section": k + 1, "title": sec.title, "start": a, "tokens": b - a, "budget": budget,
                    "within_10_percent": abs((b - a) - budget) <= 0.1 * budget,
                    # the forced heading once, plus any time the model wrote the same line itself
                    "heading_occurrences": full.count(tokenizer().decode(plan.headings[k]).strip()),
                    "heading_after": "start" if a == 0 else ("paragraph" if "\n" in before else
                                                             "sentence" if schedule.is_ender(before) else "cut"),
                    "longest_repeat": longest_repeat(body), **distinct(body),
                    "glued_share": glued_share(body_text), "capitalised_share": capitalised_share(body_text)})
    return out


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    from swiftwrite.models.store import DEFAULT_MODEL, pull

    return AutoTokenizer.from_pretrained(pull(DEFAULT_MODEL))


def text_shares(toks: list[int]) -> dict:
    """Glued and capitalised shares of each whole WINDOW-token stretch, and where each first passes its mark."""
    texts = [tokenizer().decode(toks[lo : lo + WINDOW]) for lo in range(0, len(toks) - WINDOW + 1, WINDOW)]
    glued, caps = [glued_share(t) for t in texts], [capitalised_share(t) for t in texts]
    return {f"glued_share_per_{WINDOW}": glued, f"capitalised_share_per_{WINDOW}": caps,
            "first_glued_over_0.15": next((i * WINDOW for i, x in enumerate(glued) if x > 0.15), None),
            "first_capitalised_over_0.25": next((i * WINDOW for i, x in enumerate(caps) if x > 0.25), None)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--segment", type=int, default=10_000)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = [quality(r, a.segment) for r in a.runs]
    for r in rows:
        print(f"{Path(r['run']).name}: {r['tokens']} tokens, longest repeat {r['longest_repeat']}, Distinct-4 "
              f"{r['distinct_4']}, Distinct-1 per {WINDOW}: {r[f'distinct_1_per_{WINDOW}']}, glued > 0.15 from "
              f"{r['first_glued_over_0.15']}, capitalised > 0.25 from {r['first_capitalised_over_0.25']}")
    common.write_report(a.out, {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows})


if __name__ == "__main__":
    main()
