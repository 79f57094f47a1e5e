"""polyfhe.workers.child and .watchdog: a child's last words are kept (bounded), a hung child is killed by the
watchdog, a child out of step is killed, and the limits module applies its address-space cap."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from polyfhe.workers.child import Child
from polyfhe.workers.limits import address_space_argument
from polyfhe.workers.watchdog import Watchdog

HUNG = "import time\nwhile True:\n    time.sleep(1)\n"


def test_a_watchdog_kills_a_hung_child() -> None:
    child = Child([sys.executable, "-c", HUNG], label="hung child")
    try:
        t0 = time.monotonic()
        watchdog = Watchdog(child.pid, timeout_s=0.5, label="hung child")
        assert child.wait(timeout=30) == -9
        watchdog.stop()
        assert watchdog.tripped == "timeout" and time.monotonic() - t0 < 20
    finally:
        child.close()


def test_a_watchdog_kills_a_child_past_its_memory_limit() -> None:
    grow = "import time\nkeep = bytearray(200 << 20)\nkeep[::4096] = b'x' * len(keep[::4096])\ntime.sleep(60)\n"
    child = Child([sys.executable, "-c", grow])
    try:
        watchdog = Watchdog(child.pid, memory_limit=100 << 20)
        assert child.wait(timeout=30) == -9
        watchdog.stop()
        assert watchdog.tripped == "memory" and watchdog.peak > 100 << 20
    finally:
        child.close()


def test_a_watchdog_that_is_stopped_in_time_leaves_the_child_alone() -> None:
    child = Child([sys.executable, "-c", HUNG])
    try:
        watchdog = Watchdog(child.pid, timeout_s=30)
        watchdog.stop()
        assert child.alive and watchdog.tripped is None
    finally:
        child.close(timeout=0)
    assert not child.alive


def test_last_words_are_the_bounded_end_of_stderr_and_never_block_the_child() -> None:
    noisy = "import sys\nsys.stderr.write('x' * (4 << 20) + 'the end')\nsys.exit(3)\n"  # far past a pipe's buffer
    child = Child([sys.executable, "-c", noisy])
    try:
        assert child.wait(timeout=60) == 3
        words = child.last_words(100)
        assert len(words) == 100 and words.endswith("the end")
    finally:
        child.close()
    assert child.last_words() == ""


def test_a_child_out_of_step_is_killed() -> None:
    child = Child([sys.executable, "-c", HUNG])
    assert child.desync("a frame of 2**40 bytes") == -9
    assert not child.alive
    child.close()


def test_the_address_space_limit_is_applied_in_the_child() -> None:
    script = textwrap.dedent("""
        from polyfhe.workers.limits import address_space_limits, limit_address_space
        assert limit_address_space(1 << 30) == 1 << 30
        assert address_space_limits() == [1 << 30, 1 << 30]
        try:
            bytearray(2 << 30)
        except MemoryError:
            print("refused")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert out.stdout.strip() == "refused", out.stderr
    assert address_space_argument(["--address-space", "5"]) == 5 and address_space_argument([]) is None
