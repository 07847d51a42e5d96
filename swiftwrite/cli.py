"""Command line: `swiftwrite generate`, `batch`, `resume`, `bench`, `train-heads`, `models list|pull|rm`.

Every option of a command is a row of a table in options.py (`with_options` makes them its parameters). Values
arrive as strings and are typed by `config.typed`, the same code that reads YAML and the environment, so a bad
value gets the same one-sentence error from every source. Errors a user can cause are printed as one line on
stderr with exit status 1 (2 for usage); never a traceback.
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

from .base import config as config_mod
from .base import options, rules
from .base.errors import RankLost, UsageError, UserError
from .base.options import OPTIONS, Option
from .batch import rayjoin
from .bench import choices
from .io import rundir
from .models import names
from .run import inputs

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Write long documents with a local language model, faster, token for token unchanged.")
models_app = typer.Typer(no_args_is_help=True, help="List and fetch models.")
app.add_typer(models_app, name="models")

Opt = typer.Option


def heavy() -> SimpleNamespace:
    """The modules behind the commands. They import torch and the model code (a second or more), which `--help`
    and a mistyped option never need: imported when a command runs, here only."""
    # heavy (torch): imported on a command's first use
    from .io import ui
    from .models import store
    from .batch import batch
    from .bench import bench
    from .run import ranks, writer
    from .training import train_heads

    return SimpleNamespace(batch=batch, bench=bench, ranks=ranks, store=store, train_heads=train_heads, ui=ui,
                           writer=writer)


def with_options(*tables: tuple[Option, ...], after: dict[str, tuple[str, ...]] | None = None):
    """Give a command the options of `tables` (options.py) besides its own parameters, its arguments. Typer reads
    parameters from a signature: the decorated function takes the rows as keyword arguments (**flags, None where
    not given) and this builds the signature Typer sees. A bool row is a flag (--raw), a tuple row repeatable, a
    Path row a path; any other is taken as a string, typed later (config.resolve for a run's options, `given` for a
    command's own), so a bad value gets the same sentence as from YAML or the environment. In --help the
    arguments come first, then the rows in their tables' order, but each row named in `after` right after the
    row that names it."""
    after = after or {}

    def row(o: Option) -> inspect.Parameter:
        if o.type is bool:
            info, kind = Opt(None, config_mod.flag(o.name), help=o.help), Optional[bool]
        elif o.type is tuple:  # repeatable: --ban A --ban B
            info, kind = Opt(None, metavar=o.metavar, help=o.help), Optional[list[str]]
        else:
            info, kind = Opt(None, metavar=o.metavar, help=o.help), Optional[Path if o.type is Path else str]
        return inspect.Parameter(o.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=info, annotation=kind)

    rows = {o.name: o for table in tables for o in table}
    placed = {name for names in after.values() for name in names}
    if len(rows) < sum(map(len, tables)) or not set(after) | placed <= set(rows):  # a parameter would vanish
        raise TypeError(f"with_options: a row is named twice, or `after` names one that no table has: {after}")

    def decorate(func):
        params = [p for p in inspect.signature(func).parameters.values() if p.kind is not p.VAR_KEYWORD]
        for o in rows.values():
            if o.name not in placed:
                params += [row(o), *(row(rows[name]) for name in after.get(o.name, ()))]
        func.__signature__ = inspect.Signature(params)
        return func

    return decorate


def given(table: tuple[Option, ...], flags: dict) -> SimpleNamespace:
    """A command's own options as it uses them: the table's default where one was not given, a number typed by
    config.typed (a bad one gets the sentence a run's option gets, naming its flag)."""
    out = {}
    for o in table:
        value = flags[o.name]
        if value is None:
            value = o.default
        elif o.type in (int, float):
            value = config_mod.typed(o.type, value, config_mod.flag(o.name))
        out[o.name] = value
    return SimpleNamespace(**out)


@app.command()
@with_options(OPTIONS, options.GENERATE, after={"tokens": ("out", "run_dir"), "raw": ("config",)})
def generate(
    prompt: str = typer.Argument(..., metavar="PROMPT", help="Prompt file, or - to read standard input."),
    **flags: Optional[str],
):
    """Write a document from a prompt, checkpointing into a run directory.

    Exit status: 0 written, 1 error, 2 bad usage, 3 stopped at a loop (--stop-on-loop), 130 / 143 interrupted;
    after 3 or 130 / 143, `swiftwrite resume RUN_DIR` continues.
    """
    own = given(options.GENERATE, flags)
    run = {o.name: flags[o.name] for o in OPTIONS}
    cfg = config_mod.resolve(own.config, run)
    here = heavy().ranks.current if "WORLD_SIZE" in os.environ else None  # as in main: torch only for a rank
    if here is not None:  # one rank of a group (torchrun, or a --tp launch): the group's size is the degree
        if run["tp"] is not None and cfg.tp != here.world:
            raise UsageError(rules.tp_against_world(cfg.tp, here.world))
        cfg = dataclasses.replace(cfg, tp=here.world).validate()
    elif cfg.tp > 1:
        m = heavy()
        m.ranks.check_world(cfg.tp, cfg.device)
        raise typer.Exit(m.ranks.launch(cfg.tp, sys.argv[1:]))
    # what the user typed, checked before torch is imported: a mistyped path is refused at once
    _check_json(own)
    given_input = inputs.read(cfg, prompt, own.run_dir, own.out, own.stats_json)
    names.kind(cfg.model)  # and what --model names, by its form and the disk (opening it is the writer's)
    raise typer.Exit(heavy().writer.generate(given_input, own.quiet, own.no_live, own.dry_run, own.json))


@app.command()
@with_options(OPTIONS, options.BATCH)
def batch(
    jobs: str = typer.Argument(..., metavar="JOBS", help="JSONL file, one document a line (- for standard input): "
                               "\"prompt\" (the brief, or a file), \"out\" (its file), any generate option by name."),
    **flags: Optional[str],
):
    """Write many documents from one loaded model, each a run of its own in --out-dir.

    A line's paths are read from the jobs file's folder; options on the command line are every document's defaults.
    Exit status: 0 all written, 1 one or more failed (the manifest says why), 2 bad usage, 3 one or more stopped at a
    loop, 130 / 143 interrupted (`swiftwrite resume DIR` continues).
    """
    own = given(options.BATCH, flags)
    if own.out_dir is None:
        raise UsageError("batch needs --out-dir DIR: a new directory for the manifest and each document's run.")
    parallel = _parallel(own.parallel, own.ray)
    _check_ray(own.ray)
    run = {o.name: flags[o.name] for o in OPTIONS}
    _check_json(own)
    jobs_read = inputs.read_jobs(jobs, own.config, run, own.out_dir)  # every line checked before anything heavy
    if own.dry_run:
        raise typer.Exit(heavy().writer.show_batch_plan(jobs_read, own.out_dir, own.quiet, own.json))
    rayjoin.check(own.ray, own.verbose)  # and the cluster: a refusal in a second or two, not after torch's import
    raise typer.Exit(heavy().batch.start(jobs_read, "standard input" if jobs == "-" else jobs, own.out_dir, own.quiet,
                                         own.no_live, own.stats_json, parallel, own.ray, own.verbose))


def _check_json(own) -> None:
    if own.json and not own.dry_run:
        raise UsageError("--json prints the plan of --dry-run; add --dry-run, or use --stats-json FILE for a run's "
                         "statistics.")


def _parallel(text: str, ray: str | None) -> int | str:
    """--parallel: a number of documents at a time, 1 or more, or auto (measured here: not for a Ray cluster's nodes)."""
    if text == "auto":
        if ray is not None:
            raise UsageError("--parallel auto measures this machine; with --ray give the documents at a time on each "
                             "node as a number (default 1).")
        return text
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--parallel {text}: give the number of documents to write at a time, 1 or more, or auto.")
    return int(text)


def _check_ray(address: str | None) -> None:
    """--ray's address, where given, is not empty (its form and whether its head takes us: rayjoin.check)."""
    if address is not None and not address.strip():
        raise UsageError("--ray needs an address: HOST:PORT of a Ray cluster's head, auto, or local to start one here.")


@app.command()
@with_options(options.RESUME)
def resume(run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="The run directory to continue (or a batch's "
                                                                        "--out-dir: every unfinished document)."),
           **flags):
    """Continue an interrupted run exactly where its last checkpoint left it."""
    o = given(options.RESUME, flags)
    if (run_dir / "manifest.json").is_file() and not (run_dir / "meta.json").exists():
        _resume_batch(run_dir, o)
    if o.ray is not None:
        raise UsageError(f"--ray continues a batch's directory on Ray; {run_dir} is one run: resume it without --ray.")
    if o.tokens is not None:
        config_mod.Config(tokens=o.tokens).validate({"tokens": "--tokens"})
    if o.tp is not None:
        config_mod.Config(tp=o.tp).validate({"tp": "--tp"})
    if o.threads is not None:
        config_mod.Config(threads=o.threads).validate({"threads": "--threads"})
    rundir.check_path(run_dir)  # a mistyped path refused at once, before torch's import (2 s)
    m = heavy()  # after the options are checked, as in generate
    here = m.ranks.current
    if here is not None and o.tp is not None and o.tp != here.world:
        raise UsageError(rules.tp_against_world(o.tp, here.world))
    recorded, device = m.ranks.recorded(run_dir)
    world = here.world if here is not None else o.tp or recorded
    if world != recorded and not o.force:
        raise UserError(f"{run_dir} was written by {recorded} tensor-parallel rank{'s' if recorded > 1 else ''}; on "
                        f"{world} every sum adds its parts in another order, so the text would continue differently. "
                        f"Resume with --tp {recorded}, or add --force to continue it on {world} anyway.")
    if here is None and world > 1:
        m.ranks.check_world(world, device)
        raise typer.Exit(m.ranks.launch(world, sys.argv[1:]))
    raise typer.Exit(m.writer.resume(run_dir, o.tokens, o.out, o.force, o.quiet, o.no_live, o.stats_json, world,
                                     o.edited, o.threads, memory=o.memory))


def _resume_batch(out_dir: Path, o: SimpleNamespace) -> None:
    """`resume DIR` on a batch's directory: every document that has not ended, each with its own settings."""
    for name in ("tokens", "out", "tp", "threads", "edited", "force", "memory"):
        if getattr(o, name) not in (None, False):
            raise UsageError(f"{config_mod.flag(name)} applies to one run; {out_dir} is a batch: resume one of its "
                             f"documents with `swiftwrite resume {out_dir}/runs/NAME {config_mod.flag(name)} ...`.")
    _check_ray(o.ray)
    rayjoin.check(o.ray, o.verbose)
    raise typer.Exit(heavy().batch.resume(out_dir, o.quiet, o.no_live, o.stats_json, o.ray, o.verbose))


@app.command()
@with_options(options.BENCH)
def bench(**flags):
    """Measure every decoding method side by side on this machine (interleaved, same prompts and settings)."""
    o = given(options.BENCH, flags)
    n = o.tokens if o.tokens is not None else (300 if o.quick else 2000)
    asked = o.methods.split(",") if o.methods else []  # none named: bench's own, below
    both = options.defaults(options.BENCH)["settings"]  # greedy and sample, unless --quick asks for greedy only
    setting_names = ["greedy"] if o.quick and o.settings == both else o.settings.split(",")
    # what the user typed, checked before torch is imported (bench.run checks it again, for its other callers)
    choices.validate(asked, setting_names, o.repeats, n, o.out)
    choices.check_workloads(o.prompts.split(","))
    b = heavy().bench
    methods = asked or (b.QUICK if o.quick else b.DEFAULT)
    report = b.run(methods, setting_names, o.prompts.split(","), n, o.repeats, o.out,
                   log=lambda m: print(m, file=sys.stderr, flush=True))
    print(b.markdown(report))


@app.command("train-heads")
@with_options(options.TRAIN_HEADS)
def train_heads(**flags):
    """Train TokenSwift multi-token heads on the frozen model (backbone states computed once, no autograd)."""
    m = heavy()
    o = given(options.TRAIN_HEADS, flags)
    ref = m.store.resolve(o.model, log=_say)
    m.train_heads.train(ref.path, data=o.data, self_distill=o.self_distill, out=o.out, log=_say, progress=True,
                        steps=o.steps, batch=o.batch, lr=o.lr, seq_len=o.seq_len)


@models_app.command("list")
def models_list():
    """Every alias and every model pulled here: where it is, its size and quantization, what runs it here."""
    m = heavy()
    head = ("name", "from", "quant", "local", "size", "runs on")
    rows = [(row.name, row.source, row.quant or "-", str(row.path) if row.path else "not pulled",
             m.ui.human_bytes(m.store.dir_size(row.path)) if row.path else "-",
             m.store.runs_on(row.path) if row.path else "-") for row in m.store.pulled()]
    if not sys.stdout.isatty():  # a pipe gets every name and path whole, a line a model, tab-separated
        print("\n".join("\t".join(r) for r in [head, *rows]))
        return
    t = Table(*head)
    for r in rows:
        t.add_row(*r)
    Console().print(t)


@models_app.command("pull")
@with_options(options.MODELS_PULL)
def models_pull(name: str = typer.Argument("smollm2-135m", metavar="NAME", help="An alias (`swiftwrite models "
                                           "list`), or a Hugging Face repository: user/repo or user/repo:QUANT."),
                **flags):
    """Fetch a model once: an alias's GGUF (its upstream checkpoint with --device cuda), or a Hub repository's
    GGUF of QUANT (default Q4_K_M) or safetensors checkpoint, into the Hugging Face cache and the store."""
    o = given(options.MODELS_PULL, flags)
    config_mod.Config(device=o.device).validate({"device": "--device"})
    names.to_pull(name)  # an alias or a Hub name, before torch is imported
    path = heavy().store.pull(name, log=_say, device=o.device)
    _say(f"{name} is ready in {path}")


@models_app.command("rm")
def models_rm(name: str = typer.Argument(..., metavar="NAME", help="An alias or a name `swiftwrite models list` "
                                         "shows.")):
    """Delete a model from this machine: its store entry, its files in the Hugging Face cache, its quantized copies."""
    m = heavy()
    gone, freed = m.store.remove(name)
    for path in gone:
        _say(f"removed {path}")
    _say(f"{name}: {m.ui.human_bytes(freed)} freed")


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
