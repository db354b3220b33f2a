"""Anomaly mode: find the first NaN or Inf and name the op and the user's line that made it.

Off by default, and then it costs one context-variable read per op. On, every forward value and
every cotangent is read back to the host and checked, which is slow and meant for debugging.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from contextvars import ContextVar

_enabled: ContextVar[bool] = ContextVar("tapegrad_detect_anomaly", default=False)


def anomaly_enabled() -> bool:
    return _enabled.get()


@contextmanager
def detect_anomaly(enabled: bool = True) -> Generator[None, None, None]:
    """Within this block, a NaN or Inf in a forward value or a cotangent raises AnomalyError."""
    token = _enabled.set(enabled)
    try:
        yield
    finally:
        _enabled.reset(token)
