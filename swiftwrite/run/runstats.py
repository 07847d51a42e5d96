"""What one process has written of a run, counted step by step (`RunStats`): the panel's progress line, the
checkpoints' stats, progress.jsonl and the stats JSON are all read from this one record (session.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..base.errors import UserError
from ..base.metrics import distinct_n
from ..decoding.engine import Step
from ..io.rundir import RunDir
from ..io.ui import QUALITY_WINDOW, WORDS_WINDOW


@dataclass
class RunStats:
    """What this process has written, counted step by step; the panel, checkpoints and stats JSON read it."""

    target: int  # tokens the document should reach
    done: int  # tokens in the document now (earlier processes included)
    per_source: dict[str, int]  # draft source name -> tokens accepted from it
    history: list = field(default_factory=list)  # earlier processes of this run, one dict each, oldest first
    made: int = 0  # tokens this process wrote
    forwards: int = 0
    forced: int = 0  # outline headings among `made`: committed without a forward, so not in tokens per forward
    drafted: int = 0  # draft nodes verified
    since: int = 0  # tokens since the last checkpoint
    checkpoints: int = 0
    last_checkpoint: float = 0.0  # time.time() of the last one
    tail: str = ""  # the latest text, for the panel
    repeat: int = 0  # the longest verbatim repeat the text is in now
    stopped: str | None = None  # why the run ended early: "loop", "signal"
    distinct_4: float | None = None
    distinct_1: float | None = None
    distinct_at: float = 0.0  # perf_counter() of the last Distinct measurement
    backtracks: int = 0  # banned phrases: times decoding went back, every process of the run
    t0: float = field(default_factory=time.perf_counter)
    # seconds and tokens per bucket of context length (runplan.BUCKET): what the next run's estimate reads
    rate_seconds: dict[int, float] = field(default_factory=dict)
    rate_tokens: dict[int, int] = field(default_factory=dict)
    last_step: float = 0.0  # perf_counter() at the last step's end (0: none yet)

    @classmethod
    def of(cls, rd: RunDir, target: int, sources) -> RunStats:
        prev = rd.stats or {}
        return cls(target, len(rd.tokens), {s.name: 0 for s in sources}, cls.history_of(prev),
                   backtracks=plain_int((prev.get("banned_phrases") or {}).get("backtracks"), 1 << 62))

    @staticmethod
    def history_of(prev: dict) -> list:
        """The earlier processes of a run, from its last checkpoint's stats: theirs, then the one that wrote it."""
        earlier = prev.get("earlier_processes")
        return [*(earlier if isinstance(earlier, list) else []),
                *([{k: prev.get(k) for k in ("tokens", "seconds", "forward_passes")}] if prev.get("tokens") else [])]

    def count(self, step: Step, sources) -> None:
        n = len(step.tokens)
        self.forwards += 0 if step.forced or not step.forward_tokens else 1  # end_text's step ran none
        self.forced += n if step.forced else 0
        self.drafted += step.drafted
        self.backtracks += step.backtracks
        self.made += n
        self.done += n
        self.since += n
        for mask in step.accepted_sources:
            for src in sources:
                if mask >> src.id & 1:
                    self.per_source[src.name] += 1

    def timed(self, bucket: int, n: int) -> None:
        """The time since the last step (its forward, commit and checkpoint) to `n` tokens at this context bucket;
        the first step's since the start of the loop."""
        now = time.perf_counter()
        self.rate_seconds[bucket] = self.rate_seconds.get(bucket, 0.0) + now - (self.last_step or self.t0)
        self.rate_tokens[bucket] = self.rate_tokens.get(bucket, 0) + n
        self.last_step = now

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def measure_distinct(self, tokens: list[int]) -> float | None:
        recent = tokens[-QUALITY_WINDOW:]
        self.distinct_4 = round(distinct_n(recent, 4), 4) if len(recent) >= 4 else None
        self.distinct_at = time.perf_counter()
        self.distinct_1 = round(distinct_n(recent[-WORDS_WINDOW:], 1), 3) if len(recent) >= WORDS_WINDOW else None
        return self.distinct_4


def plain_int(v, upper: int) -> int:
    """`v` if it is an int in [0, upper] (not a bool), else 0: for numbers read back from a checkpoint."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= upper else 0


def write_stats_json(path: Path, stats: dict, saved: str) -> None:
    """--stats-json: `stats` as JSON; where that fails, one sentence that ends with `saved` (where the work is)."""
    try:
        path.write_text(json.dumps(stats, indent=2))
    except OSError as e:
        raise UserError(f"could not write --stats-json {path} ({e.strerror}); {saved}") from None
