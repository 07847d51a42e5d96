"""Every option of a run is declared once, in swiftwrite/base/options.py: these tests fail when Config, the `generate`
command or the README's options table drift from that table."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer.main
from typer.testing import CliRunner

from swiftwrite import cli
from swiftwrite.base import options
from swiftwrite.base import config as config_mod
from swiftwrite.base.config import Config, flag
from swiftwrite.base.options import BY_NAME, OPTIONS
from swiftwrite.io.runfiles import META

README = Path(__file__).resolve().parent.parent / "README.md"
# Config fields that are no option of `generate` (set by code, never by a user): none yet
INTERNAL: set[str] = set()
# `generate`'s parameters that are not settings of the run: where the text goes, how progress shows, the YAML file
CLI_ONLY = {"prompt", "out", "run_dir", "config", "quiet", "no_live", "stats_json", "dry_run", "json"}
# options whose row the README's table still lacks: each is an expected failure until the row is written
README_PENDING: set[str] = set()


def generate_command():
    return typer.main.get_command(cli.app).commands["generate"]


def test_the_table_names_each_option_once():
    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names)) and not set(names) & CLI_ONLY


def test_config_fields_are_the_table_in_its_order_with_its_types_and_defaults():
    fields = [f for f in dataclasses.fields(Config) if f.name not in INTERNAL]
    assert [f.name for f in fields] == [o.name for o in OPTIONS]
    for f in fields:
        o = BY_NAME[f.name]
        assert (f.type, f.default) == (o.type, o.default), f.name
        assert type(getattr(Config(), f.name)) is o.type  # config.coerce types a value by its default's type
    assert Config().validate() == Config()  # the table's defaults are a valid configuration


def test_every_option_of_the_table_is_an_option_of_generate_with_its_help():
    params = {p.name: p for p in generate_command().params}
    assert set(params) == set(BY_NAME) | CLI_ONLY
    for o in OPTIONS:
        p = params[o.name]
        assert p.opts == [flag(o.name)] and not p.secondary_opts, o.name
        assert p.help == o.help, o.name
        assert p.default is None, o.name  # not given: YAML, the environment or the default decide
        assert p.is_flag == (o.type is bool), o.name
        if o.type is not bool:
            assert p.metavar == o.metavar, o.name
    shown = CliRunner().invoke(cli.app, ["generate", "--help"], terminal_width=200).output
    for o in OPTIONS:
        assert re.search(rf"^\s+{flag(o.name)}\b", shown, re.M), f"{flag(o.name)} missing from generate --help"


def test_generate_hands_every_option_of_the_table_to_resolve(monkeypatch):
    seen = {}

    def resolve(config_file, flags):
        seen.update(flags)
        raise RuntimeError("stop here")

    monkeypatch.setattr(cli, "heavy", lambda: SimpleNamespace())  # no torch: the command stops at resolve
    monkeypatch.setattr(config_mod, "resolve", resolve)
    result = CliRunner().invoke(cli.app, ["generate", "brief.txt", "--tokens", "5", "--raw", "--top-p", "0.9"])
    assert str(result.exception) == "stop here", result.output
    assert list(seen) == [o.name for o in OPTIONS]
    assert {k: v for k, v in seen.items() if v is not None} == {"tokens": "5", "raw": True, "top_p": "0.9"}


def test_a_default_named_in_a_help_line_is_the_tables():
    """"(default 0.7)", "default auto", "1 = off (default)", "fused (default)": the value must be the default."""
    for o in OPTIONS:
        said = (re.findall(r"\bdefault ([\w.\\]+)", o.help)  # "(default 0.7)", "default auto"
                + re.findall(r"([\w.\\-]+)(?: = [^;()]*)? \(default\)", o.help))  # "1 = off (default)"
        for word in said:
            if o.type in (int, float):
                assert float(word) == o.default, (o.name, o.help)
            else:
                assert word == str(o.default), (o.name, o.help)


def readme_rows() -> list[str]:
    """The first cells of the table under "Options of `generate`" in README.md."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Options of `generate`"))
    rows, inside = [], False
    for line in lines[start:]:
        if line.startswith("|"):
            inside = True
            rows.append(line.split("|")[1].strip())
        elif inside:
            break
    return rows[2:]  # past the header and the |---| line


def readme_flags() -> set[str]:
    return {f for cell in readme_rows() for f in re.findall(r"--[a-z][a-z0-9-]*", cell)}


@pytest.mark.parametrize("name", [
    pytest.param(o.name, marks=pytest.mark.xfail(reason="README.md's options table has no row for it yet"))
    if o.name in README_PENDING else o.name for o in OPTIONS])
def test_the_readme_table_names_every_option(name):
    assert flag(name) in readme_flags(), f"README.md: the table under 'Options of `generate`' lacks {flag(name)}"


def test_the_readme_table_names_only_options_of_generate():
    known = {flag(n) for n in set(BY_NAME) | CLI_ONLY}
    assert readme_rows(), "README.md: no table under 'Options of `generate`'"
    assert readme_flags() <= known, f"README.md names options `generate` does not have: {readme_flags() - known}"
    assert README_PENDING <= set(BY_NAME)


# ---------------------------------------------------------------------------------------------------------
# The commands' own options: each declared once, in a table of options.py, as a run's are

COMMANDS = {"generate": OPTIONS + options.GENERATE, "resume": options.RESUME, "bench": options.BENCH,
            "train-heads": options.TRAIN_HEADS}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_row_of_a_commands_table_is_one_of_its_options_with_its_help(name):
    table = COMMANDS[name]
    assert len({o.name for o in table}) == len(table), "a row is declared twice"
    params = {p.name: p for p in typer.main.get_command(cli.app).commands[name].params if p.param_type_name == "option"}
    assert set(params) == {o.name for o in table}
    for o in table:
        p = params[o.name]
        assert p.opts == [flag(o.name)] and p.help == o.help and p.default is None, o.name  # None: not given
        assert p.is_flag == (o.type is bool), o.name
        if o.type is not bool:
            assert p.metavar == o.metavar, o.name
    shown = CliRunner().invoke(cli.app, [name, "--help"], terminal_width=200)
    assert shown.exit_code == 0 and all(re.search(rf"^\s+{flag(o.name)}\b", shown.output, re.M) for o in table)


@pytest.mark.parametrize("name", ["resume", "bench", "train-heads"])
def test_a_default_named_in_a_commands_help_line_is_the_tables(name):
    for o in COMMANDS[name]:
        for word in re.findall(r"\bdefault ([\w.,-]+[\w])", o.help):
            if o.default is not None:
                assert word == str(o.default), (o.name, o.help)


def heavy_stub(seen: dict) -> SimpleNamespace:
    """The modules behind the commands, replaced by recorders (no torch, no model)."""
    def keep(what):
        return lambda *a, **k: seen.setdefault(what, (a, k)) and 0

    return SimpleNamespace(
        ranks=SimpleNamespace(current=None, recorded=lambda run_dir: (1, "cpu")),
        writer=SimpleNamespace(resume=keep("resume")),
        bench=SimpleNamespace(QUICK=["quick"], DEFAULT=["default"], run=keep("bench"), markdown=lambda report: ""),
        store=SimpleNamespace(resolve=lambda model, log: SimpleNamespace(path=model)),
        train_heads=SimpleNamespace(train=keep("train")))


def test_train_heads_passes_the_tables_defaults_and_types_lr_as_a_number(monkeypatch):
    from swiftwrite.training import train_heads  # torch: only this test needs the real signature

    seen = {}
    monkeypatch.setattr(cli, "heavy", lambda: heavy_stub(seen))
    assert CliRunner().invoke(cli.app, ["train-heads", "--self-distill"]).exit_code == 0
    (model,), kw = seen.pop("train")
    asked = inspect.signature(train_heads.train).parameters
    assert model == "smollm2-135m" and kw["self_distill"] is True
    for o in options.TRAIN_HEADS:
        if o.name in ("steps", "batch", "lr", "seq_len"):  # the command's default is train()'s
            assert kw[o.name] == o.default == asked[o.name].default and type(kw[o.name]) is o.type
    CliRunner().invoke(cli.app, ["train-heads", "--data", "d.txt", "--lr", "0.05", "--steps", "7"])
    assert seen["train"][1]["lr"] == 0.05 and seen["train"][1]["steps"] == 7
    result = CliRunner().invoke(cli.app, ["train-heads", "--lr", "fast"])
    assert str(result.exception) == "--lr must be a number, got 'fast'."


def test_resume_and_bench_type_their_numbers_and_fill_their_defaults(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli, "heavy", lambda: heavy_stub(seen))
    (tmp_path / META).write_text("{}")  # a run directory by its look: resume refuses any other before heavy()
    CliRunner().invoke(cli.app, ["resume", str(tmp_path), "--tokens", "50", "--quiet"])
    (run_dir, tokens, out, force, quiet, no_live, stats_json, world, edited, threads), _ = seen.pop("resume")
    assert (tokens, out, force, quiet, no_live, stats_json, world, edited, threads) == \
        (50, None, False, True, False, None, 1, None, None)
    result = CliRunner().invoke(cli.app, ["resume", str(tmp_path), "--tokens", "many"])
    assert str(result.exception) == "--tokens must be a whole number, got 'many'."
    CliRunner().invoke(cli.app, ["bench", "--quick"])
    (methods, settings, prompts, n, repeats, out), _ = seen.pop("bench")
    assert (methods, settings, prompts, n, repeats, out) == (["quick"], ["greedy"], ["creative"], 300, 1, None)
    CliRunner().invoke(cli.app, ["bench", "--repeats", "3", "--out", str(tmp_path)])
    (methods, settings, prompts, n, repeats, out), _ = seen.pop("bench")
    assert (methods, settings, n, repeats, out) == (["default"], ["greedy", "sample"], 2000, 3, tmp_path)
