"""``polyfhe --help`` and every subcommand's ``--help`` start light: building the parser imports no torch, onnx,
onnxruntime, TenSEAL, numpy, rich, engine or exporter (each costs seconds, or a noticeable part of one, on every
command), and the help a fresh process prints is the parser's, naming every subcommand and option.

A check of the imports, not of timings (bench/cli_startup.py times them). The parser's defaults that live in heavy
modules are mirrored in the command modules; the last tests hold the mirrors equal to their sources.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from polyfhe.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
WIDTH = "200"  # one terminal width for the fresh process and for the parser here, so the texts compare

# a module is heavy when its name is one of these or starts with one of them and a dot
HEAVY = ("torch", "onnx", "onnxruntime", "tenseal", "numpy", "scipy", "rich", "polyfhe.engines", "polyfhe.exporters",
         "polyfhe.training", "polyfhe.analysis", "polyfhe.models")

# runs `polyfhe ARGS` as the console script does (main() on sys.argv), then reports the help and sys.modules
_PROBE = """
import contextlib, io, json, sys
from polyfhe.cli import main
sys.argv = ["polyfhe", *json.loads(sys.argv[1])]
out, code = io.StringIO(), None
with contextlib.redirect_stdout(out):
    try:
        main()
    except SystemExit as exc:
        code = exc.code
print(json.dumps({"code": code, "help": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command's words and parser, the top level first, nested ones (``client keys create``) too."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _parser_for(path: tuple[str, ...]) -> argparse.ArgumentParser:
    return dict(_parsers(build_parser()))[path]


PATHS = [path for path, _ in _parsers(build_parser())]


def _probe(args: list[str]) -> dict:
    env = {**os.environ, "COLUMNS": WIDTH}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def test_the_registry_is_the_parsers_subcommands() -> None:
    assert [path[0] for path in PATHS if len(path) == 1] == list(COMMANDS)


@pytest.mark.parametrize("path", PATHS, ids=lambda path: " ".join(path) or "polyfhe")
def test_help_imports_nothing_heavy_and_prints_the_parsers_help(path: tuple[str, ...], monkeypatch) -> None:
    result = _probe([*path, "--help"])
    assert result["code"] == 0
    assert _heavy(result["modules"]) == [], f"`polyfhe {' '.join(path)} --help` imported heavy modules"
    monkeypatch.setenv("COLUMNS", WIDTH)
    parser = _parser_for(path)
    assert result["help"] == parser.format_help()
    for action in parser._actions:  # named: every option, positional and subcommand
        if action.help == argparse.SUPPRESS:
            continue
        for word in (*action.option_strings, *(action.choices or {} if isinstance(action, argparse._SubParsersAction)
                                               else ())):
            assert word in result["help"], f"`polyfhe {' '.join(path)} --help` does not name {word}"
        if not action.option_strings:  # a positional: shown by its metavar, else its choices, else its name
            shown = action.metavar or ("{" + ",".join(action.choices) + "}" if action.choices else action.dest)
            assert shown in result["help"], f"`polyfhe {' '.join(path)} --help` does not name {shown}"


def test_version_imports_nothing_heavy() -> None:
    result = _probe(["--version"])
    assert result["code"] == 0 and _heavy(result["modules"]) == []


# ------------------------------------------------------------------------------------- the parser's mirrors
def test_train_parser_shows_the_training_defaults_and_names() -> None:
    from dataclasses import fields

    from polyfhe.commands import train
    from polyfhe.training.config import AMP_MODES, TrainConfig
    from polyfhe.training.data import AUGMENTATIONS
    from polyfhe.training.recipe import OPTIMIZERS

    defaults = {f.name: f.default for f in fields(TrainConfig)}
    assert train._DEFAULTS == {name: defaults[name] for _, name, _, _ in train._OPTIONS}
    assert train.OPTIMIZER_NAMES == tuple(sorted(OPTIMIZERS))
    assert train.AUGMENTATION_NAMES == tuple(sorted(AUGMENTATIONS))
    assert train.AMP_MODES == AMP_MODES


def test_check_parser_offers_the_lowering_engines() -> None:
    from polyfhe.analysis.optable import LOWERING_ENGINES
    from polyfhe.commands import check

    assert check.LOWERING_CHOICES == tuple(sorted(LOWERING_ENGINES))


def test_export_parser_shows_the_compilers_budgets() -> None:
    from polyfhe.commands import ckks_options
    from polyfhe.exporters import ckks

    assert (ckks_options.BATCH_MEMORY_BUDGET, ckks_options.GALOIS_KEY_BUDGET) == (ckks.BATCH_MEMORY_BUDGET,
                                                                                 ckks.GALOIS_KEY_BUDGET)
