"""Headless Chromium for the page tests: Debian's ``chromium`` driven by playwright (no browser is downloaded).

When either is missing the test fails and says how to install it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT_DIR_ENV = "POLYFHE_SCREENSHOT_DIR"  # set it to keep the screenshot beyond the test's tmp folder


def chromium_path() -> str:
    path = os.environ.get("POLYFHE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).is_file():
        pytest.fail("headless Chromium is needed for the web-page test and was not found: install Debian's "
                    "chromium (`sudo apt-get install chromium`, or run scripts/setup.sh as root) or point "
                    "POLYFHE_CHROMIUM at a Chromium binary", pytrace=False)
    return path


def playwright_api():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the web-page test needs playwright: pip install -e '.[dev,serve]' (the browser itself "
                    "comes from Debian's chromium package, not from playwright)", pytrace=False)
    return sync_playwright


@contextlib.contextmanager
def headless_page(home: Path, width: int, height: int):
    """(page, page errors) in a fresh headless Chromium whose HOME is ``home``; closed on exit."""
    executable, sync_playwright = chromium_path(), playwright_api()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS[1:],
                                    env={**os.environ, "HOME": str(home)})
        try:
            page = browser.new_context(viewport={"width": width, "height": height}).new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page, errors
        finally:
            browser.close()
