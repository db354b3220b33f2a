"""The OpenCL backend behind `_backend`: the device, kernel and fusion modules implement it.

Imported by the package before anything can make a tape, so the autograd layer finds its
backend installed without importing any of these modules itself.
"""

from __future__ import annotations

from . import _backend
from ._device import get_device
from ._kernels import cast, constant, full

_backend.install(get_device, constant, full, cast)
