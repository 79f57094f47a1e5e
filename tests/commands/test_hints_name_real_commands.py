"""Every command a message of polyfhe names (a backticked ``polyfhe ...`` in the library's text) must run: its
subcommands exist, each flag it names belongs to that subcommand, and it names no more positionals than the
subcommand takes. A hint such as `polyfhe serve PROGRAMS_DIR`, when ``serve`` takes ``--programs DIR``, fails here.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from polyfhe.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "polyfhe", ROOT / "export", ROOT / "models", ROOT / "calibration"]
HINT = re.compile(r"`(polyfhe [a-z][^`]*)`")
JOINED = re.compile(r"""["']\s*\n\s*[rf]?["']""")  # implicit concatenation of string literals across lines
FIELD = re.compile(r"\{[^{}]*\}")  # an f-string field: one value


def _hints() -> list[tuple[str, str]]:
    found = set()
    for folder in SOURCES:
        for path in folder.rglob("*.py"):
            for hint in HINT.findall(JOINED.sub("", path.read_text())):
                found.add((FIELD.sub("VALUE", hint), str(path.relative_to(ROOT))))
    return sorted(found)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _check(hint: str) -> None:
    words = hint.split()[1:]
    parser = build_parser()
    path = ["polyfhe"]
    while words and words[0] in _subparsers(parser):
        path.append(words[0])
        parser = _subparsers(parser)[words.pop(0)]
    options = {s for a in parser._actions for s in a.option_strings}
    positionals = [a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    takes_many = any(a.nargs in ("*", "+", argparse.REMAINDER) for a in positionals)
    named = []
    skip_value = False
    for word in words:
        if word.startswith("--"):
            flag = word.split("=")[0]
            assert flag in options, f"{' '.join(path)} has no option {flag} (it has {sorted(options)})"
            action = next(a for a in parser._actions if flag in a.option_strings)
            skip_value = action.nargs != 0 and "=" not in word
            continue
        if skip_value:
            skip_value = False
            continue
        if word in ("...", "[--path", "DIR]") or word.startswith("["):
            continue
        named.append(word)
    if _subparsers(parser) and named:
        pytest.fail(f"{hint!r}: {' '.join(path)} has subcommands {sorted(_subparsers(parser))}, not {named[0]!r}")
    if not takes_many:
        assert len(named) <= len(positionals), (f"{hint!r} names {len(named)} positional argument(s) {named}; "
                                                f"{' '.join(path)} takes {[a.dest for a in positionals]}")


@pytest.mark.parametrize(("hint", "where"), _hints())
def test_every_command_a_message_names_parses(hint: str, where: str) -> None:
    if "/" in hint.split()[1]:  # "polyfhe run/serve/export": prose about several commands
        for command in hint.split()[1].split("/"):
            _check(f"polyfhe {command}")
        return
    _check(hint)


def test_a_wrong_hint_is_caught() -> None:
    with pytest.raises(AssertionError, match="takes"):
        _check("polyfhe serve PROGRAMS_DIR")
    with pytest.raises(AssertionError, match="no option"):
        _check("polyfhe serve --programs-dir DIR")
