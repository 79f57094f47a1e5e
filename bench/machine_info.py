"""Machine details every benchmark prints beside its table, so numbers are read against the hardware."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    if Path("/proc/cpuinfo").is_file():
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        if names:
            return names[0]
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """CPU, cores (all and usable), 1-minute load average, Python and platform."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "load_avg_1m": os.getloadavg()[0], "python": platform.python_version(),
            "platform": platform.platform()}
