"""Counters behind ``/metrics`` (Prometheus text format) and ``/v1/stats`` (JSON for the web page)."""

from __future__ import annotations

import resource
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["LATENCY_BUCKETS", "Metrics", "rss_bytes"]

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident memory of this process in bytes (Linux /proc; peak from getrusage)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/statm") as fh:
            current = int(fh.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        current = 0
    return current, max(peak, current)


@dataclass
class Metrics:
    started: float = field(default_factory=time.time)
    requests: Counter = field(default_factory=Counter)  # (route, status) -> count
    bytes_in: int = 0
    bytes_out: int = 0
    inferences: int = 0
    infer_seconds: float = 0.0  # server-side evaluation, summed
    infer_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def transfer(self, received: int, sent: int) -> None:
        with self._lock:
            self.bytes_in += received
            self.bytes_out += sent

    def inference(self, seconds: float) -> None:
        with self._lock:
            self.inferences += 1
            self.infer_seconds += seconds
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self.infer_buckets[i] += 1

    def snapshot(self) -> dict:
        with self._lock:
            errors = sum(n for (_, status), n in self.requests.items() if status >= 400)
            return {"uptime_s": time.time() - self.started, "requests_total": sum(self.requests.values()),
                    "errors_total": errors, "inferences_total": self.inferences,
                    "mean_inference_s": self.infer_seconds / self.inferences if self.inferences else None,
                    "bytes_received_total": self.bytes_in, "bytes_sent_total": self.bytes_out}

    def prometheus(self, sessions: dict, workers: dict, models: int, host: dict | None = None) -> str:
        """The text exposition format, version 0.0.4."""
        current, peak = rss_bytes()
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {value:g}" for labels, value in samples)

        with self._lock:
            metric("polyfhe_requests_total", "counter", "HTTP requests by route and status.",
                   [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())])
            metric("polyfhe_received_bytes_total", "counter", "Request body bytes read.", [("", self.bytes_in)])
            metric("polyfhe_sent_bytes_total", "counter", "Ciphertext bytes returned.", [("", self.bytes_out)])
            cumulative = [(f'{{le="{b:g}"}}', n) for b, n in zip(LATENCY_BUCKETS, self.infer_buckets)]
            cumulative.append(('{le="+Inf"}', self.inferences))
            lines.append("# HELP polyfhe_inference_seconds Server-side evaluation time per inference.")
            lines.append("# TYPE polyfhe_inference_seconds histogram")
            lines.extend(f"polyfhe_inference_seconds_bucket{labels} {n}" for labels, n in cumulative)
            lines.append(f"polyfhe_inference_seconds_sum {self.infer_seconds:g}")
            lines.append(f"polyfhe_inference_seconds_count {self.inferences}")
        metric("polyfhe_sessions_active", "gauge", "Live sessions.", [("", sessions["active"])])
        metric("polyfhe_sessions_created_total", "counter", "Sessions opened.", [("", sessions["created_total"])])
        metric("polyfhe_sessions_expired_total", "counter", "Sessions dropped after their TTL.",
               [("", sessions["expired_total"])])
        metric("polyfhe_key_bytes", "gauge", "Public-context bytes held by sessions and uploads.",
               [("", sessions["key_bytes"])])
        metric("polyfhe_key_budget_bytes", "gauge", "Key memory budget.", [("", sessions["key_budget_bytes"])])
        metric("polyfhe_work_running", "gauge", "Jobs on the worker threads.", [("", workers["running"])])
        metric("polyfhe_work_queued", "gauge", "Jobs waiting for a worker.", [("", workers["queued"])])
        metric("polyfhe_work_rejected_total", "counter", "Requests refused with 503 (pool full).",
               [("", workers["rejected_total"])])
        metric("polyfhe_work_timed_out_total", "counter", "Jobs past the request timeout (504).",
               [("", workers["timed_out_total"])])
        metric("polyfhe_sessions_lost_total", "counter", "Sessions whose worker process ended.",
               [("", sessions.get("lost_total", 0))])
        if host and host.get("isolation") == "process":
            procs = host["processes"]
            metric("polyfhe_worker_processes_alive", "gauge", "Worker processes running.",
                   [("", sum(1 for w in procs if w["alive"]))])
            metric("polyfhe_worker_restarts_total", "counter", "Worker processes started again after one ended.",
                   [("", host["restarts_total"])])
        metric("polyfhe_models", "gauge", "Models served.", [("", models)])
        metric("process_resident_memory_bytes", "gauge", "Resident memory.", [("", current)])
        metric("polyfhe_peak_resident_memory_bytes", "gauge", "Peak resident memory.", [("", peak)])
        metric("process_start_time_seconds", "gauge", "Start time (Unix seconds).", [("", self.started)])
        return "\n".join(lines) + "\n"
