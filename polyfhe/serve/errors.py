"""One exception type for every refusal: an HTTP status, a short machine code and a sentence for people."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ApiError"]


@dataclass
class ApiError(Exception):
    """Raised anywhere in the server; the app turns it into ``{"error": code, "detail": ...}`` JSON."""

    status: int
    code: str
    detail: str
    retry_after: int | None = None  # seconds, sent as the Retry-After header (503)
    extra: dict = field(default_factory=dict)  # more JSON fields, e.g. the accepted values

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.detail}"

    def body(self) -> dict:
        out = {"error": self.code, "detail": self.detail, "status": self.status, **self.extra}
        if self.retry_after is not None:
            out["retry_after_s"] = self.retry_after
        return out

    def headers(self) -> dict[str, str]:
        out = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        if self.status == 401:
            out["WWW-Authenticate"] = "Bearer"
        return out
