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
from typing import Any

import numpy as np

from ._device import Device
from ._errors import ShapeError
from ._tensor import AnyTensor


def fans(shape: Sequence[int]) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight shape."""
    if len(shape) < 2:
        raise ShapeError(f"init: a weight needs at least 2 dims to have fans, got {tuple(shape)}")
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    receptive = math.prod(shape[2:])
    return int(shape[1]) * receptive, int(shape[0]) * receptive


def _make(values: np.ndarray[Any, Any], dtype: Any, device: Device | str | None) -> AnyTensor:
    return AnyTensor.from_numpy(values.astype(dtype), device)


def glorot_uniform(shape: Sequence[int], seed: int, gain: float = 1.0, dtype: Any = np.float32,
                   device: Device | str | None = None) -> AnyTensor:
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (PyTorch's xavier_uniform_)."""
    fan_in, fan_out = fans(shape)
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return _make(np.random.default_rng(seed).uniform(-a, a, tuple(shape)), dtype, device)


def glorot_normal(shape: Sequence[int], seed: int, gain: float = 1.0, dtype: Any = np.float32,
                  device: Device | str | None = None) -> AnyTensor:
    """N(0, std²) with std = gain * sqrt(2 / (fan_in + fan_out)) (xavier_normal_)."""
    fan_in, fan_out = fans(shape)
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    return _make(np.random.default_rng(seed).normal(0.0, std, tuple(shape)), dtype, device)


def he_uniform(shape: Sequence[int], seed: int, dtype: Any = np.float32,
               device: Device | str | None = None) -> AnyTensor:
    """U(-b, b) with b = sqrt(6 / fan_in), for ReLU layers (kaiming_uniform_, a=0)."""
    fan_in, _ = fans(shape)
    b = math.sqrt(6.0 / fan_in)
    return _make(np.random.default_rng(seed).uniform(-b, b, tuple(shape)), dtype, device)


def he_normal(shape: Sequence[int], seed: int, dtype: Any = np.float32,
              device: Device | str | None = None) -> AnyTensor:
    """N(0, 2 / fan_in), for ReLU layers (kaiming_normal_)."""
    fan_in, _ = fans(shape)
    std = math.sqrt(2.0 / fan_in)
    return _make(np.random.default_rng(seed).normal(0.0, std, tuple(shape)), dtype, device)


def zeros(shape: Sequence[int], dtype: Any = np.float32, device: Device | str | None = None
          ) -> AnyTensor:
    """Zeros (for biases)."""
    return _make(np.zeros(tuple(shape)), dtype, device)
