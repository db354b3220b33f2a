"""`AnyTensor`: an immutable, shape-erased tensor in a device buffer.

Invariants:
- Data is C-contiguous in one buffer, written once by the kernel or copy that made it and never
  again. Tensors may therefore share a buffer (a reshape is a new header over the same buffer).
- A tensor may be *pending*: an elementwise recipe with no buffer yet (`_fusion`). Reading
  `buffer` realises it, once; shape, dtype and size are known either way.
- A tensor may be *deferred*: a `Thunk` that makes it (a tape node's forward, not run yet:
  see `_tape`). Reading `buffer`, or `force`, runs the thunks it needs, operands first, and
  the tensor becomes what its thunk made (computed, or pending). Pending recipes never hold a
  deferred operand: they force it first.
- The host sees the data only through `numpy()`; nothing else in tapegrad reads a buffer back.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Generator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from ._backend import get_device
from ._errors import DeviceError, DTypeError, ShapeError, TapegradError, at_site
from ._traced import TracedFloat, TracedInt, plain

if TYPE_CHECKING:  # a tensor reaches its device through the device's methods only
    from ._device import Device

Shape = tuple[int, ...]

# What to do on a host read (`numpy()`, and so repr, item, float...): None allows it; inside
# `tg.jit` a function that raises, since a jitted step must be all device work (it lets anomaly
# mode's own checks through where the step runs eagerly).
_host_read_guard: ContextVar[Callable[[], None] | None] = ContextVar(
    "tapegrad_host_read_guard", default=None)
_HOST_READ_GUARD_GET = _host_read_guard.get


@contextlib.contextmanager
def host_reads(refuse: Callable[[], None]) -> Generator[None]:
    """Within the block, a host read of any tensor calls `refuse` first (which raises for a
    read it refuses)."""
    token = _host_read_guard.set(refuse)
    try:
        yield
    finally:
        _host_read_guard.reset(token)
DType = np.dtype[Any]

FLOAT32: DType = np.dtype(np.float32)
FLOAT64: DType = np.dtype(np.float64)
INT32: DType = np.dtype(np.int32)
INT64: DType = np.dtype(np.int64)
BOOL: DType = np.dtype(np.bool_)

FLOATS = (FLOAT32, FLOAT64)
INTS = (INT32, INT64)
SUPPORTED = (FLOAT32, FLOAT64, INT32, INT64, BOOL)
# Host integer dtypes that tapegrad holds as a wider one, every value kept: the kernels are
# written for the five above, and PyTorch takes these too (as int64 where it needs indices).
WIDENED_INTS: dict[DType, DType] = {
    **{np.dtype(t): INT32 for t in (np.int8, np.int16, np.uint8, np.uint16)},
    np.dtype(np.uint32): INT64}
C_TYPES: dict[DType, str] = {
    FLOAT32: "float",
    FLOAT64: "double",
    INT32: "int",
    INT64: "long",
    BOOL: "uchar",
}


_NAMES: dict[DType, str] = {}


def dtype_name(dtype: DType) -> str:
    """str(dtype), kept: numpy formats it in Python (~2 us), and kernel lookups name the
    dtype on every launch."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype)
    return name


def is_float(dtype: DType) -> bool:
    return dtype in FLOATS


def size_of(shape: Shape) -> int:
    return math.prod(shape)


class _TensorFields:
    """AnyTensor's fields, assignable: tensors are made as this class and then given theirs
    (`tensor`), as `_tape` makes ids; AnyTensor itself refuses every assignment."""

    __slots__ = ("__weakref__", "_buffer", "device", "dtype", "pending", "shape", "size", "thunk")
    _buffer: Any
    device: Device
    dtype: DType
    pending: Any
    shape: Shape
    size: int
    thunk: Thunk | None

    def __init__(self, buffer: Any, shape: Shape, dtype: DType, device: Device,
                 pending: Any) -> None:
        self._buffer = buffer
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.size = math.prod(shape)  # size_of(shape), without the call: made per op
        # The recipe of a value not computed yet (a `_fusion.Pending`), else None.
        self.pending = pending
        self.thunk = None  # what makes a deferred value, not run yet (see `Thunk`)


_SET_BUFFER = _TensorFields.__dict__["_buffer"].__set__
_SET_PENDING = _TensorFields.__dict__["pending"].__set__
_SET_THUNK = _TensorFields.__dict__["thunk"].__set__


class Thunk(Protocol):
    """What makes a deferred tensor: `run()` gives the tensor (computed or pending) once every
    deferred tensor among `operands` has been forced. `order` rises with each thunk made: an
    operand's thunk was made before its reader's."""

    operands: Sequence[Any]
    order: int

    def run(self) -> AnyTensor: ...


def deferred(shape: Shape, dtype: DType, device: Device, thunk: Thunk) -> AnyTensor:
    """A tensor made by `thunk` when first needed (`force`); one too large for a buffer is
    refused now."""
    t: Any = _TensorFields(None, shape, dtype, device, None)
    if t.size * dtype.itemsize >= device.max_alloc:
        check_fits(shape, dtype, device)
    t.thunk = thunk
    t.__class__ = AnyTensor
    return t


def _order(t: AnyTensor) -> int:
    thunk = t.thunk
    assert thunk is not None
    return thunk.order


def deferred_dag(roots: Sequence[AnyTensor]) -> list[AnyTensor]:
    """The deferred tensors `roots` need (the deferred roots included), in the order their
    thunks were made: operands first. A loop, not a recursion: a deferred chain may be
    thousands long."""
    found = {id(t): t for t in roots if t.thunk is not None}
    stack = list(found.values())
    while stack:
        thunk = stack.pop().thunk
        assert thunk is not None
        for a in thunk.operands:
            if a.__class__ is AnyTensor and a.thunk is not None and id(a) not in found:
                found[id(a)] = a
                stack.append(a)
    return sorted(found.values(), key=_order) if len(found) > 1 else list(found.values())


def run_deferred(order: Sequence[AnyTensor]) -> None:
    """Run each tensor's thunk, in `order` (`deferred_dag`'s); each becomes what its thunk
    made, keeping a pending recipe pending."""
    for u in order:
        thunk = u.thunk
        if thunk is None:  # (forced meanwhile by one of the others' runs)
            continue
        made = thunk.run()
        _SET_BUFFER(u, made._buffer)
        _SET_PENDING(u, made.pending)
        _SET_THUNK(u, None)
        keep_range(u, made)


def force(roots: Sequence[AnyTensor]) -> None:
    """Run the thunks the deferred tensors among `roots` need (see `run_deferred`)."""
    with roots[0].device.lock:  # one thread forces a DAG; the others then find it done
        run_deferred(deferred_dag(roots))


def buffers_of(tensors: Sequence[AnyTensor]) -> list[Any]:
    """The buffers of `tensors` (of one device), their deferred forwards forced as one DAG: an
    optimizer's gradients clipped by one norm are one replayed forward, not one per gradient."""
    roots = list({id(t): t for t in tensors if t.thunk is not None}.values())
    if len(roots) > 1 and not _forcer(roots):
        force(roots)
    return [t.buffer for t in tensors]


def _no_forcer(roots: Sequence[AnyTensor]) -> bool:
    return False


# Computes the buffers of deferred tensors another way than `force` then realising each,
# where it can (True): `tg.jit`'s module installs one that replays a forward it has seen
# (`_jit`). The tensors are of one device.
_forcer: Callable[[Sequence[AnyTensor]], bool] = _no_forcer


def set_forcer(forcer: Callable[[Sequence[AnyTensor]], bool]) -> None:
    global _forcer
    _forcer = forcer


def computed_buffers(tensors: Sequence[AnyTensor]) -> list[Any]:
    """Each tensor's buffer if it is computed, else None (pending or deferred): nothing is
    computed to tell."""
    return [t._buffer for t in tensors]


def settle(t: AnyTensor, buffer: Any) -> None:
    """Give deferred tensor `t` the buffer a replayed program computed for it: its thunk is
    not run (`tg.jit`'s sweep replays compute a tape's deferred values with its sweep)."""
    assert t.thunk is not None and t._buffer is None
    _SET_BUFFER(t, buffer)
    _SET_THUNK(t, None)


def _no_realiser(t: Any) -> Any:
    raise AssertionError("a pending tensor before tapegrad._opencl installed fusion")


# Computes a pending tensor's buffer: `_fusion.realise`, installed by `_opencl` when it loads
# (fusion is built on tensors, so this module cannot import it).
_realise: Callable[[Any], Any] = _no_realiser


def set_realiser(realise: Callable[[Any], Any]) -> None:
    global _realise
    _realise = realise


class _Donated:
    """The recipe of a tensor whose buffer a jitted step took (`donate`): any use raises."""

    __slots__ = ("_step",)

    def __init__(self, step: str) -> None:
        self._step = step

    def __getattr__(self, name: str) -> Any:
        raise TapegradError(at_site(
            f"this tensor was donated to jit({self._step}) (donate_argnums), whose outputs were "
            "written into its buffer: use the step's results instead of its arguments"))


def donate(t: AnyTensor, step: str) -> None:
    """Let a jitted step's output take `t`'s buffer: `t` can no longer be read (as with
    jax.jit's donated arrays); its shape and dtype stay."""
    _SET_BUFFER(t, None)
    _SET_PENDING(t, _Donated(step))


def tensor(buffer: Any, shape: Shape, dtype: DType, device: Device, pending: Any = None
           ) -> AnyTensor:
    """An AnyTensor, made as its mutable base and then given its class (one is made per op;
    AnyTensor(...) comes here too)."""
    t: Any = _TensorFields(buffer, shape, dtype, device, pending)
    t.__class__ = AnyTensor
    return t


class AnyTensor(_TensorFields):
    """An immutable tensor on an OpenCL device. `numpy()` is the only way to the host.

    Its fields cannot be assigned (`t.shape = ...` would change a node's value on every tape
    that holds it, and let kernels read past its buffer); `with_shape` and the ops make new
    tensors."""

    __slots__ = ()

    def __new__(cls, data: Any, device: Device | str | None = None) -> AnyTensor:
        """`AnyTensor(data, device=None)`: a copy of a numpy array or a Python or numpy scalar
        on `device` (default: `tg.default_device()`), as `from_numpy`, or `torch.tensor` and
        `jnp.asarray` take host data. An AnyTensor already there is returned as it is (it is
        immutable); one on another device is copied through the host."""
        if isinstance(data, AnyTensor):
            target = data.device if device is None else get_device(device, "AnyTensor")
            return data if target is data.device else upload(data.numpy(), target)
        return upload(host_array(data, "AnyTensor", "data"), get_device(device, "AnyTensor"))

    def __init__(self, data: Any, device: Device | str | None = None) -> None:
        """Made by __new__ (the kernels make theirs with `tensor`)."""

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"AnyTensor is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"AnyTensor is immutable: cannot delete {name!r}")

    def __copy__(self) -> AnyTensor:  # immutable: a copy is the tensor itself
        return self

    def __deepcopy__(self, memo: object) -> AnyTensor:
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its data (a host read), unpickled onto the default device: parameters
        can be saved."""
        return _from_host, (self.numpy(),)

    @property
    def buffer(self) -> Any:
        """The device buffer, computing a pending value first (see `_fusion`)."""
        buffer = self._buffer
        if buffer is None:
            if self.thunk is not None:
                if not _forcer((self,)):
                    force((self,))
                buffer = self._buffer
                if buffer is not None:
                    return buffer
            buffer = _realise(self)
        return buffer

    def resolve(self, buffer: Any) -> None:
        """Give a pending tensor its computed buffer (for `_fusion` only: write-once)."""
        assert self._buffer is None
        _SET_BUFFER(self, buffer)
        _SET_PENDING(self, None)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def numpy(self) -> np.ndarray[Any, Any]:
        """A host copy of the data (waits for the kernels that make it)."""
        refuse = _HOST_READ_GUARD_GET()
        if refuse is not None:  # inside tg.jit: a step reads nothing back
            refuse()
        out = np.empty(self.shape, self.dtype)
        if self.size:
            self.device.download(out, self.buffer)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        data = self.numpy()
        return data if dtype is None else data.astype(dtype)

    def item(self) -> float | int | bool:
        if self.size != 1:
            raise ShapeError(at_site(
                f"item() needs a tensor of one element, not shape {self.shape} (.numpy() "
                "gives all of them)"))
        value: float | int | bool = self.numpy().reshape(()).item()
        return value

    def __bool__(self) -> bool:
        """bool(t) of a one-element tensor (a host read); of more, an error, as numpy's and
        PyTorch's (an `if t:` on a mask is almost always a bug)."""
        if self.size != 1:
            raise ShapeError(at_site(
                f"the truth value of a tensor of shape {self.shape} is ambiguous; read it "
                "with .numpy() and use .any() or .all()"))
        return bool(self.item())

    def __float__(self) -> float:
        """float(t) of a one-element tensor, as numpy's float(array) (a host read)."""
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def with_shape(self, shape: Shape) -> AnyTensor:
        """The same data under another shape of equal size (no copy: the data never changes).

        A pending tensor stays pending: the two share one recipe (elementwise recipes do not
        depend on the shape), so a reshape between elementwise ops does not end their fusion.
        """
        if self.thunk is not None:
            force((self,))
        if self.pending is not None:
            out = tensor(None, shape, self.dtype, self.device, self.pending)
        else:
            out = tensor(self.buffer, shape, self.dtype, self.device)
        return keep_range(out, self)

    def __repr__(self) -> str:
        """The values, as numpy shows them (summarised past 1000 elements): a host read, as
        asked for; then the shape, dtype and device, which the summary may hide.
        `AnyTensor([1., 2.], shape=(2,), dtype=float32, device='0:0')`."""
        device = f"{self.device.platform_index}:{self.device.device_index}"
        if self.size > _REPR_MAX_ELEMENTS:
            return (f"AnyTensor(<{self.size} values: .numpy() reads them>, shape={self.shape}, "
                    f"dtype={self.dtype}, device={device!r})")
        values = np.array2string(self.numpy(), separator=", ", prefix="AnyTensor(",
                                 threshold=_REPR_THRESHOLD, edgeitems=_REPR_EDGE)
        return f"AnyTensor({values}, shape={self.shape}, dtype={self.dtype}, device={device!r})"

    @staticmethod
    def from_numpy(data: Any, device: Device | str | None = None) -> AnyTensor:
        """Copy a numpy array or Python scalar to the device (see `host_array` for the rules)."""
        array = host_array(data, "from_numpy", "data")
        return upload(array, get_device(device, "from_numpy"))


# numpy's print options: full values up to 1000 elements, else 3 at each edge of each axis.
_REPR_THRESHOLD = 1000
_REPR_EDGE = 3
# Past this repr shows no values: copying a whole large tensor to print six of its numbers
# would stall a debugger or a traceback.
_REPR_MAX_ELEMENTS = 1 << 24


def _from_host(array: np.ndarray[Any, Any]) -> AnyTensor:
    return AnyTensor.from_numpy(array)


def host_array(data: object, op: str, arg: str) -> np.ndarray[Any, Any]:
    """Normalise host input: Python scalars get float32/int64/bool; numpy scalars keep their
    dtype; arrays become contiguous, native."""
    if isinstance(data, np.generic):
        # First: np.float64 is a subclass of Python's float, and must stay float64.
        data = np.asarray(cast(Any, data))
    elif isinstance(data, bool):
        return np.asarray(data, BOOL)
    elif isinstance(data, TracedInt | TracedFloat) and isinstance(plain(data), np.generic):
        # A jitted step's numpy number made host data: its value (int() and float() of a
        # traced number are guards), its dtype numpy's, as eagerly.
        value = int(data) if isinstance(data, TracedInt) else float(data)
        return np.asarray(value, plain(data).dtype)
    elif isinstance(data, TracedInt):  # a jitted step's int made host data: its value, a guard
        return host_array(int(data), op, arg)
    elif isinstance(data, int):
        if not -(2**63) <= data < 2**63:
            raise DTypeError(at_site(f"{op}: argument {arg!r} is {data}, too large for int64"))
        return np.asarray(data, INT64)
    elif isinstance(data, float):
        return np.asarray(data, FLOAT32)
    if isinstance(data, list | tuple):
        raise DTypeError(at_site(
            f"{op}: argument {arg!r} is a Python {type(cast(object, data)).__name__}; pass a "
            "numpy array "
            f"instead, e.g. np.asarray(data, np.float32)"
        ))
    if not isinstance(data, np.ndarray):
        raise DTypeError(at_site(
            f"{op}: argument {arg!r} must be a numpy array, a Python scalar or an AnyTensor, "
            f"not {type(data).__name__}"
        ))
    array = cast(np.ndarray[Any, Any], data)
    native = _native(array.dtype)
    widened = WIDENED_INTS.get(native)
    if widened is not None:  # uint8 images and labels, int16 token ids: their values exactly
        return array.astype(widened)
    if native not in SUPPORTED:
        advice = ("np.int64 for labels and indices, np.float32 for values" if native.kind in "ui"
                  else "np.float32")
        raise DTypeError(at_site(
            f"{op}: argument {arg!r} has dtype {array.dtype}; tapegrad holds float32, float64, "
            f"int32, int64 and bool, and takes smaller integers as int32 (convert with "
            f".astype({advice}))"
        ))
    # Still a view: `upload` makes the contiguous native copy once the device has a buffer for
    # it, so an array too large for the device (a huge np.broadcast_to, say) raises DeviceError
    # without first being copied on the host.
    return array


def _native(dtype: DType) -> DType:
    return dtype.newbyteorder("=") if not dtype.isnative else dtype


def _allocate(device: Device, shape: Shape, dtype: DType) -> Any:
    try:
        return device.allocate(size_of(shape) * dtype.itemsize)
    except DeviceError as err:
        raise _too_large(shape, dtype, err) from None


def check_fits(shape: Shape, dtype: DType, device: Device) -> None:
    """Refuse now a tensor that will not fit in one buffer, though it gets one only later."""
    try:
        device.check_size(size_of(shape) * dtype.itemsize)
    except DeviceError as err:
        raise _too_large(shape, dtype, err) from None


def _too_large(shape: Shape, dtype: DType, err: DeviceError) -> DeviceError:
    return DeviceError(at_site(
        f"a tensor of shape {shape} and dtype {dtype} does not fit on the device: {err}"))


# The smallest and largest value of each integer tensor uploaded from the host, found there
# while the data is at hand: take and cross_entropy check indices against them before any
# kernel runs, which a tensor computed on the device cannot offer (reading it back would
# stall the queue). Entries die with their tensors.
_HOST_RANGE: weakref.WeakKeyDictionary[AnyTensor, tuple[int, int]] = weakref.WeakKeyDictionary()


def host_range(t: AnyTensor) -> tuple[int, int] | None:
    """(min, max) of an integer tensor made from host data, or None (unknown, or empty)."""
    return _HOST_RANGE.get(t)


# The range checks ops make while a tg.jit recording runs (`noting_range_checks`): per check,
# the checked tensor's buffer (None while it is pending) and the lowest and highest values the
# op accepts.
_range_checks: ContextVar[list[tuple[Any, int, int]] | None] = ContextVar(
    "tapegrad_range_checks", default=None)
# Likewise the ranges `keep_range` carries: (tensor, the tensors its range came from), so a
# replay can give a result made from integer inputs their range, as the eager call did.
_kept_ranges: ContextVar[list[tuple[AnyTensor, tuple[AnyTensor, ...]]] | None] = ContextVar(
    "tapegrad_kept_ranges", default=None)


def checked_range(t: AnyTensor, low: int, high: int) -> tuple[int, int] | None:
    """`host_range(t)`, for an op that refuses values outside [low, high] (an index against
    its axis, a label against the classes): a recording notes the bounds, so that a replay
    takes inputs in a wider range where every check of them would pass (`tg.jit`)."""
    known = _HOST_RANGE.get(t)
    if known is not None:
        checks = _range_checks.get()
        if checks is not None:
            checks.append((t._buffer, low, high))  # pyright: ignore[reportPrivateUsage]
    return known


@contextlib.contextmanager
def noting_range_checks() -> Generator[tuple[list[tuple[Any, int, int]],
                                             list[tuple[AnyTensor, tuple[AnyTensor, ...]]]]]:
    """Note the range checks ops make in this context (see `checked_range`), and the ranges
    `keep_range` carries."""
    checks: list[tuple[Any, int, int]] = []
    kept: list[tuple[AnyTensor, tuple[AnyTensor, ...]]] = []
    tokens = _range_checks.set(checks), _kept_ranges.set(kept)
    try:
        yield checks, kept
    finally:
        _range_checks.reset(tokens[0])
        _kept_ranges.reset(tokens[1])


def keep_range(out: AnyTensor, *sources: AnyTensor) -> AnyTensor:
    """Note on `out` the range of its sources' values, where every source has one: for ops
    whose result holds exactly the values of its operands, moved or repeated (reshape,
    transpose, broadcast, concat; a cast between integers that keeps them), so indices
    reshaped or stacked from host data are still checked. A slice or a gather holds a subset
    of the values, whose range is unknown (a wider one could refuse valid indices)."""
    if out.dtype.kind in "iu" and out.size:
        ranges = [_HOST_RANGE.get(s) for s in sources]
        known = [r for r in ranges if r is not None]
        if known and len(known) == len(ranges):
            lo, hi = min(r[0] for r in known), max(r[1] for r in known)
            info = np.iinfo(out.dtype)
            if info.min <= lo and hi <= info.max:
                _HOST_RANGE[out] = (lo, hi)
                kept = _kept_ranges.get()
                if kept is not None:
                    kept.append((out, sources))
    return out


def upload(array: np.ndarray[Any, Any], device: Device,
           known_range: tuple[int, int] | None = None) -> AnyTensor:
    """Copy a host array (as `host_array` returns it) to a fresh device buffer; an integer
    array's (min, max) is noted (`known_range` where the caller has computed it)."""
    dtype = _native(array.dtype)
    shape = tuple(int(n) for n in array.shape)
    check_fits(shape, dtype, device)  # before numpy makes a huge broadcast contiguous
    if not array.size:
        return tensor(_allocate(device, shape, dtype), shape, dtype, device)
    host = np.asarray(array, dtype=dtype, order="C")  # ascontiguousarray would make 0-d 1-d
    try:
        buffer = device.upload(host)
    except DeviceError as err:
        raise _too_large(shape, dtype, err) from None
    out = tensor(buffer, shape, dtype, device)
    if dtype.kind in "iu":
        _HOST_RANGE[out] = known_range or (int(host.min()), int(host.max()))
    return out


def empty(shape: Shape, dtype: DType, device: Device) -> AnyTensor:
    """A fresh buffer for a kernel to write once."""
    return tensor(_allocate(device, shape, dtype), shape, dtype, device)
