"""Errors the subcommands share."""

from __future__ import annotations

__all__ = ["ExportInputError"]


class ExportInputError(ValueError):
    """The model or calibration data cannot be read or do not fit each other (exit code 2)."""
