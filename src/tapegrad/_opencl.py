"""The OpenCL backend wired together: `_backend`'s functions from the device and kernel modules,
and the two hooks by which the tensor and kernel modules, below fusion, reach it for a pending
value (`realise`, and a gather that reads one inside its fused kernel).

Imported by the package before anything can make a tape, so the autograd layer finds its
backend installed without importing any of these modules itself.
"""

from __future__ import annotations

from . import _backend, _fusion, _kernels, _tensor
from ._device import get_device

_backend.install(get_device, _kernels.constant, _kernels.full, _kernels.cast)
_tensor.set_realiser(_fusion.realise)
_kernels.set_pending_gather(_fusion.gather)
