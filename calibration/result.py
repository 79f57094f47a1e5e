"""``CalibrationResult``: what calibration measured, stored beside a checkpoint as ``calibration.json``.

The CKKS exporter reads the value ranges from here (scale and modulus headroom); JSON only, so the file can
be read without torch and never executes code on load.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyfhe.calibration.ranges import ValueRange

__all__ = ["CALIBRATION_FILE", "FORMAT_VERSION", "CalibrationResult"]

log = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CalibrationResult:
    """Ranges of the graph input and of every encrypted ONNX value, plus a summary of the running statistics.

    ``node_ranges`` is keyed by ONNX value name and includes the graph input; it is empty when calibration ran
    without ONNX profiling. ``stats_summary`` is :meth:`RunningStatsReport.to_dict` of the recalibration.
    """

    model_name: str
    num_samples: int
    input_range: ValueRange
    node_ranges: dict[str, ValueRange] = field(default_factory=dict)
    stats_summary: dict[str, Any] = field(default_factory=dict)

    @property
    def max_abs(self) -> float:
        """The largest magnitude any profiled value reached (the input's when no node was profiled)."""
        return max([self.input_range.abs_max, *(r.abs_max for r in self.node_ranges.values())])

    def range_of(self, name: str) -> ValueRange:
        try:
            return self.node_ranges[name]
        except KeyError:
            raise KeyError(f"no range recorded for ONNX value {name!r} ({len(self.node_ranges)} values "
                           "profiled); was the graph exported from the same calibrated model?") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model_name": self.model_name,
            "num_samples": self.num_samples,
            "input_range": self.input_range.to_dict(),
            "node_ranges": [r.to_dict() for r in self.node_ranges.values()],
            "stats_summary": self.stats_summary,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationResult:
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported calibration format_version {version!r} (this polyfhe reads "
                             f"{FORMAT_VERSION})")
        ranges = [ValueRange.from_dict(r) for r in data.get("node_ranges", [])]
        return cls(
            model_name=str(data["model_name"]),
            num_samples=int(data["num_samples"]),
            input_range=ValueRange.from_dict(data["input_range"]),
            node_ranges={r.name: r for r in ranges},
            stats_summary=dict(data.get("stats_summary") or {}),
        )

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/calibration.json`` (strict JSON) and return its path."""
        path = Path(directory) / CALIBRATION_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")
        log.info("wrote %s (%d value ranges)", path, len(self.node_ranges))
        return path

    @classmethod
    def load(cls, path: str | Path) -> CalibrationResult:
        """Read ``calibration.json`` from a checkpoint folder or from the file itself."""
        path = Path(path)
        if path.is_dir():
            path = path / CALIBRATION_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"no {CALIBRATION_FILE} at {path}; run `polyfhe calibrate` on the checkpoint"
            )
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc})") from exc
        return cls.from_dict(data)
