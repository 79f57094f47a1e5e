"""``polyfhe ... | head``: a reader that leaves early ends the command quietly (exit 141), not with a traceback."""

from __future__ import annotations

import subprocess
import sys

from polyfhe import cli


def test_a_closed_pipe_ends_a_command_quietly(monkeypatch) -> None:
    from polyfhe.commands import models

    def writes_into_a_closed_pipe(_args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(models, "run", writes_into_a_closed_pipe)
    assert cli.main(["models"]) == cli.EXIT_BROKEN_PIPE


def test_a_real_pipe_closed_by_its_reader() -> None:
    """A real process whose reader closes the pipe after one line: no traceback on stderr."""
    code = ("import sys; from polyfhe import cli; import polyfhe.commands.models as m\n"
            "def flood(_a):\n"
            "    for i in range(200000):\n"
            "        print('row', i)\n"
            "m.run = flood\n"
            "sys.exit(cli.main(['models']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE, err.decode()[-2000:]
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()[-2000:]
