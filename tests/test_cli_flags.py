"""Every `pagedq` parser: help text on every argument, no abbreviated flags, and --version."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from pagedq.bench.cli import build_parser as bench_parser
from pagedq.engine.cli import build_parser as engine_parser
from pagedq.engine.options import engine_options
from pagedq.worker.cli.main import build_parser as pagedq_parser

REPO = Path(__file__).resolve().parents[1]


def walk(parser: argparse.ArgumentParser, path: str):
    """(command path, parser) for the parser and every sub-command below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, f"{path} {name}")


@pytest.mark.parametrize(
    "build, least",
    [(pagedq_parser, 14), (engine_parser, 2), (bench_parser, 6)],
    ids=["pagedq", "python -m pagedq.engine", "python -m pagedq.bench"],
)
def test_every_argument_has_help_and_no_parser_takes_abbreviations(build, least):
    parsers = list(walk(build(), "pagedq"))
    assert len(parsers) >= least  # every command and sub-command
    missing = [
        (path, action.option_strings or action.dest)
        for path, parser in parsers
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction))
        and not action.help
    ]
    assert missing == []
    assert [path for path, parser in parsers if parser.allow_abbrev] == []


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["generate", "hi", "--max-token", "5"], "--max-token"),
        (["bulk", "in.jsonl", "out.jsonl", "--no-prog"], "--no-prog"),
        (["worker", "--metrics-p", "9100"], "--metrics-p"),
        (["bench", "host", "--num-seq", "4"], "--num-seq"),
    ],
)
def test_an_abbreviated_flag_is_refused(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pagedq_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["pagedq.engine", "pagedq.bench", "pagedq.worker"])
def test_version_prints_the_package_version(module):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    proc = subprocess.run(
        [sys.executable, "-m", module, "--version"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"pagedq {version}"


def test_the_pagedq_script_is_the_services_entry_point():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"pagedq": "pagedq.worker.cli:main"}


@pytest.mark.parametrize("command", ["generate", "bench throughput", "bench worker", "demo", "worker"])
def test_every_engine_knob_is_a_flag_of_every_engine_command(command):
    parsers = dict(walk(pagedq_parser(), "pagedq"))
    flags = {flag for action in parsers[f"pagedq {command}"]._actions for flag in action.option_strings}
    shadowed = {"seed"} if command == "bench throughput" else set()  # its --seed seeds the workload
    knobs = {o.flag for o in engine_options(shadowed)}
    assert len(knobs) >= 14 and knobs <= flags
    assert "--no-enable-prefix-caching" in flags and "--no-async-scheduling" in flags


def test_engine_commands_are_the_same_in_both_parsers():
    engine_paths = {path for path, _ in walk(engine_parser(), "pagedq")}
    bench_paths = {path for path, _ in walk(bench_parser(), "pagedq bench")}
    assert engine_paths | bench_paths <= {path for path, _ in walk(pagedq_parser(), "pagedq")}
