"""Anomaly mode: find the first NaN or Inf and name the op and the user's line that made it.

Off by default, and then it costs one context-variable read per recorded op and one per
backward: nothing is read back to the host. On (`with tg.detect_anomaly():`, or
`tg.backward(..., check_finite=True)` for one sweep: the forward values its loss depends on),
every float forward value and every cotangent is read back to the host and checked, which is
slow and meant for debugging:

- a forward value: `AnomalyError` names the op and the user's line that recorded it;
- a forward value found by `backward` (`check_finite`, when anomaly mode was off while
  recording): the first in recording order among those the loss depends on;
- a cotangent (`backward`): names the node whose VJP produced it (op and line), the operand it
  was flowing to, or the node whose summed cotangent overflowed; a NaN/Inf seed is named too;
- a recorded backward (`backward_on_tape`, whose VJP steps are ops on the tape): the failing step
  is checked like any forward value, and the error also names the node whose VJP was running.

Leaves are inputs, not computed values, and are not checked (an `-inf` mask is a normal input).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

_enabled: ContextVar[bool] = ContextVar("tapegrad_detect_anomaly", default=False)


def anomaly_enabled() -> bool:
    return _enabled.get()


@contextmanager
def detect_anomaly(enabled: bool = True) -> Generator[None, None, None]:
    """Within this block, a NaN or Inf in a forward value or a cotangent raises AnomalyError."""
    from ._errors import flag

    token = _enabled.set(flag("detect_anomaly", "enabled", enabled))
    try:
        yield
    finally:
        _enabled.reset(token)


# Set while anomaly mode reads a value to check it: tg.jit lets such reads through where it
# runs a step eagerly, and refuses them in a recording (a program cannot replay a check).
_checking: ContextVar[bool] = ContextVar("tapegrad_anomaly_checking", default=False)


def checking() -> bool:
    """Whether the host read under way is anomaly mode's own check of a value."""
    return _checking.get()


def nonfinite(value: Any) -> str | None:
    """None if every element of the tensor `value` is finite, else what is wrong, e.g. 'Inf
    in 1 of 6 elements (first at index (0, 1))'."""
    token = _checking.set(True)
    try:
        data: np.ndarray[Any, Any] = value.numpy()
    finally:
        _checking.reset(token)
    bad = ~np.isfinite(data)
    count = int(np.count_nonzero(bad))
    if count == 0:
        return None
    nans = bool(np.isnan(data).any())
    infs = bool(np.isinf(data).any())
    kind = "NaN and Inf" if nans and infs else "NaN" if nans else "Inf"
    first = tuple(int(k) for k in np.unravel_index(int(np.argmax(bad)), data.shape))
    where = f" (first at index {first})" if data.ndim else ""
    return f"{kind} in {count} of {data.size} element{'s' if data.size != 1 else ''}{where}"
