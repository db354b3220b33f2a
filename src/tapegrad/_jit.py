"""`tg.jit`: a training step as a function of its signature.

    step = tg.jit(train_step, static_argnums=(3,))
    params, state, loss = step(params, state, batch, "adam")

What this module does today is the front end of SPEC's contract, not yet its compiler
(issue 19): a call's *signature* is the tree structure of its arguments, the shapes and dtypes
of its arrays and tensors, the kinds of its numbers, and the values of its static arguments;
each new signature is *traced* (a first call, checked: `f` may read nothing to the host and
must return a pytree of AnyTensors), and the signatures seen are kept in a bounded cache that
warns when it evicts. Every call, the first and later ones, runs `f` eagerly under the same
checks, so results are bitwise those of calling `f` directly. What is still to come is the
replay of a traced step as one prepared program without running `f`'s Python.

Numbers outside `static_argnums` are values, not part of the signature (a learning-rate
schedule does not retrace); `donate_argnums` is checked and recorded, and allows the compiled
update to write into the donated buffers once there is one (today nothing is donated).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from contextvars import ContextVar
from typing import Any, Generic, ParamSpec, TypeVar, cast

import numpy as np

from ._errors import ArgumentTypeError, DTypeError, ShapeError, TapegradError, at_site
from ._tensor import AnyTensor, host_reads
from ._tree import flatten, leaf_paths

P = ParamSpec("P")
R = TypeVar("R")

# Signatures kept per jitted function; past this the least recently used is evicted (a warning
# says so: a loop whose shapes change every call retraces every call).
CACHE_SIZE = 64

# The jitted function being traced or run, for the host-read error: None outside one.
_running: ContextVar[str | None] = ContextVar("tapegrad_jit_running", default=None)


class JitCacheWarning(UserWarning):
    """A jitted function's signature cache evicted a signature (it will be traced again)."""


Signature = tuple[Hashable, ...]


class Jitted(Generic[P, R]):
    """A function wrapped by `tg.jit`: call it as the function; `signatures` tells how many
    distinct signatures were traced and are kept."""

    def __init__(self, f: Callable[P, R], static_argnums: tuple[int, ...],
                 donate_argnums: tuple[int, ...]) -> None:
        self.f = f
        self.static_argnums = static_argnums
        self.donate_argnums = donate_argnums
        self.name = getattr(f, "__name__", type(f).__name__)
        self._seen: OrderedDict[Signature, None] = OrderedDict()
        self._lock = threading.Lock()
        self.traces = 0  # first calls of a signature (tests and users can see retracing)
        functools.update_wrapper(self, f)

    @property
    def signatures(self) -> int:
        return len(self._seen)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if kwargs:
            raise ArgumentTypeError(at_site(
                f"jit({self.name}): pass arguments by position (their positions are what "
                f"static_argnums and donate_argnums name), not as {', '.join(kwargs)}="))
        for i in (*self.static_argnums, *self.donate_argnums):
            if i >= len(args):
                raise ShapeError(at_site(
                    f"jit({self.name}): argnum {i} is beyond the {len(args)} arguments given"))
        signature = self._signature(args)
        with self._lock:
            first = signature not in self._seen
            if first:
                self._seen[signature] = None
                self.traces += 1
                if len(self._seen) > CACHE_SIZE:
                    evicted, _ = self._seen.popitem(last=False)
                    warnings.warn(JitCacheWarning(
                        f"jit({self.name}): {CACHE_SIZE} signatures are kept; the oldest "
                        f"({_describe(evicted)}) was evicted and will be traced again: do the "
                        "shapes change every call?"), stacklevel=2)
            else:
                self._seen.move_to_end(signature)
        token = _running.set(self.name)
        try:
            with host_reads(_refuse_host_read):
                result = self.f(*args, **kwargs)
        finally:
            _running.reset(token)
        if first:
            _check_result(self.name, result)
        return result

    def _signature(self, args: Sequence[Any]) -> Signature:
        parts: list[Hashable] = []
        for i, given in enumerate(args):
            arg: object = given
            if i in self.static_argnums:
                try:
                    hash(arg)
                except TypeError:
                    raise DTypeError(at_site(
                        f"jit({self.name}): static argument {i} must be hashable (its value is "
                        f"part of the signature), got {type(arg).__name__}")) from None
                parts.append(("static", type(arg), arg))
                continue
            leaves, spec = flatten(arg)
            kinds = tuple(_leaf_kind(self.name, i, spec, k, leaf) for k, leaf in enumerate(leaves))
            parts.append((spec, kinds))
        return tuple(parts)


def _leaf_kind(name: str, i: int, spec: Any, k: int, leaf: object) -> Hashable:
    """What of a leaf is part of the signature: an array's shape and dtype, a number's kind
    (its value is a value of the step), a hashable other leaf's value."""
    if isinstance(leaf, AnyTensor):
        return ("array", leaf.shape, leaf.dtype, id(leaf.device))
    if isinstance(leaf, np.ndarray | np.generic):
        array: np.ndarray[Any, Any] = np.asarray(cast(Any, leaf))
        return ("array", array.shape, array.dtype)
    if isinstance(leaf, bool | int | float):
        return ("number", type(leaf))
    try:
        hash(leaf)
    except TypeError:
        raise DTypeError(at_site(
            f"jit({name}): args[{i}]{leaf_paths(spec)[k]} is a {type(leaf).__name__}, neither "
            "an array, a tensor nor a number; mark the argument static (static_argnums) if it "
            "configures the step")) from None
    return ("value", type(leaf), leaf)


def _describe(signature: Signature) -> str:
    text = repr(signature)
    return text if len(text) <= 200 else text[:197] + "..."


def _check_result(name: str, result: object) -> None:
    """SPEC: a jitted function returns a pytree of AnyTensors; Python numbers are let through
    too, since an optimizer's state counts its steps in one (`adam`'s `step`)."""
    leaves, spec = flatten(result)
    paths = leaf_paths(spec)
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, AnyTensor | bool | int | float):
            raise DTypeError(at_site(
                f"jit({name}): the result must be a pytree of AnyTensors, but result"
                f"{paths[k]} is a {type(leaf).__name__} (return tg.value(tape, id) for an id)"))


def _refuse_host_read() -> None:
    name = _running.get()
    raise TapegradError(at_site(
        f"jit({name}): a value was read to the host inside the jitted function (numpy(), "
        "float(), item(), print of a tensor...). A jitted step is a program of device work: "
        "return the value and read it after the call"))


def jit(f: Callable[P, R], *, static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = ()) -> Jitted[P, R]:
    """Wrap a step `f` (pytrees of arrays, AnyTensors and numbers in; a pytree of AnyTensors
    out) as a function of its signature. See the module docstring for what runs today."""
    if not callable(f):
        raise DTypeError(at_site(f"jit: f must be a function, not {type(f).__name__}"))
    static = _argnums("static_argnums", static_argnums)
    donated = _argnums("donate_argnums", donate_argnums)
    if set(static) & set(donated):
        raise ShapeError(at_site(
            f"jit: argument(s) {sorted(set(static) & set(donated))} are both static and "
            "donated; a static argument is a Python value, not a buffer"))
    return Jitted(f, static, donated)


def _argnums(what: str, value: object) -> tuple[int, ...]:
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in cast(list[object], items)):
        raise ArgumentTypeError(at_site(f"jit: {what} must be an int or a tuple of ints, got "
                                        f"{value!r}"))
    numbers = cast(list[int], items)
    if any(n < 0 for n in numbers):
        raise ShapeError(at_site(f"jit: {what} must be argument positions (>= 0), got {value!r}"))
    return tuple(sorted(set(numbers)))
