"""The tape: an immutable, grow-only sequence of nodes indexed by integer ids.

Invariants:
- A `Tape` is a (store, length) pair. Its nodes are `store[:length]`, and no node is ever
  changed or removed, so a tape's contents are fixed for its life.
- Appending to a tape whose length is the store's length appends to the shared store in place
  (O(1) amortized); the older tape still sees only its prefix. Appending to a shorter tape (a
  branch) first copies its prefix to a fresh store, so a longer tape is never disturbed.
- Every node has a process-unique `uid`, carried by its `Id`. An id is valid on a tape exactly
  when that tape holds the very node at `id.index`: the tape that made it, any tape grown from
  that one, but not a sibling branch or an unrelated tape (`TapeError`).
- Nodes are in topological order: parents always have smaller indices than their children.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import os
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Concatenate, NamedTuple, NoReturn, ParamSpec, TypeVar, cast

import numpy as np

from ._anomaly import _enabled, nonfinite
from ._backend import get_device
from ._errors import (
    AnomalyError,
    ArgumentTypeError,
    DeviceError,
    DTypeError,
    NotAnIdError,
    ShapeError,
    TapeError,
    at_site,
    call_site,
    fits,
    flag,
    format_site,
    shown,
)
from ._primitive import Aval, Primitive, apply
from ._tensor import (
    FLOATS,
    AnyTensor,
    DType,
    Shape,
    deferred,
    host_array,
    host_range,
    is_float,
    upload,
)
from ._traced import is_integer

if TYPE_CHECKING:  # the tape holds its device; it reaches it through `_backend` only
    from ._device import Device

_uids = itertools.count()  # next() on a count is atomic under the GIL
_APPEND = threading.Lock()
_APPEND_ACQUIRE, _APPEND_RELEASE = _APPEND.acquire, _APPEND.release


# Immutable classes (Id, Tape) raise in __setattr__, so their fields cannot be assigned plainly.
# A node's Id and Tape are made per op; they are made as their mutable base (plain slot
# assignment in __init__) and then given their class: ~0.3 us each, where setting the slots
# through their descriptors took ~0.6 (`_append`).


class _IdFields:
    __slots__ = ("_uid", "dtype", "index", "shape")
    index: int
    shape: Shape
    dtype: DType
    _uid: int

    def __init__(self, index: int, shape: Shape, dtype: DType, uid: int) -> None:
        self.index = index
        self.shape = shape
        self.dtype = dtype
        self._uid = uid


class Id(_IdFields):
    """A handle to one node: its index, shape and dtype. Immutable and hashable."""

    __slots__ = ()

    def __init__(self, index: int, shape: Shape, dtype: DType, uid: int) -> None:
        _ID_INDEX(self, index)
        _ID_SHAPE(self, shape)
        _ID_DTYPE(self, dtype)
        _ID_UID(self, uid)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Id is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Id is immutable")

    # Immutable: a copy is the id itself (copy, deepcopy of a pytree holding ids). It names a
    # node of a tape in this process, so it is not pickled.
    def __copy__(self) -> Id:
        return self

    def __deepcopy__(self, memo: object) -> Id:
        return self

    def __reduce__(self) -> NoReturn:
        raise TapeError(f"{self!r} cannot be pickled: it names a node of a tape in this "
                        "process; pickle its value (tg.value(tape, id).numpy()) instead")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __hash__(self) -> int:
        return hash(self._uid)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Id) and other._uid == self._uid

    def __repr__(self) -> str:
        return f"Id({self.index}, shape={self.shape}, dtype={self.dtype})"


class Node(NamedTuple):
    """One recorded value: the op that made it, its parents, its value and where it was made.

    A NamedTuple: immutable, and made in one C call (`_new_node`), since one is made per op.
    """

    id: Id
    prim: Primitive[Any] | None
    op: str
    args: tuple[Any, ...]
    parents: tuple[Id, ...]
    params: Any
    value: AnyTensor
    requires_grad: bool
    name: str | None
    location: tuple[str, int]  # the user's (file, line); `site` formats it

    @property
    def site(self) -> str:
        """The user's file:line that recorded this node."""
        return format_site(self.location)

    def __hash__(self) -> int:  # one node per id (its fields, params say, need not hash)
        return hash(self.id)

    def __repr__(self) -> str:
        parents = ", ".join(str(p.index) for p in self.parents)
        label = f" {self.name!r}" if self.name else ""
        return (f"Node({self.id.index}: {self.op}{label}({parents}) -> {self.value.shape} "
                f"{self.value.dtype}, requires_grad={self.requires_grad}, at {self.site})")


# tuple.__new__ itself: NamedTuple's generated __new__ is a Python function around it.
_new_node: Callable[[type[Node], tuple[Any, ...]], Node] = cast(Any, tuple).__new__


def _arg_name(arg: str | int) -> str:
    return f"#{arg}" if isinstance(arg, int) else arg


class Call(NamedTuple):
    """One call of a public op that recorded several nodes (`layer_norm`'s mean, sub, mul...),
    or one under another name (`linear`'s `matmul`): nodes `first`..`last` of the tape, `out`
    the node it returned. `describe` and `to_dot` show such a call as one row, expandable."""

    op: str
    first: int
    last: int
    out: int


def _first_node(call: Call) -> int:
    return call.first


class _Store:
    """The nodes shared by a line of tapes, and the public calls that recorded them (by their
    first node). Both only grow; a tape sees the prefix of its length."""

    __slots__ = ("calls", "nodes")

    def __init__(self, nodes: list[Node], calls: dict[int, Call]) -> None:
        self.nodes = nodes
        self.calls = calls


class _TapeFields:
    __slots__ = ("_length", "_store", "device")
    _store: _Store
    _length: int
    device: Device

    def __init__(self, store: _Store, length: int, device: Device) -> None:
        self._store = store
        self._length = length
        self.device = device


class Tape(_TapeFields):
    """An immutable tape of nodes on one device: ops return a longer tape; this one stays."""

    __slots__ = ()

    def __init__(self, device: Device | str | None = None) -> None:
        _TAPE_DEVICE(self, get_device(device, "Tape"))
        _TAPE_STORE(self, _Store([], {}))
        _TAPE_LENGTH(self, 0)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Tape is immutable: ops return a new tape")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Tape is immutable: ops return a new tape")

    def __copy__(self) -> Tape:  # immutable: a copy is the tape itself (see Id)
        return self

    def __deepcopy__(self, memo: object) -> Tape:
        return self

    def __reduce__(self) -> NoReturn:
        raise TapeError("a Tape cannot be pickled: its values live on an OpenCL device of "
                        "this process; pickle the values you need (tg.value(...).numpy())")

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, key: Id | int) -> Node:
        if isinstance(key, Id):
            return self.node(key, "tape[...]", "id")
        if key.__class__ is not int:
            given: object = key
            try:
                if isinstance(given, bool | np.bool_):
                    raise TypeError
                key = operator.index(given)  # numpy's ints
            except TypeError:
                raise TapeError(at_site(f"tape[...] takes an Id or an int index, not "
                                        f"{type(given).__name__}")) from None
        if not -self._length <= key < self._length:
            raise TapeError(at_site(
                f"tape index {key} is out of range for a tape of {self._length} nodes"))
        return self._store.nodes[key % self._length]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.prefix(self._length))

    def prefix(self, stop: int) -> list[Node]:
        """Nodes 0..stop-1 (stop <= len(self)) as a list: one slice for a whole sweep, where
        `tape[i]` would re-check every index."""
        return self._store.nodes[: min(stop, self._length)]

    def __repr__(self) -> str:
        return f"Tape({self._length} nodes on {self.device.name!r})"

    def calls(self) -> list[Call]:
        """The public op calls on this tape that recorded more than one node, or one of
        another name, in order."""
        length = self._length
        return sorted((c for c in list(self._store.calls.values()) if c.last < length),
                      key=_first_node)

    def node(self, id: Id, op: str, arg: str | int) -> Node:
        """The node of `id`, or `TapeError` if this tape does not hold that very node. `arg`
        names the argument in the error; an int n stands for "#n" and is formatted only on an
        error, since `record` calls this for every operand of every op."""
        if not isinstance(id, Id):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise NotAnIdError(at_site(f"{op}: argument {_arg_name(arg)!r} must be an Id, not "
                                       f"{type(id).__name__} ({id_hint(id)})"))
        index = id.index
        if index < self._length:
            node = self._store.nodes[index]
            if node.id._uid == id._uid:
                return node
            raise TapeError(at_site(
                f"{op}: argument {_arg_name(arg)!r} ({id!r}) belongs to another tape or to a "
                f"sibling branch: this tape holds a different node at index {index}"))
        raise TapeError(at_site(
            f"{op}: argument {_arg_name(arg)!r} ({id!r}) is beyond this tape of {self._length} "
            "nodes: it was made on a longer tape or another tape"))

    def _append(
        self, prim: Primitive[Any] | None, args: tuple[Any, ...], parents: tuple[Id, ...],
        params: Any, value: AnyTensor, requires_grad: bool, name: str | None,
        site: tuple[str, int],
    ) -> tuple[Tape, Id]:
        new_id: Any = _IdFields(self._length, value.shape, value.dtype, next(_uids))
        new_id.__class__ = Id
        node = _new_node(Node, (new_id, prim, prim.name if prim is not None else "leaf", args,
                                parents, params, value, requires_grad, name, site))
        _APPEND_ACQUIRE()  # threads growing one tape: each append sees the store's true length
        try:  # (acquire and release: twice as fast as `with`, and this runs for every node)
            store = self._store
            if len(store.nodes) != self._length:
                length = self._length
                store = _Store(store.nodes[:length],
                               {k: c for k, c in store.calls.items() if c.last < length})
            store.nodes.append(node)
        finally:
            _APPEND_RELEASE()
        tape: Any = _TapeFields(store, self._length + 1, self.device)
        tape.__class__ = Tape
        return tape, new_id


# Their public constructors set the slots through the slot descriptors (a new Tape, an Id made
# outside `_append`): their own __setattr__ refuses.
Setter = Callable[[Any, Any], None]


def _setters(cls: type, *names: str) -> list[Setter]:
    return [cls.__dict__[name].__set__ for name in names]


_ID_INDEX, _ID_SHAPE, _ID_DTYPE, _ID_UID = _setters(_IdFields, "index", "shape", "dtype", "_uid")
_TAPE_DEVICE, _TAPE_STORE, _TAPE_LENGTH = _setters(_TapeFields, "device", "_store", "_length")


def id_hint(value: object, otherwise: str = "make arrays into ids with tg.leaf") -> str:
    """What to do with `value`, given where an Id goes: the (tape, id) pair an op returns is
    the usual slip (`y = tg.relu(tape, x)` for `tape, y = ...`)."""
    if isinstance(value, tuple) and len(cast(tuple[Any, ...], value)) == 2 and isinstance(
            cast(tuple[Any, ...], value)[0], Tape):
        return "it is the (tape, id) pair an op returns: unpack it, as in tape, y = tg.op(...)"
    return otherwise


def not_a_tape(op: str, got: object) -> TapeError:
    """The error for an op called with something else than a tape first (None, an id when the
    arguments are swapped)."""
    hint = ("; the arguments look swapped" if isinstance(got, Id) else "")
    return TapeError(at_site(
        f"{op}: the first argument must be the tape (a tg.Tape), not {type(got).__name__}"
        f"{hint}: call it as tg.{op}(tape, ...)"))


P = ParamSpec("P")
R = TypeVar("R")


def takes_tape(fn: Callable[Concatenate[Tape, P], R]) -> Callable[Concatenate[Tape, P], R]:
    """A public function over a tape refuses anything else in its place with `not_a_tape`,
    where the first use of it would raise a bare AttributeError. (The elementwise ops check on
    their slow path instead: this call costs ~0.1 us, a few percent of theirs.)"""
    op = fn.__name__

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> R:
        tape: Any = args[0] if args else kwargs.get("tape")
        if tape.__class__ is not Tape:
            raise not_a_tape(op, tape)
        try:
            if _PUBLIC_OP_GET() is not None:  # a step of a composite: the outer call notes it
                return fn(*args, **kwargs)
            # The call the user made: its nodes are noted as one call (`describe`), and in
            # anomaly mode a NaN in one of its steps (layer_norm's div) names it too.
            token = _PUBLIC_OP_SET(op)
            try:
                result: Any = fn(*args, **kwargs)
            finally:
                _PUBLIC_OP_RESET(token)
            # `_note_call`'s common case inline (one node of the op's own name): this wrapper
            # runs for every public call.
            if result.__class__ is tuple and len(result) == 2:
                after = result[0]
                if after.__class__ is Tape:
                    first = tape._length
                    if after._length - first == 1 and after._store.nodes[first].op == op:
                        return result
            _note_call(op, tape, result)
            return cast(R, result)
        except DeviceError as err:  # a step of a composite ran out of memory: name the op
            rename_device_error(err, op)
        except TypeError as err:
            if fits(fn, args, kwargs) is not False:
                raise  # raised inside: not the call's arguments
            raise ArgumentTypeError(at_site(
                f"{op}: {err}{_habit_hint(op, args, kwargs)}")) from None

    return checked


def _habit_hint(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A PyTorch habit behind a call that does not fit an op's parameters, where one shows."""
    if "dim" in kwargs:
        return "; tapegrad's ops name it axis= (numpy's word), not dim="
    if "keepdim" in kwargs:
        return "; the keyword is keepdims= (numpy's), not keepdim="
    if op == "reshape" and len(args) > 3:
        return "; the shape is one tuple: tg.reshape(tape, x, (3, 4))"
    return ""


def note_call(op: str, before: Tape, result: object) -> None:
    """`_note_call` for a public op that is not `takes_tape` (the elementwise ops' slow path):
    only a call the user made, not a step of a composite."""
    if _PUBLIC_OP_GET() is None:
        _note_call(op, before, result)


def _note_call(op: str, before: Tape, result: object) -> None:
    """Note the nodes a public call added on the tape it returned: several, or one of another
    name (`linear` records a `matmul`)."""
    if result.__class__ is not tuple:
        return
    after, out = cast(tuple[Any, ...], result)[:2]
    if after.__class__ is not Tape:
        return
    first, end = before._length, after._length
    store = after._store
    if end == first or (end - first == 1 and store.nodes[first].op == op):
        return
    if first and store.nodes[first - 1] is not before._store.nodes[first - 1]:
        return  # not grown from the tape it was given
    store.calls[first] = Call(op, first, end - 1, out.index if out.__class__ is Id else end - 1)


# Deferred forwards. An eager step's ops check their rule and append their node, and leave the
# forward's kernels to a `Forward` thunk (`_tensor.deferred`), run when a value is first read:
# by a kernel that reads it, a host read, or the sweep. A sweep whose structure repeats is
# then replayed with the forward in its program (`_jit`'s `SweepReplays`), so a training
# step's forward costs its rules and appends, not its launches and fusion plans. The same
# forwards run on the same values either way, so the same bits. Which ops defer: `defers`.
# Off (`deferring(False)`, or TAPEGRAD_DEFER=0) the forward runs as each op is recorded; it is
# off inside `tg.jit`'s runs of a step, in anomaly mode (every value is checked as it is made)
# and for custom ops.
_deferring: ContextVar[bool] = ContextVar(
    "tapegrad_deferring", default=os.environ.get("TAPEGRAD_DEFER", "1") != "0")
_DEFERRING_GET = _deferring.get
DEFER_MAX_ELEMENTS = 1 << 16  # see `defers`
_NEXT_ORDER = itertools.count().__next__


def defers(dtype: DType, size: int, operands: Sequence[Any]) -> bool:
    """Whether an op recorded now, with a result of `dtype` and `size` elements over
    `operands`, defers its forward (see above): yes over a deferred operand; a float result
    over computed ones if it has at most DEFER_MAX_ELEMENTS elements (a larger op's kernels
    run at its call, while Python records the ops after it: its kernel time, not its Python,
    is what it costs); an integer result unless over integers from the host, whose known
    range it may keep (indices reshaped or stacked, which take and cross_entropy check at
    their call). Never in anomaly mode."""
    if not _DEFERRING_GET() or _enabled.get():
        return False
    ranged = False
    for v in operands:
        if v.__class__ is AnyTensor:
            if v.thunk is not None:
                return True
            if v.dtype.kind in "iu" and host_range(v) is not None:
                ranged = True
    if dtype in FLOATS:
        return size <= DEFER_MAX_ELEMENTS
    return not ranged


@contextlib.contextmanager
def deferring(on: bool) -> Generator[None]:
    """Within the block, recorded ops defer their forwards (or not)."""
    token = _deferring.set(on)
    try:
        yield
    finally:
        _deferring.reset(token)


class Forward:
    """A node's forward, deferred: its primitive on its operands (`_tensor.Thunk`), and
    where it was recorded, for an error its kernels meet when they run (out of memory)."""

    # The output's shape and dtype, not its Aval: one object fewer per deferred node for
    # Python's collector to track (a step's nodes live through the step; see BENCHMARKS).
    __slots__ = ("device", "dtype", "op", "operands", "order", "params", "prim", "shape", "site")

    def __init__(self, prim: Primitive[Any], device: Device, operands: Sequence[Any],
                 params: Any, aval: Aval, site: tuple[str, int]) -> None:
        self.prim = prim
        self.device = device
        self.operands = operands
        self.params = params
        self.shape, self.dtype = aval
        self.op = _PUBLIC_OP_GET()  # the public call it is a step of, if any
        self.site = site
        self.order = _NEXT_ORDER()  # made after its operands' thunks: `force` runs by it

    def run(self) -> AnyTensor:
        prim = self.prim
        try:
            return apply(prim, self.device, self.operands, self.params,
                         Aval(self.shape, self.dtype))
        except DeviceError as err:
            outer = self.op
            name = prim.name if outer is None or outer == prim.name else f"{outer}: {prim.name}"
            raise DeviceError(
                f"{name}: {err}\n  (recorded at {format_site(self.site)}; its forward ran when "
                "its value was first needed)") from err


def deferred_forward(prim: Primitive[Any], device: Device, values: Sequence[Any], params: Any,
                     aval: Aval, site: tuple[str, int]) -> AnyTensor:
    """The value of `prim` over `values`, deferred (a `Forward` thunk)."""
    return deferred(aval.shape, aval.dtype, device,
                    Forward(prim, device, values, params, aval, site))


def _forward_or_deferred(prim: Primitive[Any], device: Device, values: Sequence[Any],
                         params: Any, aval: Aval, site: tuple[str, int]) -> AnyTensor:
    """The value of `prim` over `values` whose rule gave `aval`: deferred where `defers`
    says, else computed now."""
    if defers(aval.dtype, math.prod(aval.shape), values):
        return deferred_forward(prim, device, values, params, aval, site)
    return apply(prim, device, values, params, aval)


def record(
    tape: Tape, prim: Primitive[Any], args: Sequence[Any], params: Any = None,
    name: str | None = None, skip: int = 0,
) -> tuple[Tape, Id]:
    """Check, compute and append one node: every op is recorded here. Args are ids on `tape` or
    Python floats; an error about one names it by position. `skip`: the frames from this one
    up known to be tapegrad's own (see `call_site`; 0 walks out from here).

    This runs for every op, so it is written for speed: the primitive's own recorder first
    (the elementwise ops'), else the common checks inline, the messages built only when
    something is wrong.
    """
    recorder = prim.recorder
    if recorder is not None and params is None and name is None:
        done: tuple[Tape, Id] | None = recorder(prim, tape, args, skip + 1)
        if done is not None:
            return done
    values: list[Any] = []
    parents: list[Id] = []
    requires_grad = False
    nodes, length = tape._store.nodes, tape._length  # public callers checked the tape
    for i, arg in enumerate(args):
        if isinstance(arg, Id):
            # `tape.node`'s check inline (the node at the id's index must be the id's own);
            # the method call runs only to raise its error.
            index = arg.index
            node = nodes[index] if index < length else None
            if node is None or node.id._uid != arg._uid:
                node = tape.node(arg, prim.name, i)
            values.append(node.value)
            parents.append(arg)
            requires_grad = requires_grad or node.requires_grad
        else:
            values.append(arg)
    site = call_site(skip)
    try:
        if prim.builtin and _DEFERRING_GET():
            value = _forward_or_deferred(prim, tape.device, values, params,
                                         prim.rule(values, params), site)
        else:
            value = apply(prim, tape.device, values, params)
    except DeviceError as err:
        rename_device_error(err, prim.name)
    node_args = tuple(args)
    # Every argument an id: one tuple serves as both (an object fewer per node to collect).
    return append_computed(tape, prim, node_args,
                           node_args if len(parents) == len(node_args) else tuple(parents),
                           value, requires_grad, site, params, name)


def _check_forward(prim: Primitive[Any], value: AnyTensor, site: tuple[str, int]) -> None:
    """Anomaly mode: a forward value holding NaN or Inf is an error at the op's line."""
    bad = nonfinite(value)
    if bad is not None:
        outer = _public_op.get()
        inside = f" (a step of {outer})" if outer is not None and outer != prim.name else ""
        raise AnomalyError(
            f"{prim.name}{inside}: the forward value holds {bad}; recorded at "
            f"{format_site(site)}")


# The public op the user called, being run (`takes_tape`): None outside one.
_public_op: ContextVar[str | None] = ContextVar("tapegrad_public_op", default=None)
_PUBLIC_OP_GET = _public_op.get
_PUBLIC_OP_SET = _public_op.set
_PUBLIC_OP_RESET = _public_op.reset


def nodes_of(tape: Tape, op: str) -> tuple[list[Node], int]:
    """The tape's node list and its length (this tape sees the first `length` entries): for
    a primitive's own recorder that checks its operand ids inline (`_ops.elementwise`)."""
    try:
        return tape._store.nodes, tape._length
    except AttributeError:
        raise not_a_tape(op, tape) from None


def append_computed(tape: Tape, prim: Primitive[Any], args: tuple[Any, ...],
                    parents: tuple[Id, ...], value: AnyTensor, requires_grad: bool,
                    site: tuple[str, int], params: Any = None, name: str | None = None
                    ) -> tuple[Tape, Id]:
    """Append a node whose value is computed: what `record` does after `apply`, and what a
    primitive's own recorder (`_ops.elementwise`'s) and `record_checked` do. In anomaly mode
    a float value holding NaN or Inf is an error at `site`."""
    if _enabled.get() and is_float(value.dtype):
        _check_forward(prim, value, site)
    # A node that cannot pass a gradient (no VJP, or not a float value) does not require one,
    # whatever its parents: a mask, argmax positions, stop_gradient.
    return tape._append(prim, args, parents, params, value,
                        requires_grad and prim.vjp is not None and value.dtype in FLOATS, name,
                        site)


def record_checked(tape: Tape, prim: Primitive[Any], x: Id, params: Any, aval: Aval,
                   site: tuple[str, int]) -> tuple[Tape, Id]:
    """`record_known` over the one operand x (a binary op's broadcasts, x[t], reshape)."""
    return record_known(tape, prim, (x,), params, aval, site)


def record_known(tape: Tape, prim: Primitive[Any], ids: tuple[Id, ...], params: Any,
                 aval: Aval, site: tuple[str, int]) -> tuple[Tape, Id]:
    """`record(tape, prim, ids, params)` for a caller that has checked the ids against prim's
    rule and knows the output's `aval` (a product of two matrices that fit, a concat): the
    same node, without record's rule and loop over operands (an id not on this tape is still
    refused). For a primitive whose forward is its only path (no `eager`)."""
    assert prim.eager is None
    nodes, length = tape._store.nodes, tape._length
    values: list[Any] = []
    requires_grad = False
    for i, x in enumerate(ids):
        node = nodes[x.index] if x.index < length else None
        if node is None or node.id._uid != x._uid:
            node = tape.node(x, prim.name, "x" if len(ids) == 1 else i)
        values.append(node.value)
        requires_grad = requires_grad or node.requires_grad
    try:
        value = _forward_or_deferred(prim, tape.device, values, params, aval, site)
    except DeviceError as err:
        rename_device_error(err, prim.name)
    return append_computed(tape, prim, ids, ids, value, requires_grad, site, params)


def record_pieces(tape: Tape, prim: Primitive[Any], x: Id,
                  pieces: Sequence[tuple[Any, Aval]], site: tuple[str, int]
                  ) -> tuple[Tape, list[Id]]:
    """`record_checked` of each (params, aval) in `pieces` over the one operand x, in turn
    (a split's pieces)."""
    ids: list[Id] = []
    for params, aval in pieces:
        tape, piece = record_known(tape, prim, (x,), params, aval, site)
        ids.append(piece)
    return tape, ids


@takes_tape
def leaf(
    tape: Tape, data: Any, *, requires_grad: bool = False, name: str | None = None
) -> tuple[Tape, Id]:
    """Add an input: a numpy array, a Python scalar or an AnyTensor. Adds exactly one node."""
    requires_grad = flag("leaf", "requires_grad", requires_grad)
    if name is not None and not isinstance(name, str):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise DTypeError(at_site(f"leaf: name must be a str or None, got {shown(name)}"))
    if isinstance(data, AnyTensor):
        if data.device is not tape.device:
            raise DeviceError(at_site(
                f"leaf: the tensor is on {data.device!r} but the tape is on {tape.device!r}"))
        array, dtype = None, data.dtype
    else:
        array = host_array(data, "leaf", "data")
        dtype = array.dtype
    if requires_grad and not is_float(dtype):
        raise DTypeError(at_site(
            f"leaf: requires_grad=True needs a float32 or float64 array, got {dtype}; "
            "integer and bool inputs take no gradient"))
    if array is None:
        value = cast(AnyTensor, data)
        # A leaf is an input: a pending or deferred tensor (a parameter updated by ops) is
        # computed now, so that a replayed sweep reads it rather than the tape it came from.
        _ = value.buffer
    else:
        try:
            value = upload(array, tape.device)
        except DeviceError as err:
            rename_device_error(err, "leaf")
    return tape._append(None, (), (), None, value, requires_grad, name, call_site())


def rename_device_error(err: DeviceError, op: str) -> NoReturn:
    """Re-raise a device error from inside an op (allocation, launch), naming the op."""
    if str(err).startswith(f"{op}:"):
        raise err
    raise DeviceError(f"{op}: {err}") from err


@takes_tape
def value(tape: Tape, id: Id) -> AnyTensor:
    """The value of a node (still on the device)."""
    return tape.node(id, "value", "id").value


@takes_tape
def require(
    tape: Tape, id: Id, shape: Sequence[int | None], dtype: Any = None
) -> AnyTensor:
    """The value of `id`, checked to have `shape` (None matches any size) and `dtype`."""
    node = tape.node(id, "require", "id")
    actual = node.value.shape
    if not isinstance(shape, list | tuple) or not all(
            n is None or is_integer(n) for n in cast(Sequence[object], shape)):
        raise ShapeError(at_site(
            f"require: shape must be a tuple of ints or None, got {shown(shape)}"))
    if dtype is not None:
        try:
            np.dtype(dtype)
        except TypeError as err:
            raise DTypeError(at_site(f"require: {dtype!r} is not a dtype")) from err
    if len(shape) != len(actual) or any(
        want is not None and want != got for want, got in zip(shape, actual, strict=False)
    ):
        raise ShapeError(at_site(
            f"require: node {id.index} (op {node.op!r}, recorded at {node.site}) has shape "
            f"{actual}, expected {tuple(shape)}"))
    if dtype is not None and np.dtype(dtype) != node.value.dtype:
        raise DTypeError(at_site(
            f"require: node {id.index} (op {node.op!r}, recorded at {node.site}) has dtype "
            f"{node.value.dtype}, expected {np.dtype(dtype)}"))
    return node.value


class RecordingEmitter:
    """Appends each VJP step to a tape, so a backward can itself be differentiated."""

    __slots__ = ("tape",)

    def __init__(self, tape: Tape) -> None:
        self.tape = tape

    def apply(self, prim: Primitive[Any], args: Sequence[Any], params: Any = None) -> Id:
        self.tape, out = record(self.tape, prim, args, params)
        return out
