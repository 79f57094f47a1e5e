"""Progress bars for the commands: tqdm on stderr, drawn only when stderr is a terminal (``disable=None``), so logs,
pipes, CI and ``--json`` output stay clean."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["UploadProgress", "echo", "progress_bar"]


def progress_bar(total: int | None, desc: str, unit: str = "it", enabled: bool = True, **kwargs: Any) -> Any:
    """A transient bar on stderr; quiet (a no-op) when stderr is not a terminal or ``enabled`` is false."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=None if enabled else True, file=sys.stderr,
                dynamic_ncols=True, **kwargs)


def echo(text: str) -> None:
    """Print a line on stdout without tearing a bar drawn on the same terminal."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)


class UploadProgress:
    """``progress(sent, total)`` for :class:`~polyfhe.serve.http_client.ServeClient`: a bytes bar, made on the
    first chunk (the body's size is known only then) and closed with the last."""

    def __init__(self, desc: str) -> None:
        self.desc = desc
        self._bar: Any = None

    def __call__(self, sent: int, total: int) -> None:
        if self._bar is None:
            self._bar = progress_bar(total, self.desc, unit="B", unit_scale=True, unit_divisor=1024)
        self._bar.update(sent - self._bar.n)
        if sent >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
