"""`tg.jit`: a training step recorded once per signature and replayed as a list of launches.

    step = tg.jit(train_step, static_argnums=(3,))
    params, state, loss = step(params, state, batch, "adam")

A call's *signature* is the tree structure of its arguments, the shapes and dtypes of its arrays
and tensors, the kinds of its numbers and the values of its static arguments. The first call of
a signature runs `f` eagerly while the device layer tells a `_Recording` every launch, upload
and allocation (`_device.observing`); the step's result decides which buffers are its outputs.
That recording becomes a `Program`: one prepared kernel object per launch with its arguments
set, where only the arguments that change per call (the input arrays' buffers, fresh output
buffers, scalars computed from the number arguments) are set again on replay. Later calls run
the program without `f`'s Python: their results are those of the same kernels over the same
data, so they equal calling `f` bitwise.

What a recording cannot see is checked, not assumed:
- Numbers reach f as `_traced` numbers: Python arithmetic on them stays a function of the
  call's numbers; comparisons and conversions are guards (a step whose guards fail is recorded
  again, as another variant of its signature).
- Some calls of a program (`CHECK_CALLS`, `CHECK_CHANGED`, then calls at powers of two from
  `LATE_CHECKS`) run `f` again under a recording and compare the two launch by launch, after
  evaluating the traced scalars at the call's numbers. In that run the numbers' values as C
  code reads them are decoys (`_traced.Guards.decoy`), so a number used where the trace cannot
  follow it changes the work at once. Different work (f made a host array from its inputs, or
  sent a number through math or numpy) makes that signature run `f` eagerly on every call,
  with a `JitWarning` saying why.
- A new signature's first call also runs `f`, recorded, on other arrays of the signature
  (`_other_data`: floats rotated, negated and shifted, bools flipped, ints rotated or
  stepped) and
  compares the two runs (`Jitted._probe`): an upload equal to an input in both (f reshaped
  the input with numpy) is read as that input on replay; any other difference (f computed a
  constant or a scalar from its inputs on the host: `x.astype`, `x[:, 1:]`, `float(x.max())`)
  makes the signature run `f` eagerly from its first call.
- Integer inputs (labels, indices) were checked against their range by `f`'s ops when it was
  recorded, which noted the bounds each accepts (`_tensor.checked_range`). A call whose
  integer tensors leave the recorded range replays where they stay in those bounds (f cannot
  read a tensor's values); past them, where a check read a tensor made from inputs rather
  than an input, or for a numpy array (host work on it may show only now), it is a check
  (its ops check them again).
Reading a value to the host inside `f` raises a `TapegradError` (a step is device work).
Anomaly mode's checks read every value: inside `tg.detect_anomaly()` a jitted function runs
`f` eagerly, and a step that turns the checks on itself runs eagerly with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import struct
import sys
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Generator, Hashable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Generic, ParamSpec, TypeVar, cast

import numpy as np
import pyopencl as cl

from ._anomaly import anomaly_enabled, checking
from ._device import Device, PreparedLaunch, default_device, observed, observing
from ._errors import (
    ArgumentTypeError,
    DTypeError,
    ShapeError,
    TapegradError,
    at_site,
    shown,
    takes_positional,
)
from ._fusion import Pending, build_surveyed, surveying
from ._kernels import constant_value, kept_buffers
from ._optim import in_place
from ._sweep import Reached, Sweep, set_replayer
from ._tape import Forward, Id, Node, Tape, deferring
from ._tensor import (
    WIDENED_INTS,
    AnyTensor,
    computed_buffers,
    deferred_dag,
    donate,
    empty,
    host_range,
    host_reads,
    keep_range,
    noting_range_checks,
    run_deferred,
    set_forcer,
    settle,
    tensor,
    upload,
)
from ._traced import Guards, NumberFn, Traced, TracedFloat, fn_of, plain, traced
from ._tree import flatten, flatten_ordered, leaf_paths

P = ParamSpec("P")
R = TypeVar("R")

# Signatures kept per jitted function; past this the least recently used is evicted (a warning
# says so: a loop whose shapes change every call retraces every call).
CACHE_SIZE = 64
# Runs of f that look for the fused kernels a new program needs, built together (`_survey`).
SURVEYS = 4
# Recorded variants of one signature (their guards differ, e.g. a branch on a number).
VARIANTS = 8
# A program's calls that run f again under a recording and compare (its recording is call 1),
# and likewise its calls with numbers other than the recorded ones: what a recording cannot
# see (host work on the inputs, an int used as a Python index) shows as different work when
# the data or the numbers change, which may not happen on the first such call.
# Past the first two, checks come at powers of two of the calls from LATE_CHECKS on (every
# check gives the numbers decoy values, so these look at them too), for as long as the
# program lives: what a recording cannot see may first matter late (a step counter that
# decides something at step 40), and a check then costs one run of f per doubling of the
# calls. Not sooner: a check costs 2-5 eager steps (a GRU's 100 ms against a 17 ms replay),
# and checks at calls 5, 9, 17 and 33 made the mean of a loop's first 40 steps 1.5-2 times
# its median (BENCHMARKS "Session 17").
CHECK_CALLS = frozenset({2, 3})
CHECK_CHANGED = frozenset({1, 2})
LATE_CHECKS = 128


def _checked_at(count: int, listed: frozenset[int]) -> bool:
    return count in listed or (count >= LATE_CHECKS and count & (count - 1) == 0)

# The jitted function being recorded or run, for the host-read error: None outside one.
_running: ContextVar[str | None] = ContextVar("tapegrad_jit_running", default=None)


class JitCacheWarning(UserWarning):
    """A jitted function's signature cache evicted a signature (it will be traced again)."""


class JitWarning(UserWarning):
    """A jitted function cannot be replayed for some signature and runs eagerly instead."""


Signature = tuple[Hashable, ...]


def _sharing(buffers: Sequence[Any]) -> tuple[int, ...]:
    """Per slot, the first slot holding the same buffer (None: a slot of its own): part of a
    signature, as a program reads a shared buffer through one slot."""
    first: dict[int, int] = {}
    return tuple(k if b is None else first.setdefault(id(b), k) for k, b in enumerate(buffers))


_NUMPY_NUMBERS = (np.floating, np.integer)
# numpy numbers a jitted step takes as values: the float types Python's float and kernels hold,
# and the integers (float16 and longdouble stay values of the signature).
_TRACED_DTYPES = frozenset(np.dtype(t) for t in (
    np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
    np.uint32, np.uint64))


class _Call:
    """One call's arguments split for the program: its array leaves (host arrays made
    C-contiguous, tensors), its numbers, and `rebuild` to make f's arguments."""

    def __init__(self, name: str, args: Sequence[Any], static: tuple[int, ...]) -> None:
        self.arrays: list[Any] = []
        self.numbers: list[Any] = []
        parts: list[Hashable] = []
        # Per argument: None (static), or its position, structure, leaves and which leaves
        # are numbers (as `_leaf` decided: a numpy float64 is a float, yet a signature value)
        self._trees: list[tuple[int, Any, list[Any], list[bool]] | None] = []
        self._args = args
        self.arg_of: list[int] = []  # the argument each array slot came from
        for i, given in enumerate(args):
            arg: object = given
            if i in static:
                try:
                    hash(arg)
                except TypeError:
                    raise DTypeError(at_site(
                        f"jit({name}): static argument {i} must be hashable (its value is part "
                        f"of the signature), got {type(arg).__name__}")) from None
                parts.append(("static", _static_key(arg)))
                self._trees.append(None)
                continue
            leaves, spec, orders = flatten_ordered(arg)
            kinds: list[Hashable] = []
            kept: list[Any] = []
            numbers: list[bool] = []
            for k, leaf in enumerate(leaves):
                count = len(self.numbers)
                kind, value = self._leaf(name, i, spec, k, leaf)
                kinds.append(kind)
                kept.append(value)
                numbers.append(len(self.numbers) > count)  # _leaf took it as a number
            # The dicts' own key orders too: structures compare dicts by sorted keys, and a
            # step iterating a dict in its order makes other work for another order.
            parts.append((spec, tuple(kinds), orders))
            self._trees.append((i, spec, kept, numbers))
            self.arg_of += [i] * (len(self.arrays) - len(self.arg_of))
        # Tensors given twice (or sharing a buffer) must share it on replay too.
        buffers = [a.buffer if isinstance(a, AnyTensor) else a for a in self.arrays]
        self.sharing = _sharing(buffers)
        parts.append(self.sharing)
        self.buffers = buffers
        self.signature: Signature = tuple(parts)

    @classmethod
    def of_inputs(cls, inputs: Sequence[AnyTensor | None]) -> _Call:
        """A call whose arrays are `inputs` as they are (None: a slot the recording does not
        read as an input), with no numbers and no signature: a sweep's (`SweepReplays`)."""
        call = cls.__new__(cls)
        call.arrays = list(inputs)
        call.arg_of = [0] * len(inputs)
        call.numbers = []
        call._trees = []
        call._args = ()
        call.buffers = [None if t is None else t.buffer for t in inputs]
        call.sharing = ()
        call.signature = ()
        return call

    def _leaf(self, name: str, i: int, spec: Any, k: int, leaf: object
              ) -> tuple[Hashable, Any]:
        if isinstance(leaf, AnyTensor):
            self.arrays.append(leaf)
            return ("array", leaf.shape, leaf.dtype, id(leaf.device)), leaf
        if isinstance(leaf, np.ndarray):
            array = cast(np.ndarray[Any, Any], leaf)
            dtype = array.dtype if array.dtype.isnative else array.dtype.newbyteorder("=")
            # widened here as tg.leaf widens them, so that f's upload is this very array
            array = np.asarray(array, dtype=WIDENED_INTS.get(dtype, dtype), order="C")
            self.arrays.append(array)
            return ("array", array.shape, array.dtype), array
        if isinstance(leaf, _NUMPY_NUMBERS) and cast(Any, leaf).dtype in _TRACED_DTYPES:
            # A numpy number is a value of the program, as a Python number (a schedule's
            # np.cos(...), a seed from rng.integers; JAX traces them too), its type part of
            # the signature: traced, it keeps numpy's type, so arithmetic on it rounds as
            # the call's own would.
            number: Any = cast(Any, leaf)
            kind_of: type = number.__class__
            self.numbers.append(number)
            return ("number", kind_of), number
        if isinstance(leaf, np.generic):
            # Any other numpy scalar (a bool flag, a float16, a str_) is part of the signature,
            # by value (its bytes: a NaN equals itself).
            scalar: Any = cast(Any, leaf)
            kind: Hashable = ("numpy scalar", scalar.dtype.str, scalar.tobytes())
            return kind, scalar
        if isinstance(leaf, int | float) and not isinstance(leaf, bool):
            self.numbers.append(leaf)
            return ("number", type(leaf)), leaf
        if isinstance(leaf, Tape | Id):
            # Hashable by identity: each call's would be a new signature, a trace per call.
            what = "a Tape" if isinstance(leaf, Tape) else "an Id"
            raise ArgumentTypeError(at_site(
                f"jit({name}): args[{i}]{leaf_paths(spec)[k]} is {what}; a jitted step takes "
                "arrays, AnyTensors and numbers and builds its tape inside (tape = tg.Tape(), "
                "then tg.leaf(tape, x)), so that each call records the same program"))
        try:
            hash(leaf)
        except TypeError:
            raise DTypeError(at_site(
                f"jit({name}): args[{i}]{leaf_paths(spec)[k]} is a {type(leaf).__name__}, "
                "neither an array, a tensor nor a number; mark the argument static "
                "(static_argnums) if it configures the step")) from None
        return ("value", type(leaf), leaf), leaf

    def rebuild(self, guards: Guards | None, replace: dict[int, Any] | None = None
                ) -> list[Any]:
        """f's arguments: as given, with numbers traced when `guards` is given and the arrays
        `replace` names (by id) replaced."""
        out: list[Any] = []
        slot = 0
        for given, tree in zip(self._args, self._trees, strict=True):
            if tree is None:
                out.append(given)
                continue
            _, spec, kept, numbers = tree
            leaves: list[Any] = []
            for leaf, is_number in zip(kept, numbers, strict=True):
                if is_number:
                    if guards is not None:
                        leaf = traced(leaf, _number_fn(slot), guards)
                    slot += 1
                elif replace is not None:
                    leaf = replace.get(id(leaf), leaf)
                leaves.append(leaf)
            out.append(spec.unflatten(leaves))
        return out

    def int_ranges(self) -> list[tuple[int, int] | None]:
        """Per array slot, (min, max) of an integer array or tensor where known."""
        ranges: list[tuple[int, int] | None] = []
        for a in self.arrays:
            if isinstance(a, AnyTensor):
                ranges.append(host_range(a) if a.dtype.kind in "iu" else None)
            else:
                array = np.asarray(a)
                ranges.append((int(array.min()), int(array.max()))
                              if array.dtype.kind in "iu" and array.size else None)
        return ranges


def _static_key(value: object) -> Hashable:
    """A static argument as part of a signature: values that compare equal but may make other
    work are told apart (0.0 and -0.0 by their bits; 1, 1.0 and True by type, also inside
    tuples)."""
    kind: type = type(value)
    if isinstance(value, float):
        return kind, value.hex()
    if isinstance(value, np.generic):
        return kind, cast(Any, value).tobytes()
    if isinstance(value, tuple):
        return kind, tuple(_static_key(v) for v in cast(tuple[object, ...], value))
    return kind, cast(Hashable, value)


def _number_fn(slot: int) -> NumberFn:
    return lambda numbers: numbers[slot]


def _is_buffer(value: object) -> bool:
    return isinstance(value, cl.MemoryObjectHolder)


# One launch as the device reported it: device, kernel, argument types, sizes, arguments.
# (device, kernel, argument types, size, local, arguments, the bytes it touches at most where
# its caller said so: the lane's choice on replay, as eager's (`Device.launch`))
Launch = tuple[Device, cl.Kernel, list[Any], tuple[int, ...], tuple[int, ...], tuple[Any, ...],
               int | None]


class _Recording:
    """What one thread's device did while `f` ran (`_device.Observer`)."""

    def __init__(self, call: _Call, arrays: Sequence[Any] | None = None) -> None:
        """`arrays`: the array leaves f was given, where not the call's (the probe's)."""
        arrays = call.arrays if arrays is None else arrays
        self.launches: list[Launch] = []
        # Every buffer seen is kept alive while the recording lives, so ids stay unique (the
        # uploads too: one no launch names would die, and a later buffer could take its id).
        self.fresh: dict[int, Any] = {}
        self.uploaded_buffers: list[Any] = []
        # Uploads that are no input array: their contents, by buffer, as _canonical names them.
        self.constants: dict[int, tuple[str, bytes]] = {}
        self._host_slots: dict[int, int] = {
            id(cast(object, a)): k for k, a in enumerate(arrays) if isinstance(a, np.ndarray)}
        self.input_slots = {
            id(a.buffer): k for k, a in enumerate(arrays) if isinstance(a, AnyTensor)}
        # The numpy inputs by dtype and size, for uploads of the same contents (a numpy
        # reshape of an input uploads a copy or a view of it): `candidates` notes which
        # inputs such an upload equals; the probe decides whether it is one of them
        # (`Jitted._probe`), and a check that it is again (`Program.matches`).
        self._arrays: dict[tuple[str, int], list[int]] = {}
        self._bytes: dict[int, bytes] = {}
        for k, a in enumerate(arrays):
            if isinstance(a, np.ndarray):
                array = cast(np.ndarray[Any, Any], a)
                self._arrays.setdefault((array.dtype.str, array.nbytes), []).append(k)
        self._arrays_of = arrays
        self.candidates: dict[int, list[int]] = {}  # upload buffer (by id) -> equal inputs
        # The ops' range checks (`_tensor.checked_range`): buffer, lowest and highest accepted.
        self.range_checks: list[tuple[Any, int, int]] = []
        # The ranges `keep_range` carried: a tensor (by id; held, so the id stays its own) ->
        # it and the tensors its range came from.
        self.kept_ranges: dict[int, tuple[AnyTensor, tuple[AnyTensor, ...]]] = {}

    def range_slots(self, t: AnyTensor) -> tuple[int, ...] | None:
        """The input slots whose integers make `t`'s known range (an input, or what a reshape,
        concat or cast of inputs carried), or None where it comes from elsewhere."""
        slot = None if t._buffer is None else self.input_slots.get(  # pyright: ignore[reportPrivateUsage]
            id(t._buffer))  # pyright: ignore[reportPrivateUsage]
        if slot is not None:
            return (slot,)
        kept = self.kept_ranges.get(id(t))
        if kept is None:
            return None
        slots: set[int] = set()
        for source in kept[1]:
            found = self.range_slots(source)
            if found is None:
                return None
            slots.update(found)
        return tuple(sorted(slots))

    def allowed_ranges(self) -> list[tuple[int, int] | None]:
        """Per input slot, the values every range check of it accepts, where each check read
        an input's own buffer; else (a check of a tensor made from inputs) None for every
        slot, as for a slot no check read. None for a numpy input too: f may do host work on
        it (`labels.max()`) that only a checking run with values past the recorded ones
        shows; a tensor's values f cannot read."""
        allowed: list[tuple[int, int] | None] = [None] * len(self._arrays_of)
        for buffer, low, high in self.range_checks:
            slot = None if buffer is None else self.input_slots.get(id(buffer))
            if slot is None:
                return [None] * len(self._arrays_of)
            had = allowed[slot]
            allowed[slot] = (low, high) if had is None else (max(had[0], low),
                                                              min(had[1], high))
        return [None if isinstance(a, np.ndarray) else bound
                for a, bound in zip(self._arrays_of, allowed, strict=True)]

    def _equal_inputs(self, host: np.ndarray[Any, Any]) -> list[int]:
        slots = self._arrays.get((host.dtype.str, host.nbytes), [])
        if not slots:
            return []
        data = host.tobytes()
        found: list[int] = []
        for k in slots:
            if k not in self._bytes:
                self._bytes[k] = cast(np.ndarray[Any, Any], self._arrays_of[k]).tobytes()
            if self._bytes[k] == data:
                found.append(k)
        return found

    def launched(self, device: Device, kernel: cl.Kernel, types: list[Any],
                 size: tuple[int, ...], local: tuple[int, ...], args: tuple[Any, ...],
                 largest: int | None) -> None:
        self.launches.append((device, kernel, types, size, local, args, largest))

    def uploaded(self, device: Device, host: np.ndarray[Any, Any], buffer: Any) -> None:
        self.uploaded_buffers.append(buffer)
        slot = self._host_slots.get(id(host))
        if slot is None:
            self.constants[id(buffer)] = _contents(host)
            equal = self._equal_inputs(host)
            if equal:
                self.candidates[id(buffer)] = equal
            return
        self.input_slots.setdefault(id(buffer), slot)

    def allocated(self, buffer: Any) -> None:
        self.fresh[id(buffer)] = buffer


def _contents(host: np.ndarray[Any, Any]) -> tuple[str, bytes]:
    return host.dtype.str, host.tobytes()


def _other_data(arrays: Sequence[Any]) -> dict[int, Any]:
    """For the probe, each numpy array given (by id) as other data of its dtype and shape,
    different for each slot k so that equal inputs differ: floats rotated by k + 1 places and
    mapped by v -> -v - (k + 1) (so that host work that keeps a value set, np.abs of positive
    data, np.sort, and inputs of one repeated value change too), else shifted by k + 1; bools
    flipped, with element k flipped back; ints rotated with element k set to another of their
    values (valid labels and indices still, in other counts), or (all equal) one step towards
    zero or up from zero. Arrays that no such change alters are left out."""
    other: dict[int, Any] = {}
    for k, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            continue
        array = cast(np.ndarray[Any, Any], a)
        if array.size == 0 or id(array) in other:
            continue  # an array given twice: its slots stay one input (the signature says so)
        flat = array.reshape(-1)
        turn = (k + 1) % flat.size
        rotated: np.ndarray[Any, Any] = (
            np.concatenate([flat[-turn:], flat[:-turn]]) if turn else flat.copy())
        kind = array.dtype.kind
        tries: list[np.ndarray[Any, Any]] = [rotated]
        if kind == "f":
            shift = array.dtype.type(k + 1)
            tries = [cast(np.ndarray[Any, Any], -rotated - shift),
                     cast(np.ndarray[Any, Any], flat + shift)]
        elif kind == "b":
            flipped = ~rotated
            flipped[k % flat.size] = ~flipped[k % flat.size]
            tries = [flipped]
        elif kind in "iu":
            # Rotated, then element k set to another value the array holds: the values stay
            # valid labels and indices (a step of every value by one left a label's range),
            # yet their counts change, as host work on them (np.bincount, sums, np.unique)
            # must show; a rotation alone kept them, and periodic labels were left alike.
            # An array of one repeated value is stepped by one.
            j = k % flat.size
            other_value = flat[flat != rotated[j]]
            unlike = other_value[other_value != flat[j]]  # nor the value the input had there
            if other_value.size:
                rotated[j] = unlike[0] if unlike.size else other_value[0]
                tries = [rotated]
            else:
                step = array.dtype.type(1)
                tries = [cast(np.ndarray[Any, Any], flat - step if flat[0] > 0 else flat + step)]
        data = flat.tobytes()
        moved = next((t for t in tries if t.tobytes() != data), None)
        if moved is not None:
            other[id(array)] = moved.reshape(array.shape)
    return other


def _tensor_copies(arrays: Sequence[Any]) -> dict[int, Any]:
    """For the probe, each tensor given (by id) as a copy in a buffer of its own (tensors
    sharing a buffer share the copy): a step that reads from a closure the tensor it was given
    as an argument (one buffer at the first call) then reads two buffers, and the probe sees
    it, where a replay would have read the argument for both."""
    copies: dict[int, Any] = {}
    made: dict[int, AnyTensor] = {}  # by source buffer
    for a in arrays:
        if not isinstance(a, AnyTensor) or a.size == 0 or id(a) in copies:
            continue
        copy = made.get(id(a.buffer))
        if copy is None:  # the driver's copy: no kernel to compile on a cold first call
            copy = made[id(a.buffer)] = empty((a.size,), a.dtype, a.device)
            a.device.copy(copy.buffer, a.buffer, a.size * a.dtype.itemsize)
        copies[id(a)] = copy.with_shape(a.shape)
    return copies


class _NotReplayable(Exception):
    """Why a recording cannot become a program (the signature then runs eagerly)."""


# A recording's uploads that are no input argument, in the order its launches first name
# them: (buffer id, contents, the inputs of the run whose contents it equals).
Uploads = list[tuple[int, tuple[str, bytes], list[int]]]


def _canonical(rec: _Recording, results: list[Any],
               known: dict[int, tuple[str, bytes]] | None = None) -> tuple[list[Any], Uploads]:
    """The recording as comparable data, with traced scalars left as functions of the numbers
    (`_materialise` evaluates them): buffers named by role (input slot, order of first use),
    scalars by their bytes as the kernel takes them; and its uploads (`Uploads`), named by
    their order, which a comparison of two runs looks at apart. `known` names the contents of
    constants an earlier recording uploaded (tapegrad keeps some, the backward's seed of ones,
    and a later recording finds them made)."""
    names: dict[int, Any] = {}
    uploads: Uploads = []

    def name(buffer: Any) -> Any:
        key = id(buffer)
        found = names.get(key)
        if found is None:
            if key in rec.constants:
                found = ("upload", len(uploads))
                uploads.append((key, rec.constants[key], rec.candidates.get(key, [])))
            elif key in rec.input_slots:
                found = ("in", rec.input_slots[key])
            elif key in rec.fresh:
                found = ("tmp", len(names))
            elif known is not None and key in known:  # last: its id may be reused meanwhile
                found = ("upload", len(uploads))
                uploads.append((key, known[key], []))
            else:
                found = ("outside", key)
            names[key] = found
        return found

    def scalar(value: Any, dtype: Any) -> Any:
        if dtype is None:
            return repr(value)
        if isinstance(value, Traced):
            fn = fn_of(value)

            def at(numbers: Sequence[Any]) -> bytes:
                return np.asarray(fn(numbers), dtype).tobytes()
            return at
        return np.asarray(value, dtype).tobytes()

    out: list[Any] = []
    for _, kernel, types, size, local, args, _ in rec.launches:
        out.append((id(kernel), size, local, *(
            name(a) if _is_buffer(a) else scalar(a, types[i]) for i, a in enumerate(args))))
    for leaf in results:
        if isinstance(leaf, AnyTensor):
            out.append((leaf.shape, leaf.dtype, name(leaf.buffer)))
        elif isinstance(leaf, Traced):
            out.append(fn_of(leaf))
        else:
            out.append(leaf)
    return out, uploads


def _outside(form: list[Any]) -> set[int]:
    """The buffers a recording's `_canonical` form names as from outside it (by id)."""
    found: set[int] = set()
    for item in form:
        for name in cast(tuple[Any, ...], item) if isinstance(item, tuple) else ():
            if isinstance(name, tuple) and cast(tuple[Any, ...], name)[:1] == ("outside",):
                found.add(cast(tuple[str, int], name)[1])
    return found


def _materialise(template: list[Any], numbers: Sequence[Any]) -> list[Any]:
    def value(x: Any) -> Any:
        if callable(x):
            return cast(NumberFn, x)(numbers)
        if isinstance(x, tuple):
            return tuple(value(y) for y in cast(tuple[Any, ...], x))
        return x
    return [value(x) for x in template]


def _same_work(template: list[Any], form: list[Any], numbers: Sequence[Any]) -> bool:
    """Whether two `_canonical` forms are the same work at `numbers`. Items equal as they
    stand are (the most, compared in C); only those that differ, a traced scalar's function
    among them, are evaluated at the numbers (`_materialise`), which for every item took
    most of a check's comparison."""
    if len(template) != len(form):
        return False
    for ours, theirs in zip(template, form, strict=True):
        if ours is not theirs and ours != theirs and (
                _materialise([ours], numbers) != _materialise([theirs], numbers)):
            return False
    return True


class Program:
    """A recorded step prepared for replay: one kernel object per launch with its arguments
    set; per call only the patched ones change (`dyn`: the input arrays' buffers, then fresh
    output buffers, then scalars computed from the call's numbers)."""

    def __init__(self, name: str, call: _Call, rec: _Recording, leaves: list[Any],
                 spec: Any, guards: Guards, donated: frozenset[int] = frozenset()) -> None:
        """`donated`: the input slots (tensors of donated arguments) whose buffers outputs may
        take (`_donations`)."""
        devices = {id(d): d for d, *_ in rec.launches}
        devices.update({id(t.device): t.device for t in leaves if isinstance(t, AnyTensor)})
        if len(devices) > 1:
            raise _NotReplayable("it works on several devices")
        self.device: Device = next(iter(devices.values())) if devices else default_device()
        self.name = name
        self.spec = spec
        self.guards = guards
        self.numbers = [plain(n) for n in call.numbers]
        self.ranges = call.int_ranges()
        # Per slot, the integers its ops' range checks accept, where known: a call whose
        # integers leave `ranges` but not these needs no check (`within`).
        self.allowed = rec.allowed_ranges()
        self.input_ids = {id(b) for b in call.buffers if _is_buffer(b)}  # see `aliased`
        self.template, self.uploads = _canonical(rec, leaves)
        # The template's uploads that are inputs (by their order, to the input's slot): numpy
        # reshapes of the inputs, as the probe found them (`link`); the others are constants.
        self.links: dict[int, int] = {}
        # The constants this recording uploaded that the program uses (it keeps them alive, so
        # their ids name them to a check that finds one kept by tapegrad, `_canonical`).
        self.constants = {key: contents for key, contents, _ in self.uploads}
        self.calls = 1  # this recording is the first
        self.changed = 0  # calls whose numbers differ from the recording's
        n_arrays = len(call.arrays)
        out_index: dict[int, int] = {}
        self.out_bytes: list[int] = []
        # How to make each result: ("fresh", k) output buffer k, ("input", slot), ("fixed",
        # tensor), ("number", fn), ("value", v); tensors with their shape and dtype.
        self.results: list[tuple[Any, ...]] = []
        for leaf in leaves:
            if isinstance(leaf, AnyTensor):
                key = id(leaf.buffer)
                if key in rec.input_slots:
                    self.results.append(("input", rec.input_slots[key], leaf.shape, leaf.dtype))
                elif key in rec.fresh:
                    if key not in out_index:
                        out_index[key] = len(self.out_bytes)
                        self.out_bytes.append(int(leaf.buffer.size))
                    # an integer result keeps the range its integer inputs give it, as eagerly
                    ranged = (rec.range_slots(leaf) if leaf.dtype.kind in "iu"
                              and host_range(leaf) is not None else None)
                    self.results.append(("fresh", out_index[key], leaf.shape, leaf.dtype,
                                         ranged or ()))
                else:
                    self.results.append(("fixed", leaf))
            elif isinstance(leaf, Traced):
                self.results.append(("number", fn_of(leaf)))
            else:
                self.results.append(("value", leaf))
        first_scalar = n_arrays + len(self.out_bytes)
        self.scalars: list[tuple[NumberFn, Callable[[Any], Any]]] = []
        # One slot per traced number and argument type: lr read by every optimizer launch is
        # computed once per call.
        scalar_slots: dict[tuple[int, Any], int] = {}
        self.launches: list[PreparedLaunch] = []
        self.kernel_names: list[str] = []
        launches = _live_launches(rec, leaves)
        home = _memory_plan(rec, launches, self.device, out_index)
        kept: dict[int, Any] = {}
        # Per launch, the buffers it names: ("in", slot), ("out", k) or ("held", n), for to_dot
        self.buffers: list[list[tuple[str, int]]] = []
        held_names: dict[int, int] = {}
        # Where each held buffer is an argument, (launch, argument): for `link`
        self._held_at: dict[int, list[tuple[int, int]]] = {}
        # The small launches, which may run on the device's inline lane (Device.run_launches):
        # (launch index, kernel, the arguments set on it but patches), to give each a twin
        # kernel once the lane is ready (`_take_twins`).
        self._small: list[tuple[int, cl.Kernel, list[tuple[int, Any]]]] = []
        for _, kernel, types, size, local, args, largest in launches:
            named: list[tuple[str, int]] = []
            self.buffers.append(named)
            # Arguments set one by one, scalars typed here: no set_scalar_arg_dtypes, whose
            # invoker pyopencl fetches from its disk cache per kernel object (most of a first
            # jitted call with warm caches).
            clone = cl.Kernel(kernel.program, kernel.function_name)
            small = self.device.is_small(kernel, args, largest)
            patches: list[tuple[int, int]] = []
            bound: list[Any] = []
            for i, a in enumerate(args):
                if _is_buffer(a):
                    key = id(a)
                    if key in rec.input_slots:
                        patches.append((i, rec.input_slots[key]))
                        named.append(("in", rec.input_slots[key]))
                    elif key in out_index:
                        patches.append((i, n_arrays + out_index[key]))
                        named.append(("out", out_index[key]))
                    else:  # an intermediate (in its planned buffer) or a constant
                        named.append(("held", held_names.setdefault(key, len(held_names))))
                        self._held_at.setdefault(key, []).append((len(self.launches), i))
                        a = home.get(key, a)
                        kept[id(a)] = a
                elif isinstance(a, Traced):
                    fn, convert = fn_of(a), np.dtype(types[i]).type
                    slot = scalar_slots.setdefault((id(fn), convert), len(self.scalars))
                    if slot == len(self.scalars):
                        self.scalars.append((fn, convert))
                    patches.append((i, first_scalar + slot))
                bound.append(plain(a))
            values = [(i, a if types[i] is None else np.dtype(types[i]).type(a))
                      for i, a in enumerate(bound)]
            for i, value in values:
                clone.set_arg(i, value)
            if small:
                patched = {i for i, _ in patches}
                self._small.append((len(self.launches), kernel,
                                    [(i, v) for i, v in values if i not in patched]))
            self.launches.append((clone, size, local, tuple(patches), None))
            self.kernel_names.append(str(kernel.function_name))
        self.n_inputs = n_arrays
        # output k -> the donated input slot whose buffer it is written into on replay
        self.donations = _donations(self, call, donated, launches, out_index,
                                    rec.input_slots) if donated else {}
        self.kept = list(kept.values())  # the program owns these (kernel args hold no refs)
        self.kept_bytes = sum(int(b.size) for b in self.kept)
        self._held_names = held_names
        self._twins_taken = -1  # the device's inline_generation when twins were last taken
        self._take_twins()

    def _take_twins(self) -> None:
        """Give the small launches the inline lane's kernels, as far as the lane has them (it
        may be building): each a kernel of its own, with this launch's arguments set."""
        device = self.device
        with device.lock:
            generation = device.inline_generation
            if not device.inline_ready:
                device.note_small(len(self._small))
            else:
                for n, kernel, values in self._small:
                    launch = self.launches[n]
                    if launch[4] is not None:
                        continue
                    program = device.inline_program(kernel)
                    if program is None:
                        continue  # its program is building (or failed): the queue's for now
                    twin = cl.Kernel(program, kernel.function_name)
                    for i, value in values:
                        twin.set_arg(i, value)
                    self.launches[n] = (*launch[:4], twin)
            self._twins_taken = generation

    def link(self, n: int, slot: int) -> None:
        """Read upload n of the template as input `slot` (the probe found it one: f reshaped
        the input with numpy): its launches take the call's input there, a result that is it
        becomes the input's data, and the program no longer holds it."""
        key = self.uploads[n][0]
        self.links[n] = slot
        small = {entry[0]: k for k, entry in enumerate(self._small)}
        for launch, arg in self._held_at.pop(key, []):
            kernel, size, local, patches, twin = self.launches[launch]
            self.launches[launch] = (kernel, size, local, (*patches, (arg, slot)), twin)
            if launch in small:  # a twin made later leaves it to the patch too
                n, main, values = self._small[small[launch]]
                self._small[small[launch]] = (n, main, [(i, v) for i, v in values if i != arg])
            held = ("held", self._held_names[key])
            self.buffers[launch] = [("in", slot) if b == held else b
                                    for b in self.buffers[launch]]
        for k, how in enumerate(self.results):
            if how[0] == "fixed" and id(how[1].buffer) == key:
                self.results[k] = ("input", slot, how[1].shape, how[1].dtype)
        self.constants.pop(key, None)
        self.kept = [b for b in self.kept if id(b) != key]
        self.kept_bytes = sum(int(b.size) for b in self.kept)

    def matches(self, form: list[Any], uploads: Uploads, numbers: Sequence[Any]) -> bool:
        """Whether a check's recording (`_canonical` of it, with this program's constants)
        made the program's launches: the same kernels, buffers by role and scalars at these
        numbers, the same constants, and uploads of the same inputs where the program reads
        one."""
        if not _same_work(self.template, form, numbers):
            return False
        return all(self.links[n] in equal if n in self.links else got == contents
                   for n, ((_, contents, _), (_, got, equal)) in enumerate(
                       zip(self.uploads, uploads, strict=True)))

    def aliased(self, form: list[Any]) -> bool:
        """Whether a run (`_canonical` of its recording) read a buffer from outside the step
        that was one of the recorded call's inputs: a tensor f reads from a closure, which
        was also an argument of the first call (one buffer then, so the recording read it as
        the input). For the warning's words only: the ids are of buffers that may have died
        since."""
        return not _outside(form).isdisjoint(self.input_ids)

    def holds(self, numbers: Sequence[Any]) -> bool:
        return self.guards.hold(numbers)

    def within(self, ranges: Sequence[tuple[int, int] | None]) -> bool:
        """Whether the call's integer inputs lie in ranges its recording checked, or in those
        its ops' range checks accept (the checks would pass)."""
        for had, has, bound in zip(self.ranges, ranges, self.allowed, strict=True):
            if has is None or (had is not None and had[0] <= has[0] and has[1] <= had[1]):
                continue
            if bound is None or has[0] < bound[0] or has[1] > bound[1]:
                return False
        return True

    def widen(self, ranges: Sequence[tuple[int, int] | None]) -> None:
        """Accept `ranges` too (an eager call's ops checked them)."""
        self.ranges = [has if had is None else had if has is None else
                       (min(had[0], has[0]), max(had[1], has[1]))
                       for had, has in zip(self.ranges, ranges, strict=True)]

    def needs_check(self, numbers: Sequence[Any]) -> bool:
        """Whether this call runs f again to compare (see CHECK_CALLS), counting it."""
        self.calls += 1
        if numbers != self.numbers:
            self.changed += 1
            # late checks by the calls only: numbers that change every call (a step count)
            # would have the two counts check at neighbouring calls, 128 and 129
            if self.changed in CHECK_CHANGED:
                return True
        return _checked_at(self.calls, CHECK_CALLS)

    def run(self, call: _Call, numbers: Sequence[Any],
            ranges: Sequence[tuple[int, int] | None]) -> list[Any]:
        """The program on the call's arrays and numbers (`ranges`: the arrays' integer
        ranges, as `_Call.int_ranges` gave them for the range check)."""
        device = self.device
        inputs = [a if isinstance(a, AnyTensor) else upload(np.asarray(a), device, known)
                  for a, known in zip(call.arrays, ranges, strict=True)]
        return self.run_on([t.buffer for t in inputs], inputs, numbers)

    def fresh_bytes(self) -> int:
        """The bytes of the outputs a replay allocates (not those written into donations)."""
        return sum(n for k, n in enumerate(self.out_bytes) if k not in self.donations)

    def inputs_read(self) -> list[int]:
        """The input slots the program reads (its launches' arguments, its results)."""
        slots = {k for *_, patches, _ in self.launches for _, k in patches if k < self.n_inputs}
        slots.update(how[1] for how in self.results if how[0] == "input")
        return sorted(slots)

    def run_on(self, buffers: list[Any], inputs: Sequence[Any], numbers: Sequence[Any]
               ) -> list[Any]:
        """The program on input buffers (a slot it does not read may hold None), `inputs`
        the tensors they are of (for the range an integer result keeps)."""
        device = self.device
        dyn: list[Any] = buffers
        donations = self.donations
        if donations:
            # A buffer other tensors share too (a reshape of the parameter: views share
            # buffers) is not taken: they would see the update. Its holders are then more
            # than the donated tensor, the call's list, this list and getrefcount's argument.
            donations = {k: slot for k, slot in donations.items()
                         if sys.getrefcount(buffers[slot]) <= _DONATED_HOLDERS}
        if donations:
            dyn += [device.allocate(n) if k not in donations else buffers[donations[k]]
                    for k, n in enumerate(self.out_bytes)]
        else:
            dyn += device.allocate_many(self.out_bytes)
        dyn += [convert(fn(numbers)) for fn, convert in self.scalars]
        if self._small and (self._twins_taken != device.inline_generation
                            or not device.inline_ready):
            self._take_twins()  # counts the small launches until the lane is ready
        device.run_launches(self.launches, dyn)
        for slot in donations.values():  # their buffers now hold outputs
            donate(inputs[slot], self.name)
        n_arrays = self.n_inputs
        leaves: list[Any] = []
        for how in self.results:
            kind = how[0]
            if kind == "fresh":
                made = tensor(dyn[n_arrays + how[1]], how[2], how[3], device)
                leaves.append(keep_range(made, *(inputs[s] for s in how[4])) if how[4]
                              else made)
            elif kind == "input":  # an input's data (reshaped): its known range too
                slot: int = how[1]
                leaves.append(keep_range(tensor(dyn[slot], how[2], how[3], device),
                                         inputs[slot]))
            elif kind == "number":
                leaves.append(how[1](numbers))
            else:
                leaves.append(how[1])
        return leaves

    def describe(self) -> str:
        lines = [f"program {self.name}: {len(self.launches)} launches, "
                 f"{len(self.out_bytes)} output buffers ({self.fresh_bytes():,} bytes a call), "
                 f"{len(self.kept)} buffers held ({self.kept_bytes:,} bytes), "
                 f"{len(self.scalars)} scalars from numbers; device memory of a replay at "
                 f"most {self.kept_bytes + self.fresh_bytes():,} bytes besides its inputs"
                 + (f"; {len(self.donations)} outputs written into donated inputs"
                    if self.donations else "")]
        for (_, size, local, patches, twin), kernel in zip(self.launches, self.kernel_names,
                                                         strict=True):
            lines.append(f"  {kernel} global={size} local={local} per-call args="
                         f"{[i for i, _ in patches]}" + " (inline lane)" * (twin is not None))
        return "\n".join(lines)


    def to_dot(self) -> str:
        """Graphviz DOT source: a box per launch (kernel and global size), an ellipse per input
        slot and per output buffer, and an edge from each launch (or input) to the later
        launches that name a buffer it wrote (the first launch naming a buffer writes it)."""
        lines = ["digraph program {", "  rankdir=TB;",
                 '  node [shape=box, fontname="monospace", fontsize=10];',
                 '  edge [color="gray40"];']
        writer: dict[tuple[str, int], str] = {}
        edges: set[tuple[str, str]] = set()
        for n, (named, kernel) in enumerate(zip(self.buffers, self.kernel_names,
                                                strict=True)):
            me = f"l{n}"
            lines.append(f'  {me} [label="{kernel}\\n{self.launches[n][1]}"];')
            for role in named:
                source = writer.get(role)
                if source is None and role[0] == "in":
                    source = f"in{role[1]}"
                    lines.append(f'  {source} [shape=ellipse, label="input {role[1]}"];')
                    writer[role] = source
                if source is None:
                    writer[role] = me
                elif source != me and (source, me) not in edges:
                    edges.add((source, me))
                    lines.append(f"  {source} -> {me};")
        for (kind, k), source in writer.items():
            if kind == "out":
                lines.append(f'  out{k} [shape=ellipse, style=filled, label="output {k}"];')
                lines.append(f"  {source} -> out{k};")
        lines.append("}")
        return "\n".join(lines)


def _live_launches(rec: _Recording, leaves: list[Any]) -> list[Launch]:
    """The recording's launches that the results depend on. Only buffers the step allocated
    can be written (inputs, constants and tensors from outside are values, never changed), so
    a launch naming none that a kept later launch names, or a result holds, is dead: a loss
    computed but not returned, or the forward sum whose value a backward does not read.
    Conservative where it cannot tell a write from a read: a launch naming a live buffer is
    kept, and everything it names becomes live."""
    live = {id(leaf.buffer) for leaf in leaves if isinstance(leaf, AnyTensor)}
    kept: list[Launch] = []
    for launch in reversed(rec.launches):
        names = [id(a) for a in launch[5] if _is_buffer(a)]
        writable = [key for key in names if key in rec.fresh]  # what it can have written
        if writable and not live.intersection(writable):
            continue
        live.update(names)
        kept.append(launch)
    kept.reverse()
    return kept


def _memory_plan(rec: _Recording, launches: list[Launch], device: Device,
                 outputs: dict[int, int]) -> dict[int, Any]:
    """Buffers for the step's intermediates, reused by liveness: an intermediate (allocated by
    the step, not an output) lives from the first launch that names it (which writes it) to
    the last; one whose life has ended lends its buffer to a later one that fits. Returns the
    buffer of each intermediate, by the id of the one it had when recorded."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for n, (_, _, _, _, _, args, _) in enumerate(launches):
        for a in args:
            key = id(a)
            if key in rec.fresh and key not in outputs and key not in rec.input_slots:
                first.setdefault(key, n)
                last[key] = n
                sizes[key] = int(a.size)
    ends: dict[int, list[int]] = {}
    for key, n in last.items():
        ends.setdefault(n, []).append(key)
    starts: dict[int, list[int]] = {}
    for key, n in first.items():
        starts.setdefault(n, []).append(key)
    free: list[Any] = []  # buffers whose intermediate is dead, smallest first
    home: dict[int, Any] = {}
    for n in range(len(launches)):
        for key in starts.get(n, ()):
            need = sizes[key]
            fit = next((k for k, b in enumerate(free) if int(b.size) >= need), None)
            home[key] = free.pop(fit) if fit is not None else device.allocate(need)
        for key in ends.get(n, ()):  # after this launch's own are placed: never shared in one
            free.append(home[key])
            free.sort(key=lambda b: int(b.size))
    return home


# References to a donated tensor's buffer when only that tensor holds it (see `run_on`).
_DONATED_HOLDERS = 4


def _donations(program: Program, call: _Call, donated: frozenset[int], launches: list[Launch],
               out_index: dict[int, int], input_slots: dict[int, int]) -> dict[int, int]:
    """Which outputs of `program` can be written into a donated input's buffer: one of the
    same dtype and byte size that no result returns, read by no launch after the one that
    first writes the output; read by that launch itself only where the kernel writes each
    element of the output from the same element of the input alone (an optimizer's update of
    a parameter and its state: `_optim.in_place`, given the recording's buffer ids). Output
    k -> input slot."""
    n_arrays = program.n_inputs
    last_read: dict[int, int] = {}  # input slot -> the last launch naming it
    first_write: dict[int, int] = {}  # output -> the first launch naming it
    for n, (_, _, _, patches, _) in enumerate(program.launches):
        for _, k in patches:
            if k < n_arrays:
                last_read[k] = n
            elif k - n_arrays < len(program.out_bytes):
                first_write.setdefault(k - n_arrays, n)
    returned = {how[1] for how in program.results if how[0] == "input"}
    out_buffers = {k: key for key, k in out_index.items()}  # the recording's buffer ids
    in_buffers = {k: key for key, k in input_slots.items()}
    free = sorted(k for k in donated if k not in returned)
    found: dict[int, int] = {}
    for how in program.results:
        if how[0] != "fresh" or how[1] in found or how[1] not in first_write:
            continue
        out, shape, dtype = how[1], how[2], how[3]
        n = first_write[out]
        for k in free:
            given: AnyTensor = call.arrays[k]
            if given.dtype != dtype or given.nbytes != math.prod(shape) * dtype.itemsize:
                continue
            read = last_read.get(k, -1)
            if read > n or (read == n and not in_place(
                    str(launches[n][1].function_name), launches[n][5], out_buffers[out],
                    in_buffers[k])):
                continue
            found[out] = k
            free.remove(k)
            break
    return found


class _Entry:
    """A signature's programs (variants whose guards differ), or `eager` with the reason."""

    def __init__(self) -> None:
        self.programs: list[Program] = []
        self.eager: str | None = None
        # Held while a program is recorded for the signature: a thread that finds no program
        # while another records runs eagerly instead of making one more of the same.
        self.recording = threading.Lock()


class Jitted(Generic[P, R]):
    """A function wrapped by `tg.jit`: call it as the function. `traces` counts recordings,
    `signatures` the signatures kept, `describe()` prints their programs."""

    def __init__(self, f: Callable[P, R], static_argnums: tuple[int, ...],
                 donate_argnums: tuple[int, ...]) -> None:
        self.f = f
        self._f = cast(Callable[..., R], f)
        self.static_argnums = static_argnums
        self.donate_argnums = donate_argnums
        self.name = getattr(f, "__name__", type(f).__name__)
        self._entries: OrderedDict[Signature, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.traces = 0  # recordings of a new program (a signature's first call, a variant)
        self.checks = 0  # recordings that checked a program (see the module docstring)
        # runs of f at a signature's first call: those that looked for the fused kernels a new
        # program needs (the last of which is its recording) and the probe's on other arrays
        self.surveys = 0
        self.replays = 0  # calls run as a program
        self._told_scalars = False  # the hint that numpy scalars key signatures, given once
        self.last_launches = 0  # kernel launches of the last replay or recording
        functools.update_wrapper(self, f)

    @property
    def signatures(self) -> int:
        return len(self._entries)

    def to_dot(self) -> str:
        """Graphviz DOT source of the most recently recorded program (`Program.to_dot`); render
        it with `dot -Tsvg`."""
        programs = [p for entry in self._entries.values() for p in entry.programs]
        if not programs:
            raise TapegradError(at_site(
                f"jit({self.name}): no program recorded yet (call the step first)"))
        return programs[-1].to_dot()

    def describe(self) -> str:
        """The programs recorded so far, launch by launch."""
        texts: list[str] = []
        for entry in self._entries.values():
            if entry.eager is not None:
                texts.append(f"{self.name}: runs eagerly ({entry.eager})")
            texts += [p.describe() for p in entry.programs]
        return "\n".join(texts)

    def _positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The call's arguments by position (static_argnums and donate_argnums name positions):
        keywords bound by f's signature, a parameter skipped before a given one taking its
        default; keyword-only parameters and f's **kwargs have no position, and are refused."""
        shown_names = ", ".join(f"{k}=" for k in kwargs)
        try:
            bound = inspect.signature(self._f).bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise ArgumentTypeError(at_site(
                f"jit({self.name}): the arguments do not fit f's parameters ({e})")) from None
        params = list(bound.signature.parameters.values())
        by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        unplaced = [p.name for p in params if p.name in kwargs and p.kind not in by_position]
        if unplaced:
            raise ArgumentTypeError(at_site(
                f"jit({self.name}): {', '.join(unplaced)} has no position in f's parameters "
                f"(keyword-only or **kwargs); tg.jit takes arguments by position, since "
                f"static_argnums and donate_argnums name positions (passed: {shown_names})"))
        placed = [p for p in params if p.kind in by_position]
        rest = [v for p in params if p.kind == inspect.Parameter.VAR_POSITIONAL
                for v in bound.arguments.get(p.name, ())]
        # through the last given, and the static and donated ones f gives defaults
        named = [*self.static_argnums, *self.donate_argnums]
        no_default = inspect.Parameter.empty
        wanted = [i for i, p in enumerate(placed) if p.name in bound.arguments] + [
            i for i in named if i < len(placed) and placed[i].default is not no_default]
        last = len(placed) - 1 if rest else max(wanted, default=-1)
        out = [bound.arguments.get(p.name, p.default) for p in placed[:last + 1]]
        return (*out, *rest)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if kwargs:
            args = cast(Any, self._positional(tuple(args), dict(kwargs)))
        for i in (*self.static_argnums, *self.donate_argnums):
            if i >= len(args):
                raise ShapeError(at_site(
                    f"jit({self.name}): argnum {i} is beyond the {len(args)} arguments given"))
        if _running.get() is not None:  # inside another jitted step: its recording sees this
            return self._f(*args)
        call = _Call(self.name, args, self.static_argnums)
        if anomaly_enabled():
            # detect_anomaly() checks every value on the host as it is made, which a program
            # cannot replay: the step runs eagerly in anomaly mode, its programs kept for later.
            return self._eager(call)
        entry = self._entry(call.signature)
        if entry.eager is not None:
            return self._eager(call)
        numbers = [plain(n) for n in call.numbers]
        program = next((p for p in entry.programs if p.holds(numbers)), None)
        if program is None:
            # Another thread recording this signature: run eagerly (the same bits) rather than
            # record it again, or wait (the recording step may itself wait on this thread).
            if not entry.recording.acquire(blocking=False):
                return self._eager(call)
            try:
                # Under the lock: another thread may have recorded it meanwhile.
                program = next((p for p in entry.programs if p.holds(numbers)), None)
                if program is None and entry.eager is None:
                    if len(entry.programs) < VARIANTS:
                        return self._record(call, entry, None)
                    self._give_up(entry, f"more than {VARIANTS} variants of one signature: a "
                                  "number's value decided the recorded work each time (a "
                                  "branch on it, float() or int() of it, tg.leaf of it, or "
                                  "numpy or math on it); pass it to tapegrad's ops as it is "
                                  "(tg.mul(tape, x, lr), optim's lr=lr), or make it static if "
                                  "it takes few values")
            finally:
                entry.recording.release()
            if program is None:  # given up, here or by the thread that held the lock
                return self._eager(call)
        ranges = call.int_ranges()
        if not program.within(ranges):
            # Integers outside the range the recording checked: a checking run, whose ops check
            # them again (an out-of-range label raises) and which compares its work, as host
            # work on such inputs may first show now.
            result = self._record(call, entry, program)
            if entry.eager is None:
                program.widen(ranges)
            return result
        if program.needs_check(numbers):
            return self._record(call, entry, program)
        self.replays += 1
        self.last_launches = len(program.launches)
        return cast(R, program.spec.unflatten(program.run(call, numbers, ranges)))

    def _entry(self, signature: Signature) -> _Entry:
        with self._lock:
            entry = self._entries.get(signature)
            if entry is not None:
                self._entries.move_to_end(signature)
                return entry
            if not self._told_scalars:
                loose = _without_scalar_values(signature)
                alike = next((s for s in self._entries if loose != signature
                              and _without_scalar_values(s) == loose), None)
                if alike is not None:
                    self._told_scalars = True
                    warnings.warn(JitCacheWarning(
                        f"jit({self.name}): a numpy scalar argument changed value ("
                        f"{_changed_scalar(alike, signature)}); numpy scalars are part of the "
                        "signature by "
                        "value, so each new value records a new program. Pass a Python number "
                        "(float(x), int(x)) for a value that changes between calls, as a "
                        "learning-rate schedule's: Python numbers are values of the program"),
                        stacklevel=3)
            entry = self._entries[signature] = _Entry()
            if len(self._entries) > CACHE_SIZE:
                evicted, _ = self._entries.popitem(last=False)
                warnings.warn(JitCacheWarning(
                    f"jit({self.name}): {CACHE_SIZE} signatures are kept; the oldest "
                    f"({_describe(evicted)}) was evicted and will be traced again: do the "
                    "shapes change every call?"), stacklevel=3)
            return entry

    def _donated(self, call: _Call) -> frozenset[int]:
        """The array slots of `call` from donated arguments that are tensors, each with a
        buffer of its own (a buffer given twice is read through the other slot too)."""
        if not self.donate_argnums:
            return frozenset()
        holders = Counter(call.sharing)
        return frozenset(
            k for k, (i, a) in enumerate(zip(call.arg_of, call.arrays, strict=True))
            if i in self.donate_argnums and isinstance(a, AnyTensor)
            and holders[call.sharing[k]] == 1)

    def _give_up(self, entry: _Entry, why: str) -> None:
        entry.eager = why
        entry.programs.clear()
        warnings.warn(JitWarning(f"jit({self.name}) runs this signature eagerly: {why}"),
                      stacklevel=4)

    @contextlib.contextmanager
    def _inside(self) -> Generator[None]:
        """What every run of f is under: named as this jitted function, host reads refused,
        forwards run as ops are recorded (a recording sees each op's launches)."""
        token = _running.set(self.name)
        try:
            with host_reads(_refuse_host_read), deferring(False):
                yield
        finally:
            _running.reset(token)

    def _eager(self, call: _Call) -> R:
        with self._inside():
            return self._called(call.rebuild(None))

    def _called(self, args: Sequence[Any]) -> Any:
        """f(*args); a TypeError from a call f's parameters do not fit is an ArgumentTypeError
        saying so, at the user's call (one raised inside f passes through)."""
        try:
            return self._f(*args)
        except TypeError as err:
            if takes_positional(self._f, len(args)) is False:
                raise ArgumentTypeError(at_site(
                    f"jit({self.name}): f does not take the {len(args)} positional "
                    f"argument{'s' * (len(args) != 1)} given ({err})")) from err
            raise

    def _run(self, call: _Call, guards: Guards | None, replace: dict[int, Any] | None = None
             ) -> tuple[list[Any], Any]:
        """f's result as leaves and structure, checked, its pending tensors computed (inside
        whatever recording or survey the caller opened); `replace`: see `_Call.rebuild`."""
        leaves, spec = flatten(self._called(call.rebuild(guards, replace)))
        _check_result(self.name, leaves, spec)
        for leaf in leaves:
            if isinstance(leaf, AnyTensor):
                _ = leaf.buffer  # a pending result is computed inside the step
        return leaves, spec

    def _record(self, call: _Call, entry: _Entry, checking: Program | None) -> R:
        """Run f under a recording. New: make it a program of `entry` (the surveys' last run
        is the recording where it found no kernel missing). Checking `checking`: compare the
        two, and trust the program or give the signature up."""
        try:
            if checking is None:
                done = self._survey(call)
            else:
                self.checks += 1
                # A checking recording gives the numbers decoy values for C code (see
                # `_traced`): work that depends on a number by an untraced path differs from
                # the program at once.
                done = None
            if done is None:
                done = self._recorded(call, Guards(decoy=checking is not None))
        except _CheckInside:
            self._give_up(entry, _ANOMALY)
            return self._eager(call)
        except Exception as err:
            if checking is None:
                if isinstance(err, TapegradError) or not any(
                        isinstance(n, int) for n in call.numbers):
                    raise
                # An int argument is traced, not an int: code that needs a real one (a host
                # random seed, isinstance) raised where the eager step runs: that signature
                # runs eagerly (an error of f's own is raised by the eager run too).
                result = self._eager(call)
                self._give_up(entry, _NEEDS_INT.format(type(err).__name__, err))
                return result
            # f raised on this call's data (the eager run raises it too, and the program
            # stands), or a decoy took f somewhere its value could not go (an index, a
            # shape): then the program cannot be trusted, and the eager run is the result.
            result = self._eager(call)
            self._give_up(entry, _UNTRACED)
            return result
        rec, guards, leaves, spec = done
        numbers = [plain(n) for n in call.numbers]
        self.last_launches = len(rec.launches)
        if checking is None:
            self.traces += 1
            result = cast(R, spec.unflatten([plain(x) for x in leaves]))
            try:
                program = Program(self.name, call, rec, leaves, spec, guards,
                                  self._donated(call))
            except _NotReplayable as why:
                self._give_up(entry, str(why))
                return result
            # The recording holds every buffer the step allocated; the program has its own
            # (the memory plan's): let them go before the probe's run allocates as many again.
            done = rec = None
            try:
                why = self._probe(call, program)
            except _CheckInside:
                why = _ANOMALY
            if why is not None:
                self._give_up(entry, why)
                return result
            entry.programs.append(program)
            return result
        form, uploads = _canonical(rec, leaves, checking.constants)
        if not checking.matches(form, uploads, numbers):
            self._give_up(entry, _ALIASED if checking.aliased(form) else _difference(numbers))
            return self._eager(call)  # this run's numbers were decoys where untraced
        return cast(R, spec.unflatten([plain(x) for x in leaves]))


    def _recorded(self, call: _Call, guards: Guards, replace: dict[int, Any] | None = None
                  ) -> _Run:
        """A run of f under a recording (`replace`: the arrays given instead of the call's,
        by id)."""
        arrays = None if replace is None else [replace.get(id(a), a) for a in call.arrays]
        rec = _Recording(call, arrays)
        with self._inside(), observing(rec), noting_range_checks() as (checks, kept):
            rec.range_checks = checks
            leaves, spec = self._run(call, guards, replace)
        rec.kept_ranges = {id(out): (out, sources) for out, sources in kept}
        return rec, guards, leaves, spec

    def _survey(self, call: _Call) -> _Run | None:
        """Run f, recorded, with the fused kernels it lacks noted instead of built, then build
        them together, until a run finds none missing (fused, a DAG's boundaries move, and new
        structures show): that run is the recording (None if none was). Building them one by
        one as it met them took most of a first call (~50 ms a program warm, ~0.3 s cold, on
        PoCL); a survey costs a run of f."""
        for _ in range(SURVEYS):
            self.surveys += 1
            done = None  # the last run's buffers go before this one's are allocated
            with surveying() as found:
                done = self._recorded(call, Guards())
            if not found:
                return done
            build_surveyed(found)
        return None

    def _probe(self, call: _Call, program: Program) -> str | None:
        """Why a new program cannot be replayed on other arrays, or None. f runs again,
        recorded, on other data of the signature (`_other_data`): the two runs must make the
        same launches with the same scalars and constants, but for uploads equal to an input
        in both runs (f reshaped it with numpy), which the program then reads as that input
        (`Program.link`). Host work on the inputs (x[:, 1:], x.astype(...), float(x.max()))
        makes other constants or scalars: the signature runs eagerly from this first call."""
        replace = _other_data(call.arrays)
        replace.update(_tensor_copies(call.arrays))
        if not replace:
            return None
        self.surveys += 1
        try:
            other, _, other_leaves, _ = self._recorded(call, Guards(), replace)
        except _CheckInside:
            raise
        except Exception as err:  # f checks its data on the host, say; or the device failed
            return f"{_OTHER_DATA} ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        numbers = [plain(n) for n in call.numbers]
        form, uploads = _canonical(other, other_leaves, program.constants)
        if not _same_work(program.template, form, numbers):
            return _ALIASED if program.aliased(form) else _HOST_WORK
        for n, ((_, contents, equal), (_, other_contents, other_equal)) in enumerate(
                zip(program.uploads, uploads, strict=True)):
            if contents == other_contents:
                continue  # alike on both data: a constant
            common = sorted(set(equal) & set(other_equal))  # the input it was on both runs
            # Slots given one array (the signature keeps them one) are that array.
            if common and all(call.arrays[k] is call.arrays[common[0]] for k in common):
                program.link(n, common[0])
            else:
                return _HOST_WORK
        return None


# A recorded run of f: the recording, its guards, and f's result as leaves and structure.
_Run = tuple[_Recording, Guards, list[Any], Any]


_UNTRACED = (
    "a number argument reached the device, or chose Python work, by a path Python arithmetic "
    "on it does not show: through the math module (math.cos(lr)) or C code reading a float. "
    "Compute from it with +, -, *, /, ** and numpy's functions (np.cos(np.pi * step / n) is "
    "followed), or mark the argument static")


_NEEDS_INT = (
    "the step raised {}: {} when recorded, where its int arguments are traced numbers, not "
    "ints (as a JAX tracer is not), and ran when called directly; it needs a real int (a "
    "host random seed, isinstance(step, int), json): mark that argument static, or compute "
    "with it in Python arithmetic and tapegrad's ops")


_OTHER_DATA = (
    "the step raised on other arrays of the same shapes and dtypes (a first call runs it on "
    "changed data to find host work on its inputs, which a replay could not follow): it "
    "decides something on the host from its input arrays, or the device failed")

_ALIASED = (
    "the step reads a tensor from outside (a closure or a global) that was also one of its "
    "arguments at the first call, so the recording could not tell the two apart; pass that "
    "tensor to the step as an argument of its own, or give the step a copy of it as the "
    "argument (tg.AnyTensor(x.numpy()))")

_HOST_WORK = (
    "the step uploads host data that changed with its input arrays (numpy on an input: "
    "x.astype(...), x[:, 1:], x / 255 before tg.leaf) or between runs (host random numbers, "
    "Python state), which a replay would take from the first call; do that outside the step "
    "and pass the result in, or after tg.leaf with tapegrad's ops (a numpy reshape of an input "
    "is followed and replays)")


def _difference(numbers: Sequence[Any]) -> str:
    """Why two recordings of one signature differ, for the warning."""
    arrays = ("the step did not make the same device work for new inputs of the same "
              "signature (it computes on its input arrays with numpy, or draws host random "
              "numbers, or reads Python state that changed); do that outside the step and pass "
              "the result in")
    # With number arguments, a number read by C code is the likelier cause: said first.
    return f"{_UNTRACED}; or {arrays[0].lower()}{arrays[1:]}" if numbers else arrays


def _describe(signature: Signature) -> str:
    """A signature as a reader would write its arguments: `float32[8, 4]` for an array,
    `float` for a number, `np.float32(0.001)` for a numpy scalar, a static argument's value."""
    args: list[str] = []
    parts: tuple[Any, ...] = signature
    for part in parts[:-1]:  # the last part says which buffers are shared
        if part[0] == "static":
            kind, value = part[1]
            args.append(f"static {float.fromhex(value) if kind is float else value!r}")
            continue
        kinds: list[str] = []
        kind: Any
        for kind in part[1]:
            if kind[0] == "array":
                kinds.append(f"{np.dtype(kind[2]).name}{list(kind[1])}")
            elif kind[0] == "number":
                kinds.append(kind[1].__name__)
            elif kind[0] == "numpy scalar":
                kinds.append(_scalar_text(kind))
            else:
                kinds.append(repr(kind[2]))
        args.append(kinds[0] if len(kinds) == 1 else "(" + ", ".join(kinds) + ")")
    text = ", ".join(args)
    return text if len(text) <= 200 else text[:197] + "..."


def _changed_scalar(before: Signature, now: Signature) -> str:
    """Where two signatures alike but for numpy scalars' values first differ: `args[1]['lr']:
    np.float32(0.1) -> np.float32(0.05)`."""
    old: Any
    new: Any
    for i, (old, new) in enumerate(zip(before[:-1], now[:-1], strict=True)):
        if old[0] == "static":
            continue
        for k, (a, b) in enumerate(zip(old[1], new[1], strict=True)):
            if a != b:
                return (f"args[{i}]{leaf_paths(new[0])[k]}: {_scalar_text(a)} -> "
                        f"{_scalar_text(b)}")
    return _describe(now)


def _scalar_text(kind: Any) -> str:
    dtype = np.dtype(kind[1])
    # An empty str_ has no bytes to read back (frombuffer refuses a zero item size).
    value: Any = np.frombuffer(kind[2], dtype)[0] if dtype.itemsize else dtype.type()
    if dtype.kind not in "biufc":  # a str_, a datetime64...
        return repr(value)
    return f"np.{value.dtype.name}({value!s})"


def _without_scalar_values(signature: Signature) -> Signature:
    """The signature with its numpy scalars' values left out (their dtypes kept)."""
    parts: list[Hashable] = []
    part: Any
    for part in signature[:-1]:  # the last part says which buffers are shared
        if part[0] == "static":
            parts.append(part)
            continue
        parts.append((part[0], tuple(_kind_without_value(kind) for kind in part[1]),
                      *part[2:]))
    return (*parts, signature[-1])


def _kind_without_value(kind: Any) -> Hashable:
    """A numpy number's kind without its value (a bool, a flag, keeps it: the hint to pass a
    Python number is for numbers)."""
    numeric = kind[0] == "numpy scalar" and np.dtype(kind[1]).kind in "iufc"
    return kind[:2] if numeric else kind


def _check_result(name: str, leaves: list[Any], spec: Any) -> None:
    """SPEC: a jitted function returns a pytree of AnyTensors; Python numbers are let through
    too, since an optimizer's state counts its steps in one (`adam`'s `step`)."""
    paths = leaf_paths(spec)
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, AnyTensor | bool | int | float | Traced):
            raise DTypeError(at_site(
                f"jit({name}): the result must be a pytree of AnyTensors, but result"
                f"{paths[k]} is a {type(leaf).__name__} (return tg.value(tape, id) for an id)"))


class _CheckInside(Exception):
    """Anomaly mode read a value to check it while a step was being recorded."""


_ANOMALY = (
    "the step checks values for NaN and Inf on the host (tg.detect_anomaly() or "
    "backward(check_finite=True) inside it), which a program cannot replay; take the check "
    "out of the step, or call the jitted step inside tg.detect_anomaly() when debugging (it "
    "then runs eagerly)")


def _refuse_host_read() -> None:
    if checking():  # anomaly mode's own read: fine where f runs eagerly, not in a recording
        if observed():
            raise _CheckInside()
        return
    name = _running.get()
    raise TapegradError(at_site(
        f"jit({name}): a value was read to the host inside the jitted function (numpy(), "
        "float(), item(), print of a tensor...). A jitted step is a program of device work: "
        "return the value and read it after the call"))


def jit(f: Callable[P, R], *, static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = ()) -> Jitted[P, R]:
    """Compile a step `f` (pytrees of arrays, AnyTensors and numbers in; a pytree of
    AnyTensors, and numbers, out): the first call of each signature records it, later calls
    replay it without running f's Python, with results bitwise equal to f's. See the module
    docstring for what is checked. On a replay, outputs that an optimizer's update writes from
    a donated argument's tensors (`donate_argnums`: new parameters and state from the old)
    take those tensors' buffers, which then refuse every read; other outputs get fresh
    buffers. Keyword arguments are bound to f's parameters by its signature and passed by
    position (the positions static_argnums and donate_argnums name)."""
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
        raise ShapeError(at_site(
            f"jit: {what} must be argument positions (>= 0), got {shown(value)}"))
    return tuple(sorted(set(numbers)))


# --- sweeps replayed -----------------------------------------------------------------------------
# An eager training loop sweeps a tape of the same structure every step, and the sweep's Python
# (a VJP, its ops and their fusion plans per node) is most of an RNN's step. A first-order sweep
# depends only on the tape's structure (primitives, params, number operands, shapes, dtypes,
# which nodes need gradients, the seed's kind) and on the values the VJPs read: so its second
# sighting is recorded as a program (the one `tg.jit` makes, its inputs the tape's computed
# values by position), its third recorded again and compared launch by launch (a recording
# that differs becomes the program the next is compared with: SWEEP_RECORDINGS), and later
# ones replay it on the new tape's values. The same kernels on the same values: the same bits.
# A recording that reads a buffer other than a tape's value, the seed, a constant tapegrad keeps
# or one it uploads itself (a value made outside the tape, say, in a custom op's closure) leaves
# that structure to the node-by-node sweep for good.
SWEEP_KEYS = 32  # structures kept, the least recently swept evicted
SWEEP_RECORD_AT = 2  # the sighting of a structure that is recorded (the next is compared)
# Device memory the programs may hold (their intermediates): past it the least recently swept
# structure's program goes (a loop over many sequence lengths makes a program per length).
SWEEP_BYTES = 256 << 20
# The most bytes of values a recorded sweep's tape may hold (see `SweepReplays.__call__`).
SWEEP_RECORD_BYTES = 256 << 20
# Sweeps that each met a new structure, in a row, after which keys are not made for the next
# SWEEP_REST sweeps: a loop whose params change every step (a dropout seed) never repeats one,
# and the key costs a few percent of its sweep.
SWEEP_MISSES = 8
SWEEP_REST = 64
# Recordings of a structure that may differ from the one before them: an eager loop's first
# steps still change what its forward leaves pending (a structure's fused kernel is built at
# its `fuse_after()`-th sighting, and a sum then reads its operand's DAG in place where it
# read a buffer), so the sweep's recording of step 2 may launch other kernels than step 3's. Each
# such recording becomes the program to compare the next one with; a structure whose
# recordings differ this many times in a row is swept node by node for good.
SWEEP_RECORDINGS = 4


class _SweepEntry:
    """A sweep structure's sightings and program (`off`: swept node by node for good)."""

    __slots__ = ("checked", "differed", "forced", "key", "numbers", "off", "program",
                 "reached", "recording", "seen", "unproven", "used")

    def __init__(self, key: Hashable) -> None:
        self.key = key  # the one kept in the table: found by identity, not compared again
        self.seen = 0
        self.program: Program | None = None
        self.checked = False
        self.off = False
        self.differed = 0  # recordings in a row that did not match the one before
        self.reached: list[int] = []  # the kept nodes, in the order of the program's results
        # The deferred positions the program computes, in the order of its results after them
        self.forced: list[int] = []
        self.used: list[int] = []  # the input positions the program reads
        # The numbers the program was recorded with, and those of its number operands that no
        # check has yet seen traced: a sighting where one differs is recorded and compared
        # (a check at the recorded value could not tell a constant made of it, as C code
        # reading the float makes, from the traced number), not replayed
        self.numbers: list[Any] = []
        self.unproven: list[int] = []
        self.recording = threading.Lock()


def _frozen(value: object) -> Hashable:
    """A node's params or number operand as part of a sweep's key: floats by their bits (a VJP
    may tell 0.0 from -0.0), tuples item by item; raises TypeError if it does not hash."""
    if value is None or value.__class__ is int or value.__class__ is bool:
        return value
    if value.__class__ is float:
        return ("float", cast(float, value).hex())
    if isinstance(value, tuple):
        items = cast(tuple[object, ...], value)
        kind: type = type(items)
        return (kind, *(_frozen(v) for v in items))
    hash(value)
    return (value.__class__, cast(Hashable, value))


class _Key:
    """A sweep's structure as a table key, its hash taken once: a key holds a part per node,
    and hashing it again for each lookup cost as much as making it."""

    __slots__ = ("_hash", "_parts")

    def __init__(self, parts: Hashable) -> None:
        self._parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (other.__class__ is _Key and self._hash == cast(_Key, other)._hash
                and self._parts == cast(_Key, other)._parts)


# Per params class: the fields that are a call's numbers (`call_numbers`), and whether it is a
# dataclass, which is its own part of a key (compared by class and fields), where `_frozen`
# would hash it twice.
_PARAMS_KINDS: dict[type, tuple[tuple[str, ...], bool]] = {}


def _params_kind(params: Any) -> tuple[tuple[str, ...], bool]:
    """Note and give `_PARAMS_KINDS`' entry for the class of `params` (first seen)."""
    cls = params.__class__
    kind = _PARAMS_KINDS[cls] = (getattr(cls, "call_numbers", ()), dataclasses.is_dataclass(cls))
    return kind


# A sweep's numbers: (node index, the node's params, field, value) of each field that params
# classes name in `call_numbers` (dropout's seed), in node order. They are values of the
# program, not of its structure: a loop drawing a new dropout mask every step replays too.
SweepNumbers = list[tuple[int, Any, str, Any]]
# A sweep's number operands: (node index, operand position, value) of each float operand of
# its nodes (`x / temperature`), in node order. Those seen to change are values of the program
# too (`_Replays._by_value`); the others are part of its structure, by their bits.
OperandNumbers = list[tuple[int, int, float]]
# A number operand's place in a sweep's structure (its value is in `OperandNumbers`).
_NUMBER_OPERAND = ("float",)


def _sweep_key(nodes: list[Node], top: int, need: list[bool], low: int, seed: AnyTensor,
               keep: set[int] | None
               ) -> tuple[Hashable, list[AnyTensor], SweepNumbers, OperandNumbers] | None:
    """The structure of a sweep from `top` down to `low`, its input positions (the values of
    the nodes swept, then of the nodes below `low` they read, then the seed unless it is a
    kept constant; and which positions share a buffer), its numbers (`SweepNumbers`, left
    out of the structure) and its number operands (`OperandNumbers`, left out too: see
    `_Replays._by_value`). None if some params do not hash (such a sweep is not
    replayed)."""
    parts: list[Hashable] = []
    positions: list[AnyTensor] = []
    numbers: SweepNumbers = []
    operands: OperandNumbers = []
    below: dict[int, None] = {}
    try:
        for i in range(low, top + 1):  # per node of the sweep: lean
            node = nodes[i]
            value = node.value
            positions.append(value)
            refs: list[Hashable] = []
            for k, a in enumerate(node.args):
                if a.__class__ is Id:
                    j: int = a.index
                    if j < low:
                        below[j] = None
                    refs.append(j - low)
                elif a.__class__ is float:
                    operands.append((i, k, a))
                    refs.append(_NUMBER_OPERAND)
                else:
                    refs.append(_frozen(a))
            params = node.params
            if params is not None:
                named, plain = _PARAMS_KINDS.get(params.__class__) or _params_kind(params)
                if named:
                    numbers.extend((i, params, name, getattr(params, name)) for name in named)
                    params = dataclasses.replace(params, **dict.fromkeys(named, 0))
                if not plain:
                    params = _frozen(params)
            parts.append((node.prim, tuple(refs), params, value.shape, value.dtype,
                          node.requires_grad, need[i]))
        for j in below:
            value = nodes[j].value
            positions.append(value)
            parts.append((j - low, value.shape, value.dtype))
        kept_seed = constant_value(seed)
        if kept_seed is None:
            positions.append(seed)
            parts.append(("seed", seed.shape, seed.dtype))
        else:
            parts.append(("kept seed", kept_seed.hex(), seed.shape, seed.dtype))
        parts.append(None if keep is None else tuple(sorted(k - low for k in keep)))
        # Which computed positions share a buffer (two leaves of one tensor, a reshape of a
        # value): the recording reads such a buffer through one of them, which a sweep whose
        # positions hold different tensors must not replay.
        parts.append(_sharing(computed_buffers(positions)))
        # Which positions are deferred (`_tape.defers`): the program computes those, and reads
        # the computed ones. A value read before the sweep (a loss logged first) makes
        # another structure, which reads it rather than computing it again.
        parts.append(tuple(k for k, t in enumerate(positions) if t.thunk is not None))
        key = _Key((top - low, tuple(parts)))
    except TypeError:
        return None
    return key, positions, numbers, operands


class _Replays:
    """Work replayed by structure: a table of structures (`_SweepEntry`), the least recently
    seen evicted, and what a recording of one does (`_recorded`). `enabled` (from the
    environment variable `switch`, default on) turns it off; `replays` and `recordings`
    count."""

    def __init__(self, switch: str) -> None:
        self.enabled = os.environ.get(switch, "1") != "0"
        self._entries: OrderedDict[Hashable, _SweepEntry] = OrderedDict()
        self._lock = threading.Lock()
        self._misses = 0  # sweeps in a row that met a new structure
        self._resting = 0  # sweeps still to run without a key
        # Per structure with number operands: their bits at its first sighting, and which of
        # them have changed since (None: none is traced, `_by_value_only`)
        self._operand_bits: dict[Hashable, tuple[tuple[int, ...], tuple[int, ...] | None]] = {}
        self.replays: int = 0
        self.recordings: int = 0

    def clear(self) -> None:
        """Forget every structure and zero the counts."""
        with self._lock:
            self._entries.clear()
            self._operand_bits.clear()
            self._misses = self._resting = 0
            self.replays = self.recordings = 0

    def _by_value(self, key: Hashable, operands: OperandNumbers
                  ) -> tuple[Hashable, OperandNumbers]:
        """The key of a structure (`key`) with number operands, and those of them that are
        the program's numbers. A structure's operands are its own by their bits (a model's
        constants: 0.5, an eps) until a sighting of the structure shows one changed (a
        temperature or a loss weight on a schedule, which would make every sighting a new
        structure); from then on that one is a number of the program, traced in its
        recording as a dropout seed is."""
        count = len(operands)
        bits = struct.unpack(f"{count}Q", struct.pack(f"{count}d", *[v for *_, v in operands]))
        with self._lock:
            seen = self._operand_bits.get(key)
            if seen is None:
                if len(self._operand_bits) >= SWEEP_KEYS * 4:
                    self._operand_bits.clear()
                seen = self._operand_bits[key] = (bits, ())
            elif bits != seen[0] and seen[1] is not None:
                changed = {k for k in range(count) if bits[k] != seen[0][k]} | set(seen[1])
                seen = self._operand_bits[key] = (seen[0], tuple(sorted(changed)))
        changing = seen[1]
        if not changing:
            return (key, (), bits), []
        fixed = tuple(bits[k] for k in range(count) if k not in changing)
        return (key, changing, fixed), [operands[k] for k in changing]

    def _by_value_only(self, key: Hashable) -> None:
        """A structure whose changing number operands could not be the program's numbers (its
        recording decided from one, or a check met a constant made of one) keys them all by
        value from now on, as one whose operands never changed: a sweep repeating a value
        replays its own program."""
        with self._lock:
            seen = self._operand_bits.get(key)
            if seen is not None:
                self._operand_bits[key] = (seen[0], None)

    def held_bytes(self) -> int:
        """Device memory the kept programs hold (intermediates and constants)."""
        with self._lock:
            return self._held()

    def _held(self) -> int:  # under `_lock`
        return sum(e.program.kept_bytes for e in self._entries.values() if e.program is not None)

    def _skipped(self) -> bool:
        """Whether this sighting is left to the plain path: replays off, inside a recording
        (a jitted step's or a sweep's, which records what runs), or resting after a run of
        new structures (SWEEP_MISSES)."""
        if not self.enabled or observed() or _running.get() is not None:
            return True
        if self._resting:
            self._resting -= 1
            return True
        return False

    def _sighting(self, key: Hashable) -> tuple[_SweepEntry, bool]:
        """The entry of a structure seen once more, and whether its program replays."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _SweepEntry(key)
                if len(self._entries) > SWEEP_KEYS:
                    self._entries.popitem(last=False)
                self._misses += 1
                if self._misses >= SWEEP_MISSES:
                    self._misses, self._resting = 0, SWEEP_REST
            else:
                self._entries.move_to_end(entry.key)
                self._misses = 0
            entry.seen += 1
            return entry, entry.program is not None and entry.checked and not entry.off

    def _replay(self, entry: _SweepEntry, inputs: list[AnyTensor], values: list[Any],
                deferred: list[AnyTensor]) -> list[Any]:
        """Run `entry`'s program on `inputs` (the slots it reads computed first) and the
        call's number `values`: each of `deferred` it computes (`entry.forced`) gets its
        buffer, and the results of the kept nodes (`entry.reached`) are returned."""
        program = entry.program
        assert program is not None
        buffers: list[Any] = [None] * len(inputs)
        for k in entry.used:
            buffers[k] = inputs[k].buffer
        leaves = program.run_on(buffers, inputs, values)
        self.replays += 1
        n = len(entry.reached)
        for k, made in zip(entry.forced, leaves[n:], strict=True):
            if deferred[k].thunk is not None:  # (not forced by another thread meanwhile)
                settle(deferred[k], made.buffer)
        return leaves[:n]

    def _recorded(self, entry: _SweepEntry, name: str, call: _Call, rec: _Recording,
                  leaves: list[Any], order: list[int], forced: list[int], values: list[Any],
                  operands_from: int | None = None) -> None:
        """A recording of `entry`'s structure (its results `leaves`: the kept nodes' in
        `order`, then the `forced` deferred positions'): its program, or compared with it.
        `values[operands_from:]` are number operands (`_by_value`): a check that matches
        proves those it met at other values than the program's traced (`unproven`)."""
        self.recordings += 1
        program = entry.program
        if program is not None:
            form, uploads = _canonical(rec, leaves, program.constants)
            if (order == entry.reached and forced == entry.forced
                    and program.matches(form, uploads, values)):
                entry.checked = True
                entry.unproven = [k for k in entry.unproven
                                  if _same_number(values[k], entry.numbers[k])]
                return
            entry.program = None
            entry.differed += 1
            if entry.differed >= SWEEP_RECORDINGS:
                entry.off = True
                return
        # The first recording, or one that differed from the last (see SWEEP_RECORDINGS):
        # the program the next sighting of the structure is compared with.
        made = _sweep_program(name, call, rec, leaves)
        if made is None:
            entry.off = True
        else:
            entry.program, entry.reached, entry.used = made, order, made.inputs_read()
            entry.forced, entry.numbers = forced, values
            entry.unproven = list(range(len(values) if operands_from is None else operands_from,
                                        len(values)))
            self._within_budget(entry)

    def _within_budget(self, kept: _SweepEntry) -> None:
        """Let go of the least recently seen structures' programs (but `kept`'s) while the
        programs hold more than SWEEP_BYTES."""
        with self._lock:
            held = self._held()
            for key in list(self._entries):
                if held <= SWEEP_BYTES:
                    break
                entry = self._entries[key]
                if entry is not kept and entry.program is not None:
                    held -= entry.program.kept_bytes
                    del self._entries[key]


class SweepReplays(_Replays):
    """`backward`'s first-order sweeps, replayed by structure (see above); off with
    TAPEGRAD_REPLAY_SWEEPS=0."""

    def __init__(self) -> None:
        super().__init__("TAPEGRAD_REPLAY_SWEEPS")

    def __call__(self, nodes: list[Node], loss: Id, need: list[bool], low: int,
                 seed: AnyTensor, keep: set[int] | None, sweep: Sweep) -> Reached:
        if self._skipped():
            return sweep({}, {})
        # A deferred value's forward may read nodes below `low` that no VJP reads: the key
        # then starts at the first node, so that their values are positions too.
        start = low
        for j in range(low):
            if nodes[j].value.thunk is not None:
                start = 0
                break
        found = _sweep_key(nodes, loss.index, need, start, seed, keep)
        if found is None:
            return sweep({}, {})
        key, positions, numbers, operands = found
        values = [value for *_, value in numbers]
        structure = key
        if operands:
            key, operands = self._by_value(structure, operands)
            values += [value for *_, value in operands]
        entry, ready = self._sighting(key)
        try:
            if ready and _as_recorded(entry, values):
                leaves = self._replay(entry, positions, values, positions)
                return dict(zip(entry.reached, leaves, strict=True))
            if entry.off or entry.seen < SWEEP_RECORD_AT:
                return sweep({}, {})
            if (entry.program is None
                    and sum(t.nbytes for t in positions) > SWEEP_RECORD_BYTES):
                # A recording keeps every buffer the sweep makes (its cotangents are not let
                # go as the sweep goes): a model this large would meet that peak. It is bound
                # by its kernels, not by the sweep's Python, anyway.
                entry.off = True
                return sweep({}, {})
            return self._record(entry, nodes, positions, start, numbers, operands, values,
                                sweep)
        finally:
            if entry.off and operands:
                self._by_value_only(structure)

    def _record(self, entry: _SweepEntry, nodes: list[Node], positions: list[AnyTensor],
                start: int, numbers: SweepNumbers, operands: OperandNumbers, values: list[Any],
                sweep: Sweep) -> Reached:
        """The sweep, recorded: made the structure's program, or compared with it. Its numbers
        and changing number operands reach the VJPs traced (the k-th as the k-th number of a
        replay); a sweep that decided anything from one (a guard) is not replayed."""
        if not entry.recording.acquire(blocking=False):  # another thread records it
            return sweep({}, {})
        try:
            call = _Call.of_inputs([t if t.pending is None and t.thunk is None else None
                                    for t in positions])
            deferred = [k for k, t in enumerate(positions) if t.thunk is not None]
            rec = _Recording(call)
            guards = Guards()
            traced_params = _traced_params(numbers, guards)
            traced_args: dict[int, list[Any]] = {}
            for k, (i, at, value) in enumerate(operands, len(numbers)):
                args = traced_args.get(i)
                if args is None:
                    args = traced_args[i] = list(nodes[i].args)
                args[at] = traced(value, _number_fn(k), guards)
            # A deferred forward's numbers are traced too, and so are a pending value's (its
            # recipe's, which the recording computes). (An operand that is not its node's
            # number, the same object, stays: a check sees the constant it makes.)
            params_of: dict[Forward, Any] = {}
            operands_of: dict[Forward | Pending, dict[int, Any]] = {}
            for i in {**traced_params, **traced_args}:
                value = positions[i - start]
                owner: Forward | Pending | None = (
                    cast(Forward, value.thunk) if value.thunk.__class__ is Forward
                    else value.pending)
                if owner is None:
                    continue
                if i in traced_params and owner.__class__ is Forward:
                    params_of[cast(Forward, owner)] = traced_params[i]
                args = traced_args.get(i)
                if args is not None and len(owner.operands) == len(args):
                    operands_of[owner] = {
                        at: arg for at, (was, number, arg) in enumerate(
                            zip(owner.operands, nodes[i].args, args, strict=True))
                        if arg.__class__ is TracedFloat and was is number}
            with _traced_in(params_of, operands_of), observing(rec):
                reached = sweep(traced_params, {i: tuple(a) for i, a in traced_args.items()})
            order = sorted(reached)
            leaves = [reached[i] for i in order]
            # The deferred values the sweep computed, which the program computes too: the
            # tape holds them, as it holds an eager forward's.
            forced = _computed_in(rec, positions, deferred)
            leaves += [positions[k] for k in forced]
            if guards.facts:
                entry.off = True  # decided from a number: replays check no guards
                entry.program = None
                return reached
            self._recorded(entry, "backward", call, rec, leaves, order, forced, values,
                           len(numbers))
            return reached
        finally:
            entry.recording.release()


def _traced_params(numbers: SweepNumbers, guards: Guards) -> dict[int, Any]:
    """Per node (its index) of a sweep or a forced DAG, its params with its numbers (the k-th
    of `numbers`) traced as the k-th number of a replay."""
    made: dict[int, Any] = {}
    for k, (i, params, name, value) in enumerate(numbers):
        made[i] = dataclasses.replace(made.get(i, params),
                                      **{name: traced(value, _number_fn(k), guards)})
    return made


@contextlib.contextmanager
def _traced_in(params: Mapping[Forward, Any],
               operands: Mapping[Forward | Pending, Mapping[int, Any]]
               ) -> Generator[None, None, None]:
    """While a replay's recording runs: these forwards' params, and these forwards' or pending
    recipes' operands at the positions given, are the ones with traced numbers; each owner
    gets its own back after (one the recording did not run, too)."""
    kept_params = [(forward, forward.params) for forward in params]
    kept_operands = [(owner, owner.operands) for owner in operands]
    for forward, traced_params in params.items():
        forward.params = traced_params
    for owner, at in operands.items():
        made = [at.get(k, was) for k, was in enumerate(owner.operands)]
        if owner.__class__ is Pending:
            cast(Pending, owner).operands = tuple(made)
        else:
            cast(Forward, owner).operands = made
    try:
        yield
    finally:
        for forward, had in kept_params:
            forward.params = had
        for owner, had_operands in kept_operands:
            owner.operands = cast(Any, had_operands)


def _same_number(a: float, b: float) -> bool:
    """Whether two floats have the same bits (0.0 and -0.0 differ; a NaN is itself)."""
    return struct.pack("d", a) == struct.pack("d", b)


def _as_recorded(entry: _SweepEntry, values: Sequence[Any]) -> bool:
    """Whether `entry`'s program may run at `values`: each number operand no check has seen
    traced (`unproven`) at the value it was recorded with."""
    return all(_same_number(values[k], entry.numbers[k]) for k in entry.unproven)


def _computed_in(rec: _Recording, tensors: list[AnyTensor], which: Iterable[int]) -> list[int]:
    """Those of `which` whose tensor is computed into a buffer the recording made: the
    deferred values a program computes (one left pending stays deferred after a replay)."""
    buffers = computed_buffers(tensors)
    return [k for k in which if buffers[k] is not None and id(buffers[k]) in rec.fresh]


def _sweep_program(name: str, call: _Call, rec: _Recording, leaves: list[Any]
                   ) -> Program | None:
    """A recorded sweep (or forward) as a program, or None where it launched nothing (it would
    not know its device), read a buffer from outside the tape, or returned one (a constant):
    a later sighting of the structure may not share it."""
    try:
        program = Program(name, call, rec, leaves, None, Guards())
    except _NotReplayable:
        return None
    if not program.launches or any(how[0] == "fixed" for how in program.results):
        return None
    if not _outside(program.template) <= kept_buffers():
        return None
    return program


sweep_replays = SweepReplays()
set_replayer(sweep_replays)


# --- deferred forwards replayed -------------------------------------------------------------
# A deferred DAG that is read outside a sweep (an evaluation's logits, a loss logged before
# backward, gradient clipping on a tape of its own that an optimizer then reads) is forced
# node by node: each node's forward and fusion plans, the Python a sweep's replay spares the
# forward it records. Such a DAG's structure repeats every step too, so it is replayed the same
# way: keyed by its thunks' primitives, params, operands (its own nodes by position, the
# computed tensors it reads as inputs, the recipes of pending ones over those), shapes and dtypes;
# recorded at its second sighting, with the tensor read computed inside; compared at its
# third; later ones run the program and give each deferred tensor it computed its buffer.
# Not inside a recording (a sweep's, tg.jit's: they record the forward themselves).
# Smaller DAGs run node by node and take no place in the table (SWEEP_KEYS) from larger ones:
# replaying them saves little (a read's round trip is most of a short chain's time).
FORCE_REPLAY_MIN = 8


def _force_key(order: list[AnyTensor], roots: Sequence[AnyTensor]
               ) -> tuple[Hashable, list[AnyTensor], SweepNumbers, OperandNumbers,
                          list[Pending]] | None:
    """A deferred DAG's structure (`order`: `deferred_dag`'s of `roots`, the tensors read), its
    inputs, its numbers (a dropout seed: the node's position in `order`, as a sweep's
    `SweepNumbers`), its number operands (left out of the structure, as a sweep's, see
    `_Replays._by_value`: (node, operand, value) of its forwards', (-1 - r, operand, value)
    of the r-th pending recipe's it computes) and those recipes; or None where a thunk is not
    a node's `Forward` or a params object does not hash."""
    index = {id(u): j for j, u in enumerate(order)}
    inputs: list[AnyTensor] = []
    numbers: SweepNumbers = []
    operands: OperandNumbers = []
    slots: dict[int, int] = {}
    parts: list[Hashable] = []
    recipes: dict[int, int] = {}
    pendings: list[Pending] = []

    def number(owner: int, k: int, o: object) -> Hashable:
        if o.__class__ is float:
            operands.append((owner, k, cast(float, o)))
            return _NUMBER_OPERAND
        return _frozen(o)

    def outside(a: AnyTensor) -> Hashable:
        """An operand from outside the DAG: an input, or a pending recipe over inputs (`x * x`
        of a computed x, read by a deferred sum), computed inside the program rather than
        launched apart first. One already computed on the node-by-node path is an input."""
        recipe = a.pending
        if recipe.__class__ is Pending and cast(Pending, recipe).value is None:
            r = recipes.get(id(a))
            if r is None:
                p = cast(Pending, recipe)
                pendings.append(p)
                owner = -len(pendings)
                made = tuple(outside(o) if o.__class__ is AnyTensor else number(owner, k, o)
                             for k, o in enumerate(p.operands))
                r = recipes[id(a)] = len(recipes)
                parts.append(("pending", None if p.expr is None else p.expr.name, made,
                              p.repeat, p.view, a.shape, a.dtype))
            return ("pending", r)
        j = slots.get(id(a))
        if j is None:
            if recipe is not None:
                _ = a.buffer  # computed: the program reads it (a donated one raises here)
            j = slots[id(a)] = len(inputs)
            inputs.append(a)
        return ("in", j)

    try:
        for i, u in enumerate(order):
            thunk = u.thunk
            if thunk.__class__ is not Forward:
                return None
            forward = cast(Forward, thunk)
            refs: list[Hashable] = []
            for k, a in enumerate(forward.operands):
                if a.__class__ is AnyTensor:
                    j = index.get(id(a))
                    refs.append(outside(a) if j is None else j)
                else:
                    refs.append(number(i, k, a))
            params = forward.params
            if params is not None:
                named, plain_params = (_PARAMS_KINDS.get(params.__class__)
                                       or _params_kind(params))
                if named:
                    numbers.extend((i, params, name, getattr(params, name)) for name in named)
                    params = dataclasses.replace(params, **dict.fromkeys(named, 0))
                if not plain_params:
                    params = _frozen(params)
            parts.append((forward.prim, tuple(refs), params, u.shape, u.dtype))
        parts.extend((a.shape, a.dtype) for a in inputs)
        parts.append(_sharing(computed_buffers(inputs)))
        parts.append(tuple(index[id(t)] for t in roots))  # the values the program computes
        return _Key(tuple(parts)), inputs, numbers, operands, pendings
    except TypeError:
        return None


class ForceReplays(_Replays):
    """Deferred forwards read outside a sweep, replayed by structure (see above); off with
    TAPEGRAD_REPLAY_FORWARDS=0. Installed as `_tensor`'s forcer: True where it computed the
    buffers of the deferred tensors `roots` (of one device)."""

    def __init__(self) -> None:
        super().__init__("TAPEGRAD_REPLAY_FORWARDS")

    def __call__(self, roots: Sequence[AnyTensor]) -> bool:
        if self._skipped():
            return False
        with roots[0].device.lock:  # one thread forces a DAG; the others then find it done
            # (some roots may have been forced meanwhile by another thread's DAG)
            roots = [t for t in roots if t.thunk is not None]
            order = deferred_dag(roots)
            if len(order) < FORCE_REPLAY_MIN:
                return False
            found = _force_key(order, roots)
            if found is None:
                return False
            key, inputs, numbers, operands, pendings = found
            structure, values = key, [value for *_, value in numbers]
            if operands:
                key, operands = self._by_value(structure, operands)
                values += [value for *_, value in operands]
            entry, ready = self._sighting(key)
            try:
                if ready and _as_recorded(entry, values):
                    self._replay(entry, inputs, values, order)
                    # (each root settled: not if the program did not compute it)
                    return all(t.thunk is None for t in roots)
                if (entry.off or entry.seen < SWEEP_RECORD_AT
                        or not entry.recording.acquire(blocking=False)):
                    return False
                try:
                    self._record(entry, order, roots, inputs, numbers, operands, pendings,
                                 values)
                finally:
                    entry.recording.release()
                return True
            finally:
                if entry.off and operands:
                    self._by_value_only(structure)

    def _record(self, entry: _SweepEntry, order: list[AnyTensor], roots: Sequence[AnyTensor],
                inputs: list[AnyTensor], numbers: SweepNumbers, operands: OperandNumbers,
                pendings: list[Pending], values: list[Any]) -> None:
        """The DAG forced, recorded: made the structure's program, or compared with it. Its
        numbers and changing number operands reach the forwards and recipes traced; a
        recording that decided anything from one (a guard) is not replayed."""
        call = _Call.of_inputs(inputs)
        rec = _Recording(call)
        guards = Guards()
        params_of = {cast(Forward, order[i].thunk): params
                     for i, params in _traced_params(numbers, guards).items()}
        operands_of: dict[Forward | Pending, dict[int, Any]] = {}
        for k, (i, at, value) in enumerate(operands, len(numbers)):
            owner = cast(Forward, order[i].thunk) if i >= 0 else pendings[-1 - i]
            operands_of.setdefault(owner, {})[at] = traced(value, _number_fn(k), guards)
        with _traced_in(params_of, operands_of), observing(rec):
            run_deferred(order)
            for t in roots:
                _ = t.buffer  # read: computed inside, a result of the program
        if guards.facts:
            entry.off = True  # decided from a number: replays check no guards
            entry.program = None
            return
        forced = _computed_in(rec, order, range(len(order)))
        self._recorded(entry, "forward", call, rec, [order[k] for k in forced], [], forced,
                       values, len(numbers))


force_replays = ForceReplays()
set_forcer(force_replays)
