"""Error classes and the call site of user code.

Every error tapegrad raises on bad input is a `TapegradError`. Messages name the op, the argument,
what was expected and what came, and the user's line that made the call: `call_site()` walks out
of tapegrad's own frames to find it, cheaply enough to run on every op.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import CodeType
from typing import Any, cast

import numpy as np

from ._traced import as_float, is_integer

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Frames from these subfolders count as user code: the demo is an example of using tapegrad.
_USER_DIRS = (os.path.join(_PKG_DIR, "demo") + os.sep,)


class TapegradError(Exception):
    """Base of every error tapegrad raises on bad input or misuse."""


class ShapeError(TapegradError, ValueError):
    """An operand's shape does not fit the op, or another argument's value does not (an axis,
    a size, a stride, a probability): a ValueError."""


class DTypeError(TapegradError, TypeError):
    """An operand's dtype does not fit the op, two dtypes were mixed, or an argument has the
    wrong type (a list where an array or an Id goes): a TypeError."""


class TapeError(TapegradError, LookupError):
    """An id used on a tape that does not hold its node."""


class NotAnIdError(DTypeError, TapeError):
    """Something that is not an Id (a list, an array, a number) where an op needs an Id.

    Both a wrong type and a failed lookup on the tape, so `except DTypeError` and
    `except TapeError` (and TypeError, LookupError) all catch it.
    """


class ArgumentTypeError(ShapeError, DTypeError):
    """An axis, a shape, a size or a stride of the wrong type (a float, a str, None, a bool):
    a ShapeError, as its wrong values are, and a TypeError, as numpy and PyTorch raise it."""


class IndexRangeError(ShapeError, IndexError):
    """An integer index (take's indices, a cross_entropy label) outside its axis, as numpy and
    PyTorch raise it: a ShapeError that is also an IndexError."""


class DeviceError(TapegradError, RuntimeError):
    """No usable OpenCL device, a failed build, or an allocation the device cannot hold."""


class AnomalyError(TapegradError, FloatingPointError):
    """A NaN or Inf found by the finite check."""


class GradcheckError(TapegradError, AssertionError):
    """Analytic and finite-difference gradients disagree."""


class MissingGradientError(TapeError, KeyError):
    """A gradient asked of `backward`'s result for an id it holds none for (an id that is not a
    requires_grad leaf the loss reaches): a KeyError, as a missing dict key is."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its key: show the message
        return str(self.args[0]) if self.args else ""


# The classes are public as `tapegrad.ShapeError`...: tracebacks, reprs and pickles name them
# there, not in this private module.
for _public in (TapegradError, ShapeError, DTypeError, TapeError, NotAnIdError,
                ArgumentTypeError, IndexRangeError, DeviceError, AnomalyError, GradcheckError,
                MissingGradientError):
    _public.__module__ = "tapegrad"


def _is_internal(filename: str) -> bool:
    return ((filename.startswith(_PKG_DIR) and not filename.startswith(_USER_DIRS))
            or filename == _CONTEXTLIB)  # `with tg.detect_anomaly(...)` enters through it


_CONTEXTLIB = contextlib.__file__


_INTERNAL: dict[str, bool] = {}  # by file name: call_site runs on every op


def call_site(skip: int = 0) -> tuple[str, int]:
    """The (file, line) of the innermost frame outside tapegrad's own code.

    `skip`: how many frames above the caller are known to be tapegrad's own (an op's fixed path
    down to `record`); they are passed over unread. Each frame the walk reads is made into a
    Python frame object: through an op's three frames that cost ~1 us, a third of recording
    an elementwise op.
    """
    frame = _getframe(1 + skip)
    while True:
        filename = frame.f_code.co_filename
        internal = _INTERNAL_GET(filename)
        if internal is None:
            internal = _INTERNAL[filename] = _is_internal(filename)
        if not internal:
            break
        back = frame.f_back  # read only past one of ours: each read makes a frame object
        if back is None:
            break
        frame = back
    # Looked up by the instruction: f_lineno walks the code's line table (~3 us in a 300-line
    # function, a long training script's), as hashing a code object does (hence its id; the
    # entry holds the code, so that id is not reused while it is there), and every node
    # recorded there shares one site tuple (a step's nodes are what Python's collector walks).
    code = frame.f_code
    where = (id(code), frame.f_lasti)
    found = _SITES_GET(where)
    if found is not None:
        return found[1]
    if len(_SITES) >= _SITES_MAX:
        _SITES.clear()
    site = (filename, frame.f_lineno)
    _SITES[where] = (code, site)
    return site


_getframe = sys._getframe  # pyright: ignore[reportPrivateUsage]
_INTERNAL_GET = _INTERNAL.get
_SITES: dict[tuple[int, int], tuple[CodeType, tuple[str, int]]] = {}
_SITES_GET = _SITES.get
_SITES_MAX = 1 << 12  # a model records from far fewer lines; each entry holds a code object


def format_site(site: tuple[str, int]) -> str:
    filename, line = site
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        rel = filename
    shown = rel if not rel.startswith("..") else filename
    return f"{shown}:{line}"


def flag(op: str, name: str, value: object) -> bool:
    """A bool argument, Python's or numpy's; anything else is a DTypeError, not taken for its
    truth (the string "no" would be True)."""
    if value is True or value is False or value.__class__ is np.bool_:
        return bool(value)
    raise DTypeError(at_site(f"{op}: {name} must be True or False, got {shown(value)}"))


def number(op: str, name: str, value: object) -> float:
    """A Python or numpy real number (not a bool) as a float, else a DTypeError naming it."""
    if isinstance(value, bool | np.bool_) or not (
            isinstance(value, float | np.floating) or is_integer(value)):
        raise DTypeError(at_site(f"{op}: {name} must be a number, got {shown(value)}"))
    return as_float(value)


def shown(value: Any) -> str:
    """A user's argument as an error message shows it: its repr, but a device tensor by its
    type, shape and dtype (its repr reads the values to the host, which tg.jit refuses inside a
    step: the message would have been that refusal instead), in a list or tuple too."""
    kind: Any = value.__class__
    if kind is list or kind is tuple:
        items = ", ".join(shown(v) for v in value) + ("," if len(value) == 1 and kind is tuple
                                                       else "")
        return f"[{items}]" if kind is list else f"({items})"
    shape: Any = getattr(value, "shape", None)
    dtype: Any = getattr(value, "dtype", None)
    if shape is not None and dtype is not None and not issubclass(kind, np.ndarray | np.generic):
        return f"{kind.__name__} of shape {tuple(shape)} and dtype {dtype}"
    return f"{value!r}"


def at_site(message: str) -> str:
    """Append the user's call site to a message."""
    return f"{message}\n  (called at {format_site(call_site())})"


def fits(f: object, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
         ) -> bool | None:
    """Whether a call of f with `args` (and `kwargs`) fits its parameters (None: it has no
    signature to read), for the error after such a call failed with a TypeError (read only
    then: a signature costs microseconds)."""
    try:
        signature = inspect.signature(cast(Callable[..., Any], f))
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **(kwargs or {}))
    except TypeError:
        return False
    return True


def takes_positional(f: object, count: int) -> bool | None:
    """Whether f's signature takes `count` positional arguments (see `fits`)."""
    return fits(f, range(count))
