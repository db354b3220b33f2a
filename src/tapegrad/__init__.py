"""tapegrad: reverse-mode autograd over an immutable, id-indexed tape, with OpenCL kernels.

    tape = tg.Tape()
    tape, x = tg.leaf(tape, np.ones((4, 3), np.float32), requires_grad=True)
    tape, y = tg.sum(tape, x)
    grads = tg.backward(tape, y)

This module only re-exports (`name as name` marks a re-export for pyright); each name lives in a
private module that says what it holds.
"""

# --- the engine -------------------------------------------------------------------------------
from ._anomaly import detect_anomaly as detect_anomaly
from ._device import Device as Device
from ._device import default_device as default_device
from ._device import devices as devices
from ._errors import AnomalyError as AnomalyError
from ._errors import DeviceError as DeviceError
from ._errors import DTypeError as DTypeError
from ._errors import GradcheckError as GradcheckError
from ._errors import ShapeError as ShapeError
from ._errors import TapeError as TapeError
from ._errors import TapegradError as TapegradError
from ._gradcheck import gradcheck as gradcheck
from ._sweep import backward as backward
from ._sweep import backward_on_tape as backward_on_tape
from ._tape import Id as Id
from ._tape import Node as Node
from ._tape import Tape as Tape
from ._tape import leaf as leaf
from ._tape import require as require
from ._tape import value as value
from ._tensor import AnyTensor as AnyTensor

# --- core ops ---------------------------------------------------------------------------------
from .ops.broadcast import broadcast_to as broadcast_to
from .ops.elementwise import add as add
from .ops.elementwise import div as div
from .ops.elementwise import exp as exp
from .ops.elementwise import log as log
from .ops.elementwise import mul as mul
from .ops.elementwise import neg as neg
from .ops.elementwise import pow as pow
from .ops.elementwise import relu as relu
from .ops.elementwise import sigmoid as sigmoid
from .ops.elementwise import sqrt as sqrt
from .ops.elementwise import sub as sub
from .ops.elementwise import tanh as tanh
from .ops.linalg import matmul as matmul
from .ops.reduce import max as max
from .ops.reduce import mean as mean
from .ops.reduce import min as min
from .ops.reduce import sum as sum
from .ops.shape import reshape as reshape
from .ops.shape import transpose as transpose

# --- elementwise, reductions and losses (issue 3) ---------------------------------------------

# --- shape and indexing ops (issue 3) ---------------------------------------------------------

# --- network layers (issue 3) -----------------------------------------------------------------

# --- inspection and typing (issue 5) ----------------------------------------------------------
# isort: split
from ._describe import describe as describe
from ._describe import render as render
from ._describe import to_dot as to_dot
from ._typing import typed as typed

# --- transforms, optimizers and custom ops ----------------------------------------------------
