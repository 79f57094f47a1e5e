"""The web page in headless Chromium (Debian's ``chromium`` driven by playwright): cards, explanation, live stats.

Needs ``/usr/bin/chromium`` (``apt-get install chromium``; ``scripts/setup.sh`` installs it when it can) and
the ``playwright`` package (``pip install -e '.[dev,serve]'``); no browser is downloaded. When either is
missing the test fails and says how to install it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from browserlib import SCREENSHOT_DIR_ENV, headless_page
from serve_testlib import OTHER, TINY

pytestmark = pytest.mark.browser


def test_page_shows_model_cards_explanation_and_live_stats(server, tmp_path):
    shot = Path(os.environ.get(SCREENSHOT_DIR_ENV) or tmp_path) / "serve-page.png"
    with headless_page(tmp_path, 1200, 1000) as (page, errors):
        page.goto(server.url + "/")
        page.wait_for_selector(f".model-card[data-model='{TINY}']", timeout=30_000)
        page.wait_for_selector("#stats[data-updated]", timeout=30_000)
        cards = page.locator(".model-card")
        assert cards.count() == 2
        tiny = page.locator(f".model-card[data-model='{TINY}']").inner_text()
        assert "87.5 %" in tiny and "random 8x8" in tiny and "N=8192" in tiny and "3 / 3" in tiny
        other = page.locator(f".model-card[data-model='{OTHER}']").inner_text()
        assert "not known" in other and "scale 2^35" in other
        assert "cannot see" in page.locator("#cannot-see").inner_text()
        assert "secret key" in page.locator("#cannot-see").inner_text()
        stats = page.locator("#stats").inner_text()
        assert "sessions" in stats and "memory (RSS)" in stats and "inferences" in stats
        first = page.locator("#stats").get_attribute("data-updated")
        page.wait_for_function(f"document.getElementById('stats').dataset.updated !== '{first}'",
                               timeout=15_000)  # the statistics refresh by themselves
        assert server.url in page.locator("#client-cmd").inner_text()
        page.screenshot(path=str(shot), full_page=True)
        assert not errors, errors
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
