"""CPU-bound work (context loading, evaluation) on a bounded thread pool, off the event loop.

At most ``workers`` jobs run and ``queue`` wait; one more is refused at once with 503 and a Retry-After
estimated from recent job times, rather than piling up memory. A job that outlives its deadline answers 504,
but keeps its worker until it really ends (threads cannot be killed), so the bound stays true.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from polyfhe.serve.errors import ApiError

__all__ = ["WorkPool"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class WorkPool:
    def __init__(self, workers: int, queue: int) -> None:
        self.workers = workers
        self.capacity = workers + queue
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="polyfhe-serve")
        self._lock = threading.Lock()
        self.pending = 0  # admitted and not finished (running + waiting)
        self.running = 0
        self.rejected_total = 0
        self.timed_out_total = 0
        self._recent_s = 1.0  # moving average of job seconds, for Retry-After

    def stats(self) -> dict:
        with self._lock:
            return {"workers": self.workers, "capacity": self.capacity, "running": self.running,
                    "queued": self.pending - self.running, "rejected_total": self.rejected_total,
                    "timed_out_total": self.timed_out_total}

    def _retry_after(self) -> int:
        return max(1, math.ceil(self._recent_s * self.pending / self.workers))

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        with self._lock:
            self.running += 1
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            elapsed = time.perf_counter() - t0
            with self._lock:
                self.running -= 1
                self._recent_s = 0.8 * self._recent_s + 0.2 * elapsed

    def _finished(self, _future: Any) -> None:
        with self._lock:
            self.pending -= 1

    async def run(self, fn: Callable[..., T], *args: Any, deadline: float, what: str) -> T:
        """Run ``fn(*args)`` on a worker; 503 when full, 504 when ``deadline`` (loop time) passes first."""
        with self._lock:
            if self.pending >= self.capacity:
                self.rejected_total += 1
                raise ApiError(503, "server_busy",
                               f"all {self.workers} workers are busy and {self.capacity - self.workers} requests "
                               "are waiting; retry after the time in Retry-After",
                               retry_after=self._retry_after())
            self.pending += 1
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self._executor, self._call, fn, args)
        except BaseException:
            self._finished(None)
            raise
        future.add_done_callback(self._finished)
        remaining = deadline - loop.time()
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(remaining, 0.0))
        except TimeoutError:
            with self._lock:
                self.timed_out_total += 1
            log.warning("%s exceeded the request deadline; its worker is released when it ends", what)
            raise ApiError(504, "request_timeout",
                           f"{what} did not finish within the server's request timeout") from None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
