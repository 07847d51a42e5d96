"""What the user sees on standard error: a Rich live panel on a terminal, plain progress lines otherwise.

The panel subscribes to `Progress` snapshots from the writer; it never touches the engine. Standard output
carries only the generated text, so pipelines stay clean.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, Progress as Bar, TextColumn
from rich.table import Table
from rich.text import Text

from ..decoding.repetition import LOOP_WARN


@dataclass
class Progress:
    done: int  # new tokens written in this run (resumed ones included)
    target: int
    seconds: float  # generation time of this process
    tokens_this_process: int
    forwards: int
    per_source: dict = field(default_factory=dict)  # name -> tokens accepted from it
    budget: str = ""
    kv_bytes: int = 0
    rss_bytes: int = 0
    checkpoints: int = 0
    last_checkpoint: float = 0.0  # time.time() of the last one
    tail: str = ""  # the latest text
    distinct_4: float | None = None  # Distinct-4 of the last QUALITY_WINDOW tokens; None until first measured
    repeat: int = 0  # the longest verbatim repeat the text is in now (repetition.LoopWatch), 0 = none
    distinct_1: float | None = None  # Distinct-1 of the last WORDS_WINDOW tokens; None until measured
    section: tuple | None = None  # outline runs: (k, N, title, tokens written in it, its budget)
    round: int = 1  # rounds of writing: 2 and up after `resume --edited` (rounds.py)
    backtracks: int | None = None  # banned phrases: times decoding went back (None: no phrase banned)
    lore: tuple | None = None  # --lore: the entries pinned at the last rebuild (None: no lore file)


@dataclass
class BatchProgress:
    """A batch's progress (batch.py): its documents, its tokens, and the documents being written now."""

    finished: int  # documents that ended (written, stopped at a loop, or failed) of `total`
    total: int
    failed: int
    tokens: int  # tokens this process and its workers wrote, every document's
    tokens_left: int  # what the unfinished documents still have to write
    seconds: float  # the batch's writing time
    weakest: str  # the finished document with the lowest Distinct-4, and its figures ("" while none)
    writing: tuple = ()  # (name, Progress) of each document being written


QUALITY_WINDOW = 2000  # tokens the live Distinct-4 looks back: recent enough to show a loop as it starts
# Distinct-1 over the last 500 tokens shows the two failures Distinct-4 and the repeat miss: word salad (lists
# of words, glued words: 0.85-1.0 on the default model) and a template loop (one sentence with a word swapped:
# under 0.3); its prose reads 0.55-0.7 (README "Long texts"). Model-dependent, so shown, never acted on.
WORDS_WINDOW = 500


def eta(left: int, rate: float) -> str:
    """Time to write `left` tokens at `rate` tokens/s, as h:mm:ss; -:--:-- while no rate is known."""
    if left <= 0:
        return "0:00:00"
    if rate <= 0:
        return "-:--:--"
    s = round(left / rate)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _d4(p: Progress) -> str:
    return "-" if p.distinct_4 is None else f"{p.distinct_4:.3f}"


def _d1(p: Progress) -> str:
    return "-" if p.distinct_1 is None else f"{p.distinct_1:.2f}"


def _section_line(p: Progress) -> str:
    if not p.section:
        return ""
    k, n, title, written, budget = p.section
    return f"  section {k}/{n} {title[:40]!r} {written}/{budget}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> "bfloat16", the spelling of --dtype."""
    return str(dtype).removeprefix("torch.")


class Display:
    """live: Rich panel; plain: a line every `every` seconds; quiet: nothing."""

    def __init__(self, mode: str, every: float = 5.0, heard: list[str] | None = None):
        self.mode = mode
        self.heard = heard  # where given, every info line is also kept here (--dry-run's notes)
        self.every = every
        self.console = Console(file=sys.stderr, no_color=bool(os.environ.get("NO_COLOR")), highlight=False)
        self._live = None
        self._last = 0.0
        self._recent: deque[tuple[float, int]] = deque(maxlen=64)

    @staticmethod
    def choose(quiet: bool, no_live: bool) -> str:
        if quiet:
            return "quiet"
        return "live" if sys.stderr.isatty() and not no_live else "plain"

    def info(self, msg: str) -> None:
        if self.heard is not None:
            self.heard.append(msg)
        if self.mode == "quiet":
            return
        self.alert(msg)

    def alert(self, msg: str) -> None:
        """A line the user must see, even with --quiet (a loop, a stop): above the live panel if there is one."""
        if self.mode == "live":
            self.console.print(msg, markup=False)
        else:
            print(msg, file=sys.stderr, flush=True)

    def start(self) -> None:
        if self.mode == "live":
            self._live = Live(console=self.console, refresh_per_second=4, transient=False)
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _rates(self, p: Progress) -> tuple[float, float]:
        now = time.perf_counter()
        self._recent.append((now, p.tokens_this_process))
        t0, n0 = self._recent[0]
        recent = (p.tokens_this_process - n0) / (now - t0) if now > t0 else 0.0
        avg = p.tokens_this_process / p.seconds if p.seconds > 0 else 0.0
        return recent, avg

    def update(self, p: Progress, force: bool = False) -> None:
        if self.mode == "quiet":
            return
        recent, avg = self._rates(p)
        now = time.monotonic()
        if self.mode == "plain":
            if force or now - self._last >= self.every:
                self._last = now
                tpf = p.tokens_this_process / p.forwards if p.forwards else 0.0
                print(f"[swiftwrite] {p.done}/{p.target} tokens  {avg:.1f} tok/s  {tpf:.2f} tok/forward  "
                      f"left {eta(p.target - p.done, recent)}  D-4 {_d4(p)}  D-1/{WORDS_WINDOW} {_d1(p)}  repeat {p.repeat}  "
                      f"checkpoints {p.checkpoints}  rss {human_bytes(p.rss_bytes)}" + _section_line(p)
                      + (f"  round {p.round}" if p.round > 1 else "")
                      + (f"  banned-phrase backtracks {p.backtracks}" if p.backtracks is not None else "")
                      + (f"  lore {', '.join(p.lore)[:60] or 'none'}" if p.lore is not None else ""),
                      file=sys.stderr, flush=True)
            return
        if self._live is not None and (force or now - self._last >= 0.25):
            self._last = now
            self._live.update(self._render(p, recent, avg))

    def batch(self, b: BatchProgress, force: bool = False) -> None:
        """The batch's line (plain) or panel (live): documents, aggregate tokens/s, time left, the weakest text."""
        if self.mode == "quiet" or not (force or time.monotonic() - self._last >= (0.25 if self._live else self.every)):
            return
        self._last = time.monotonic()
        rate = b.tokens / b.seconds if b.seconds > 0 else 0.0
        rows = [("documents", f"{b.finished}/{b.total} finished" + (f", {b.failed} failed" if b.failed else "")),
                ("tokens/s", f"{rate:.1f} over the batch, {b.tokens:,} tokens"),
                ("left", f"{eta(b.tokens_left, rate)} ({b.tokens_left:,} tokens)"),
                ("weakest text", b.weakest or "-")]
        for name, p in b.writing:
            rows.append(("writing", f"{name}: {p.done}/{p.target} tokens, Distinct-4 {_d4(p)}, Distinct-1 "
                                    f"{_d1(p)}, verbatim repeat {p.repeat}"))
        if self._live is None:
            print("[swiftwrite batch] " + "  ".join(f"{k} {v}" for k, v in rows), file=sys.stderr, flush=True)
            return
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        for k, v in rows:
            t.add_row(k, v)
        self._live.update(Panel(t, title="swiftwrite batch", border_style="cyan"))

    def _render(self, p: Progress, recent: float, avg: float):
        # rich's TimeRemainingColumn needs the task's own timing; the recent rate is the better estimate anyway
        bar = Bar(TextColumn("writing"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn(f"{eta(p.target - p.done, recent)} left"))
        bar.add_task("w", total=p.target, completed=p.done)
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        tpf = p.tokens_this_process / p.forwards if p.forwards else 0.0
        t.add_row("tokens/s", f"{recent:.1f} recent, {avg:.1f} average")
        t.add_row("tokens/forward", f"{tpf:.2f}" + (f"   budget {p.budget}" if p.budget else ""))
        if p.per_source and p.forwards:
            t.add_row("per source", "  ".join(f"{k} {v / p.forwards:.2f}" for k, v in p.per_source.items()))
        t.add_row("elapsed", f"{p.seconds:.0f} s")
        if p.round > 1:
            t.add_row("round", f"{p.round} (continued from the edited text)")
        if p.section:
            k, n, title, written, budget = p.section
            t.add_row("section", f"{k} of {n}: {title[:60]}   {written:,}/{budget:,} tokens")
        looping = p.repeat >= LOOP_WARN
        t.add_row("text", Text(f"Distinct-4 {_d4(p)} (last {QUALITY_WINDOW:,} tokens), Distinct-1 {_d1(p)} (last "
                               f"{WORDS_WINDOW}), verbatim repeat {p.repeat} tokens" + ("  LOOPING" if looping else ""),
                               style="bold red" if looping else ""))
        if p.backtracks is not None:
            t.add_row("banned", f"went back {p.backtracks} times to avoid a banned phrase")
        if p.lore is not None:
            t.add_row("lore", ", ".join(p.lore)[:100] if p.lore else "none in the context")
        t.add_row("memory", f"KV cache {human_bytes(p.kv_bytes)}, process {human_bytes(p.rss_bytes)}")
        ago = f", last {time.time() - p.last_checkpoint:.0f} s ago" if p.checkpoints else ""
        t.add_row("checkpoints", f"{p.checkpoints}{ago}")
        tail = Text(p.tail[-240:].replace("\n", " ⏎ "), style="dim")
        return Panel(Group(bar, t, tail), title="swiftwrite", border_style="cyan")

    def plan(self, rows: list[tuple[str, str, str]], title: str, header: tuple[str, str, str] = ("what", "plan", "why")
             ) -> None:
        """A run's plan (runplan.RunPlan.rows): what, the choice, why. Shown even with --quiet: it is what
        --dry-run was asked for (its JSON goes to stdout)."""
        t = Table(title=title, show_header=True, expand=False)
        for name in header:
            t.add_column(name)
        for what, value, why in rows:
            t.add_row(what, value, why)
        Console(file=sys.stderr, no_color=bool(os.environ.get("NO_COLOR")), highlight=False, width=160).print(t)

    def summary(self, stats: dict) -> None:
        if self.mode == "quiet":
            return
        t = Table(title="swiftwrite run", show_header=False)
        for key in ("tokens", "seconds", "tokens_per_second", "forward_passes", "mean_tokens_per_forward", "budget"):
            if key in stats:
                v = stats[key]
                t.add_row(key, f"{v:.2f}" if isinstance(v, float) else str(v))
        for name, s in stats.get("per_source", {}).items():
            t.add_row(f"accepted from {name}", f"{s['accepted_tokens']} ({s['tokens_per_forward']:.2f}/forward)")
        if "distinct" in stats:
            t.add_row("Distinct-1..4", " / ".join(f"{v:.3f}" for v in stats["distinct"].values()))
        if "longest_repeat" in stats:
            t.add_row("longest repeat", f"{stats['longest_repeat']} tokens")
        if stats.get("stopped"):
            t.add_row("stopped", str(stats["stopped"]))
        t.add_row("peak memory", human_bytes(stats.get("peak_rss_bytes", 0)))
        if stats.get("resolved"):  # what the run resolved its settings to (runplan.RunPlan.resolved)
            r = stats["resolved"]
            t.add_row("ran on", f"{r['backend']}, {r['device']}/{r['dtype']}, {r['weights']} weights, "
                                f"{r['threads'] or 'governed'} threads, {r['context']}-token context")
            t.add_row("drafting", ", ".join(r["drafting"]) + f" (budget {r['budget']})" if r["drafting"]
                      else "off: " + r["drafting_off"] if r["drafting_off"] else "none")
        if self.mode == "live":
            self.console.print(t)
        else:
            Console(file=sys.stderr, no_color=True, force_terminal=False, highlight=False).print(t)
