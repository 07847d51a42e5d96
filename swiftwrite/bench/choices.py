"""What `swiftwrite bench` can be asked for (its methods, settings and workloads) and the checks of a request.

No torch here: the command line refuses a mistyped method, a missing prompt or zero repeats at once, before
bench.py and the model code are imported (two seconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..base.errors import UsageError, UserError
from ..io.prompt import TEMPLATE_DIRS

# name -> the configuration fields it sets; None: a peer (transformers generate, llama.cpp's own loop on the same GGUF)
METHODS = {
    "hf": None,
    "hf-lookup": None,
    "llama.cpp": None,
    "llama.cpp-lookup": None,
    "none": dict(draft="none"),
    "recycling": dict(draft="recycling"),
    "recycling-static": dict(draft="recycling", static_tree=True),
    "ngram": dict(draft="ngram"),
    "heads": dict(draft="heads"),
    "heads-2pass": dict(draft="heads", head_mode="two-pass"),
    "all": dict(draft="all"),
    "all-2pass": dict(draft="all", head_mode="two-pass"),
    "all-b2": dict(draft="all", budget="2"),
    "all-b4": dict(draft="all", budget="4"),
    "all-b8": dict(draft="all", budget="8"),
    "all-b16": dict(draft="all", budget="16"),
}
QUICK = ["llama.cpp", "hf", "none", "all"]
DEFAULT = ["llama.cpp", "llama.cpp-lookup", "hf", "hf-lookup", "none", "recycling", "ngram", "heads", "all", "all-b4",
           "all-b16"]
PEERS = ("hf", "hf-lookup", "llama.cpp", "llama.cpp-lookup")
SETTINGS = {
    "greedy": dict(temperature=0.0, min_p=0.0, penalty=1.2),
    "sample": dict(temperature=0.7, min_p=0.1, penalty=1.2),
    "greedy-nopenalty": dict(temperature=0.0, min_p=0.0, penalty=1.0),
}


@dataclass(frozen=True)
class Workload:
    """What a user asks for: a brief (a file in prompts/), a template, and the document it draws on (--source)."""
    brief: str
    template: str
    source: str | None = None


# Creative text leaves drafts little to guess; text that draws on a supplied document leaves a lot (names,
# figures and whole phrases come back), which is where reuse of the prompt's n-grams should pay.
WORKLOADS = {
    "creative": Workload("lighthouse.txt", "novel"),
    "grounded": Workload("grid.txt", "report", "grid-source.md"),  # a report on a ~3,000-token briefing
    "revision": Workload("grid-revise.txt", "revise", "grid-draft.md"),  # rewrite a draft with light edits
    "structured": Workload("grid.txt", "structured", "grid-source.md"),  # tables and lists from the briefing
}


def workload(name: str) -> Workload:
    """A workload by name, or a prompt file (or path) with the template its name suggests and no source."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    return Workload(name, "report" if "report" in Path(name).name else "novel")


def validate(methods: list[str], settings: list[str], repeats: int, tokens: int, out: Path | None) -> None:
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise UsageError(f"unknown bench method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}.")
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        raise UsageError(f"unknown setting(s) {', '.join(bad)}; choose from {', '.join(SETTINGS)}.")
    if repeats < 1:
        raise UsageError(f"repeats must be at least 1 (got {repeats}).")
    if tokens < 1:
        raise UsageError(f"tokens must be at least 1 (got {tokens}).")
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise UserError(f"bench output directory {out} is not writable ({e.strerror}).") from None


def find_prompt(name: str) -> Path:
    """A file named in prompts/ (the checkout's or the installed templates), else the path as given."""
    return next((d / name for d in (Path("."), *TEMPLATE_DIRS) if (d / name).is_file()), Path(name))


def check_workloads(names: list[str]) -> None:
    missing = [str(find_prompt(f)) for n in names for f in (workload(n).brief, workload(n).source)
               if f and not find_prompt(f).is_file()]
    if missing:
        raise UsageError(f"prompt file(s) {', '.join(missing)} not found; give workloads ({', '.join(WORKLOADS)}), "
                         "files in prompts/ or paths.")
