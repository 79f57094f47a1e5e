"""The error a malformed, unknown or tampered program raises (apart, so that every program module can raise it)."""

from __future__ import annotations

__all__ = ["ProgramError"]


class ProgramError(ValueError):
    """A program directory is missing, malformed or does not match its id."""
