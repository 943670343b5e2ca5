"""The errors the serving frontend raises before a request's first output; both front doors map them to a status."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """Too many requests in flight; retry after `retry_after_ms`."""

    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class UnavailableError(RuntimeError):
    """The server cannot take requests now: the model is loading, or the server is draining."""


class EngineFailedError(RuntimeError):
    """The engine failed; it serves nothing more."""
