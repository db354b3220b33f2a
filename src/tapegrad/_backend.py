"""The backend as the autograd layer sees it: four functions, filled in when tapegrad loads.

The tape, the primitives and the sweep build nodes out of `AnyTensor` handles (`_tensor`, free
of OpenCL) and primitives' forwards (`Primitive.forward` applies a primitive to values; a
tensor's `buffer` realises a pending value). Besides those they need a device by name, tensors
of one value (zero cotangents; the sweep's seed of 1, shared) and a dtype conversion (a seed of
another float dtype): this module. It imports nothing of `_device`, `_kernels`, `_fusion` or
pyopencl at run time, so neither do they; the OpenCL backend (`_opencl`) installs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # names for annotations only: no run-time dependency on the device layer
    from ._device import Device
    from ._tensor import AnyTensor, DType, Shape


def _not_installed(name: str) -> Callable[..., Any]:
    def missing(*args: Any) -> Any:
        raise RuntimeError(f"_backend.{name} was called before tapegrad finished importing "
                           "(the OpenCL backend installs it: `_opencl`)")
    return missing


_get_device = _not_installed("get_device")
_constant = _not_installed("constant")
_full = _not_installed("full")
_cast = _not_installed("cast")


def install(get_device: Callable[[Device | str | None, str], Device],
            constant: Callable[[float, DType, Device], AnyTensor],
            full: Callable[[Shape, float, DType, Device], AnyTensor],
            cast: Callable[[AnyTensor, DType], AnyTensor]) -> None:
    """Called once by the backend when the package loads."""
    global _get_device, _constant, _full, _cast
    _get_device, _constant, _full, _cast = get_device, constant, full, cast


def get_device(spec: Device | str | None = None, op: str = "") -> Device:
    """A `Device`, 'cpu', 'gpu', 'P:D', or None for the default; errors name `op`."""
    device: Device = _get_device(spec, op)
    return device


def constant(value: float, dtype: DType, device: Device) -> AnyTensor:
    """A 0-d tensor of `value`, made once and shared (it is immutable)."""
    out: AnyTensor = _constant(value, dtype, device)
    return out


def full(shape: Shape, value: float, dtype: DType, device: Device) -> AnyTensor:
    """A tensor of one value, made on the device (no host copy)."""
    out: AnyTensor = _full(shape, value, dtype, device)
    return out


def cast(t: AnyTensor, dtype: DType) -> AnyTensor:
    """`t`'s values converted to `dtype` (as numpy's astype)."""
    out: AnyTensor = _cast(t, dtype)
    return out
