"""The CKKS exporter's docstring names every pass of ``PASSES``, in order: a reader's map of the compiler that
cannot fall behind it (it had listed fewer passes than ran)."""

from __future__ import annotations

import re

from polyfhe.exporters import ckks
from polyfhe.exporters.ckks import pipeline


def test_docstring_lists_every_pass_in_order() -> None:
    doc = ckks.__doc__ or ""
    listed = re.findall(r"``(\w+)``(?=\s*\(|\s*->|\.)", doc.split("in this order:", 1)[1].split("checks this list", 1)[0])
    assert listed == [p.name for p in pipeline.PASSES]
