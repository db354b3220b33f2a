"""Parameter initialisers with an explicit seed (Glorot/Xavier and He/Kaiming).

Values are drawn on the host with numpy's PCG64 from the seed and uploaded once: the draw is
host input, like any array given to `tg.leaf`, and the same seed gives the same tensor.

Fans follow tapegrad's layouts: a 2-D weight is `(in, out)` (as `tg.linear` takes it, the
transpose of PyTorch's), so fan_in = shape[0] and fan_out = shape[1]; a conv weight
`(out, in, kh, kw)` has fan_in = in*kh*kw and fan_out = out*kh*kw, as in PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from ._device import Device
from ._errors import ArgumentTypeError, DTypeError, ShapeError, at_site, number, shown
from ._tensor import FLOATS, AnyTensor
from ._traced import is_integer


def _shape(op: str, shape: object) -> tuple[int, ...]:
    """A weight's shape: a sequence of non-negative ints, else an error naming `op`."""
    items = list(cast(Sequence[object], shape)) if isinstance(shape, Sequence) and not \
        isinstance(shape, str) else None
    if items is None or not all(is_integer(n) and not isinstance(n, bool | np.bool_)
                                for n in items):
        raise ShapeError(at_site(
            f"{op}: shape must be a tuple of ints (such as (784, 512)), got {shown(shape)}"))
    dims = tuple(int(cast(Any, n)) for n in items)
    if any(n < 0 for n in dims):
        raise ShapeError(at_site(f"{op}: shape {dims} has a negative size"))
    return dims


def _fans(op: str, shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        raise ShapeError(at_site(
            f"{op}: a weight needs at least 2 dims to have fans (in, out), got shape {shape}; "
            "a bias is made with zeros"))
    if len(shape) == 2:
        fan_in, fan_out = shape
    else:
        receptive = math.prod(shape[2:])
        fan_in, fan_out = shape[1] * receptive, shape[0] * receptive
    if fan_in == 0 or fan_out == 0:
        raise ShapeError(at_site(
            f"{op}: shape {shape} has a fan of 0 (fan_in {fan_in}, fan_out {fan_out}): there is "
            "no scale to draw with"))
    return fan_in, fan_out


def fans(shape: Sequence[int]) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight shape."""
    return _fans("fans", _shape("fans", shape))


def _seed(op: str, seed: object) -> int:
    """An explicit seed: an int >= 0 (numpy's PCG64 takes no other), never None."""
    if not is_integer(seed) or isinstance(seed, bool | np.bool_) or int(cast(Any, seed)) < 0:
        raise ArgumentTypeError(at_site(
            f"{op}: seed must be an int >= 0 (the same seed gives the same tensor), got "
            f"{shown(seed)}"))
    return int(cast(Any, seed))


def _make(op: str, values: np.ndarray[Any, Any], dtype: Any, device: Device | str | None
          ) -> AnyTensor:
    try:
        target = np.dtype(dtype)
    except TypeError as err:
        raise DTypeError(at_site(f"{op}: dtype {shown(dtype)} is not a dtype ({err})")) from None
    if target not in FLOATS:
        raise DTypeError(at_site(
            f"{op}: dtype must be float32 or float64 (parameters take gradients), got {target}"))
    return AnyTensor.from_numpy(values.astype(target), device)


def glorot_uniform(shape: Sequence[int], seed: int, gain: float = 1.0, dtype: Any = np.float32,
                   device: Device | str | None = None) -> AnyTensor:
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (PyTorch's xavier_uniform_)."""
    op = "glorot_uniform"
    dims = _shape(op, shape)
    fan_in, fan_out = _fans(op, dims)
    a = number(op, "gain", gain) * math.sqrt(6.0 / (fan_in + fan_out))
    return _make(op, np.random.default_rng(_seed(op, seed)).uniform(-a, a, dims), dtype, device)


def glorot_normal(shape: Sequence[int], seed: int, gain: float = 1.0, dtype: Any = np.float32,
                  device: Device | str | None = None) -> AnyTensor:
    """N(0, std²) with std = gain * sqrt(2 / (fan_in + fan_out)) (xavier_normal_)."""
    op = "glorot_normal"
    dims = _shape(op, shape)
    fan_in, fan_out = _fans(op, dims)
    std = number(op, "gain", gain) * math.sqrt(2.0 / (fan_in + fan_out))
    return _make(op, np.random.default_rng(_seed(op, seed)).normal(0.0, std, dims), dtype,
                 device)


def he_uniform(shape: Sequence[int], seed: int, dtype: Any = np.float32,
               device: Device | str | None = None) -> AnyTensor:
    """U(-b, b) with b = sqrt(6 / fan_in), for ReLU layers (kaiming_uniform_, a=0)."""
    op = "he_uniform"
    dims = _shape(op, shape)
    fan_in, _ = _fans(op, dims)
    b = math.sqrt(6.0 / fan_in)
    return _make(op, np.random.default_rng(_seed(op, seed)).uniform(-b, b, dims), dtype, device)


def he_normal(shape: Sequence[int], seed: int, dtype: Any = np.float32,
              device: Device | str | None = None) -> AnyTensor:
    """N(0, 2 / fan_in), for ReLU layers (kaiming_normal_)."""
    op = "he_normal"
    dims = _shape(op, shape)
    fan_in, _ = _fans(op, dims)
    std = math.sqrt(2.0 / fan_in)
    return _make(op, np.random.default_rng(_seed(op, seed)).normal(0.0, std, dims), dtype,
                 device)


def zeros(shape: Sequence[int], dtype: Any = np.float32, device: Device | str | None = None
          ) -> AnyTensor:
    """Zeros (for biases)."""
    return _make("zeros", np.zeros(_shape("zeros", shape)), dtype, device)
