"""tapegrad: reverse-mode autograd over an immutable, id-indexed tape, with OpenCL kernels.

    tape = tg.Tape()
    tape, x = tg.leaf(tape, np.ones((4, 3), np.float32), requires_grad=True)
    tape, y = tg.sum(tape, x)
    grads = tg.backward(tape, y)

This module only re-exports (`name as name` marks a re-export for pyright); each name lives in a
private module that says what it holds.
"""

from ._version import __version__ as __version__

# The OpenCL backend installs itself behind `_backend` first: the tape and the sweep use it.
from . import _opencl as _opencl

# --- the engine -------------------------------------------------------------------------------
from ._anomaly import detect_anomaly as detect_anomaly
from ._device import Device as Device
from ._device import default_device as default_device
from ._device import devices as devices
from ._errors import AnomalyError as AnomalyError
from ._errors import ArgumentTypeError as ArgumentTypeError
from ._errors import DeviceError as DeviceError
from ._errors import DTypeError as DTypeError
from ._errors import GradcheckError as GradcheckError
from ._errors import IndexRangeError as IndexRangeError
from ._errors import MissingGradientError as MissingGradientError
from ._errors import NotAnIdError as NotAnIdError
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
from ._ops.broadcast import broadcast_to as broadcast_to
from ._ops.elementwise import add as add
from ._ops.elementwise import div as div
from ._ops.elementwise import exp as exp
from ._ops.elementwise import log as log
from ._ops.elementwise import mul as mul
from ._ops.elementwise import neg as neg
from ._ops.elementwise import pow as pow
from ._ops.elementwise import relu as relu
from ._ops.elementwise import sigmoid as sigmoid
from ._ops.elementwise import sqrt as sqrt
from ._ops.elementwise import sub as sub
from ._ops.elementwise import tanh as tanh
from ._ops.linalg import matmul as matmul
from ._ops.reduce import max as max
from ._ops.reduce import mean as mean
from ._ops.reduce import min as min
from ._ops.reduce import sum as sum
from ._ops.shape import reshape as reshape
from ._ops.shape import transpose as transpose

# --- elementwise, reductions and losses -------------------------------------------------------
# isort: split
from ._ops.elementwise import abs as abs
from ._ops.elementwise import astype as astype
from ._ops.elementwise import clip as clip
from ._ops.elementwise import gelu as gelu
from ._ops.elementwise import maximum as maximum
from ._ops.elementwise import minimum as minimum
from ._ops.elementwise import where as where
from ._ops.losses import cross_entropy as cross_entropy
from ._ops.losses import log_softmax as log_softmax
from ._ops.losses import mse as mse
from ._ops.losses import softmax as softmax
from ._ops.reduce import logsumexp as logsumexp
from ._ops.reduce import var as var

# --- shape and indexing ops -------------------------------------------------------------------
# isort: split
from ._ops.indexing import embedding as embedding
from ._ops.indexing import take as take
from ._ops.shape import concat as concat
from ._ops.shape import expand_dims as expand_dims
from ._ops.shape import pad as pad
from ._ops.shape import slice as slice
from ._ops.shape import squeeze as squeeze
from ._ops.shape import stack as stack
from ._ops.shape import stop_gradient as stop_gradient

# --- triangles, arg-reductions, scans and splits --------------------------------------------
# isort: split
from ._ops.scan import argmax as argmax
from ._ops.scan import argmin as argmin
from ._ops.scan import cumsum as cumsum
from ._ops.scan import tril as tril
from ._ops.scan import triu as triu
from ._ops.shape import split as split

# --- more elementwise, comparisons and logical ops ------------------------------------------------
# isort: split
from ._ops.compare import equal as equal
from ._ops.compare import greater as greater
from ._ops.compare import greater_equal as greater_equal
from ._ops.compare import less as less
from ._ops.compare import less_equal as less_equal
from ._ops.compare import logical_and as logical_and
from ._ops.compare import logical_not as logical_not
from ._ops.compare import logical_or as logical_or
from ._ops.compare import not_equal as not_equal
from ._ops.elementwise import cos as cos
from ._ops.elementwise import elu as elu
from ._ops.elementwise import erf as erf
from ._ops.elementwise import expm1 as expm1
from ._ops.elementwise import leaky_relu as leaky_relu
from ._ops.elementwise import log1p as log1p
from ._ops.elementwise import silu as silu
from ._ops.elementwise import sin as sin
from ._ops.elementwise import softplus as softplus

# --- network layers ---------------------------------------------------------------------------
# isort: split
from ._ops.conv import avg_pool2d as avg_pool2d
from ._ops.conv import conv2d as conv2d
from ._ops.conv import max_pool2d as max_pool2d
from ._ops.nn import batch_norm as batch_norm
from ._ops.nn import dropout as dropout
from ._ops.nn import layer_norm as layer_norm
from ._ops.nn import linear as linear

# --- inspection and typing --------------------------------------------------------------------
# isort: split
from ._describe import describe as describe
from ._describe import render as render
from ._describe import to_dot as to_dot
from ._typing import typed as typed

# --- transforms, optimizers and custom ops ----------------------------------------------------
from . import distributed as distributed
from . import nn as nn
from . import optim as optim
from ._custom import elementwise_op as elementwise_op
from ._custom import reserve_names as _reserve_names
from ._transforms import grad as grad
from ._transforms import hessian as hessian
from ._transforms import hvp as hvp
from ._transforms import jacobian as jacobian
from ._transforms import value_and_grad as value_and_grad
from ._transforms import vjp as vjp

# --- a step as a program ----------------------------------------------------------------------
# isort: split
from ._jit import Jitted as Jitted
from ._jit import JitCacheWarning as JitCacheWarning
from ._jit import JitWarning as JitWarning
from ._jit import jit as jit
from ._tree import tree_map as tree_map

__all__ = [
    "AnomalyError",
    "AnyTensor",
    "ArgumentTypeError",
    "DTypeError",
    "Device",
    "DeviceError",
    "GradcheckError",
    "Id",
    "IndexRangeError",
    "JitCacheWarning",
    "JitWarning",
    "Jitted",
    "MissingGradientError",
    "Node",
    "NotAnIdError",
    "ShapeError",
    "Tape",
    "TapeError",
    "TapegradError",
    "__version__",
    "abs",
    "add",
    "argmax",
    "argmin",
    "astype",
    "avg_pool2d",
    "backward",
    "backward_on_tape",
    "batch_norm",
    "broadcast_to",
    "clip",
    "concat",
    "conv2d",
    "cos",
    "cross_entropy",
    "cumsum",
    "default_device",
    "describe",
    "detect_anomaly",
    "devices",
    "distributed",
    "div",
    "dropout",
    "elementwise_op",
    "elu",
    "embedding",
    "equal",
    "erf",
    "exp",
    "expand_dims",
    "expm1",
    "gelu",
    "grad",
    "gradcheck",
    "greater",
    "greater_equal",
    "hessian",
    "hvp",
    "jacobian",
    "jit",
    "layer_norm",
    "leaf",
    "leaky_relu",
    "less",
    "less_equal",
    "linear",
    "log",
    "log1p",
    "log_softmax",
    "logical_and",
    "logical_not",
    "logical_or",
    "logsumexp",
    "matmul",
    "max",
    "max_pool2d",
    "maximum",
    "mean",
    "min",
    "minimum",
    "mse",
    "mul",
    "neg",
    "nn",
    "not_equal",
    "optim",
    "pad",
    "pow",
    "relu",
    "render",
    "require",
    "reshape",
    "sigmoid",
    "silu",
    "sin",
    "slice",
    "softmax",
    "softplus",
    "split",
    "sqrt",
    "squeeze",
    "stack",
    "stop_gradient",
    "sub",
    "sum",
    "take",
    "tanh",
    "to_dot",
    "transpose",
    "tree_map",
    "tril",
    "triu",
    "typed",
    "value",
    "value_and_grad",
    "var",
    "vjp",
    "where",
]

# A custom op may not take a public name (tg.layer_norm, tg.leaf...): `_custom` is told them
# here rather than importing the package it is part of.
_reserve_names(__all__)
