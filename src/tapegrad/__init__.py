"""tapegrad: reverse-mode autograd over an immutable, id-indexed tape, with OpenCL kernels.

    tape = tg.Tape()
    tape, x = tg.leaf(tape, np.ones((4, 3), np.float32), requires_grad=True)
    tape, y = tg.sum(tape, x)
    grads = tg.backward(tape, y)

This module only re-exports; each name lives in a private module that says what it holds.
"""

from ._anomaly import detect_anomaly
from ._device import Device, default_device, devices
from ._errors import (
    AnomalyError,
    DeviceError,
    DTypeError,
    GradcheckError,
    ShapeError,
    TapeError,
    TapegradError,
)
from ._gradcheck import gradcheck
from ._sweep import backward, backward_on_tape
from ._tape import Id, Node, Tape, leaf, require, value
from ._tensor import AnyTensor
from .ops.broadcast import broadcast_to
from .ops.elementwise import add, div, exp, log, mul, neg, pow, relu, sigmoid, sqrt, sub, tanh
from .ops.linalg import matmul
from .ops.reduce import max, mean, min, sum
from .ops.shape import reshape, transpose

__all__ = [
    "AnomalyError",
    "AnyTensor",
    "DTypeError",
    "Device",
    "DeviceError",
    "GradcheckError",
    "Id",
    "Node",
    "ShapeError",
    "Tape",
    "TapeError",
    "TapegradError",
    "add",
    "backward",
    "backward_on_tape",
    "broadcast_to",
    "default_device",
    "detect_anomaly",
    "devices",
    "div",
    "exp",
    "gradcheck",
    "leaf",
    "log",
    "matmul",
    "max",
    "mean",
    "min",
    "mul",
    "neg",
    "pow",
    "relu",
    "require",
    "reshape",
    "sigmoid",
    "sqrt",
    "sub",
    "sum",
    "tanh",
    "transpose",
    "value",
]
