"""JAX-style transforms over tape functions `f(tape, *ids) -> (tape, id)`.

Each transform works two ways:
- called with arrays (or pytrees of arrays: dicts, lists, tuples, namedtuples, dataclasses...,
  see `_tree`), it makes a fresh tape, runs `f`, and returns AnyTensors in the structure of the
  differentiated arguments, each container of the class it was given as;
- called with a tape first, `tg.grad(f)(tape, *ids)` records the backward on that tape
  (`backward_on_tape`) and returns `(tape, grad_ids)`, so it is itself a tape function and nests:
  `tg.grad(tg.grad(f))`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, cast, overload

import numpy as np
from optree import PyTreeSpec

from ._errors import (
    ArgumentTypeError,
    DeviceError,
    DTypeError,
    ShapeError,
    TapeError,
    TapegradError,
    at_site,
    flag,
    shown,
    takes_positional,
)
from ._kernels import contiguous_strides, strided_scatter
from ._sweep import backward, backward_on_tape
from ._tape import Id, Tape, leaf
from ._tensor import AnyTensor, buffers_of, empty, host_array, size_of
from ._traced import Traced
from ._tree import describe, flatten, leaf_path

# A tape function f(tape, *args) -> (tape, out), of any arity; spelled out for one to three
# arguments too, so that a lambda's parameters get types (the Tape, then Any) under strict
# pyright, where `Callable[..., ...]` alone leaves them unknown.
TapeFn = (Callable[[Tape, Any], tuple[Tape, Any]] | Callable[[Tape, Any, Any], tuple[Tape, Any]]
          | Callable[[Tape, Any, Any, Any], tuple[Tape, Any]] | Callable[..., tuple[Tape, Any]])


def call(f: TapeFn, op: str, tape: Tape, *args: Any) -> tuple[Tape, Any]:
    """f(tape, *args), checked to return (tape, result) as a tape function must."""
    try:
        result: Any = f(tape, *args)
    except TypeError as err:
        if takes_positional(f, 1 + len(args)) is False:  # f(x), JAX's way: say what tapegrad calls
            raise ArgumentTypeError(at_site(
                f"{op}: f is called as f(tape, *args), the tape first, with {len(args)} "
                f"argument{'s' * (len(args) != 1)} after it, and must return (tape, id); "
                f"it does not take {1 + len(args)} positional arguments ({err})")) from err
        raise
    if not (isinstance(result, tuple) and len(cast(tuple[Any, ...], result)) == 2
            and isinstance(cast(tuple[Any, Any], result)[0], Tape)):
        raise DTypeError(at_site(
            f"{op}: f must return (tape, id), the new tape and its result; got "
            f"{type(cast(object, result)).__name__}"))
    pair = cast(tuple[Tape, Any], result)
    return pair[0], pair[1]


def _id_out(out: Any, op: str) -> Id:
    if not isinstance(out, Id):
        raise DTypeError(at_site(f"{op}: f must return (tape, id), got {type(out).__name__} "
                                 "as the second item"))
    return out


def function(f: object, op: str) -> None:
    """Check, when a transform is made, that f can be called (as JAX checks)."""
    if not callable(f):
        raise DTypeError(at_site(
            f"{op}: f must be a tape function f(tape, *ids) -> (tape, id), got "
            f"{type(f).__name__}"))


def _argnums(argnums: int | Sequence[int], nargs: int, op: str) -> tuple[int, ...]:
    if isinstance(argnums, int) or not isinstance(argnums, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
        nums: tuple[object, ...] = (argnums,)
    else:
        nums = tuple(cast(Sequence[object], argnums))
    for n in nums:
        if isinstance(n, bool) or not isinstance(n, int):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise DTypeError(at_site(f"{op}: argnums must be ints, got {shown(argnums)}"))
        if not -nargs <= n < nargs:
            raise ShapeError(at_site(
                f"{op}: argnums {n} is out of range for a call with {nargs} arguments"))
    return tuple(cast(int, n) % nargs for n in nums)


# An argument's leaves (ids, once on a tape) and its structure, by argument position.
Flat = Mapping[int, tuple[list[Any], PyTreeSpec]]


def _leaves(tape: Tape, args: Sequence[Any], diff: tuple[int, ...], op: str
            ) -> tuple[Tape, list[Any], list[Id], Flat]:
    """Put array arguments on a fresh tape; returns id trees, the ids to differentiate and
    each argument's ids with its structure. A differentiated argument that is not float data
    is an error naming `op` and it. Numbers (Python's, numpy's) outside `diff` reach f as
    they are (a penalty weight, a dropout seed): as leaves they were float32 ids in a float64
    model, ints a seed could not take, and under tg.jit a new recording per value."""
    trees: list[Any] = []
    wrt: list[Id] = []
    flat: dict[int, tuple[list[Any], PyTreeSpec]] = {}
    flats = [flatten(arg) for arg in args]
    deferred = [x for leaves, _ in flats for x in leaves
                if x.__class__ is AnyTensor and x.thunk is not None and x.device is tape.device]
    if len(deferred) > 1:  # forced as one DAG, one replay, not one per leaf (`leaf` forces)
        buffers_of(deferred)
    for i, (leaves, spec) in enumerate(flats):
        ids: list[Any] = []  # ids, and the numbers passed through
        for k, x in enumerate(leaves):
            if i not in diff and isinstance(x, int | float | np.number | np.bool_ | Traced):
                ids.append(x)
                continue
            if i in diff:
                data = x if isinstance(x, AnyTensor) else _host(x, op, i, spec, k)
                if data.dtype.kind != "f":
                    raise DTypeError(at_site(
                        f"{op}: argument {i}{leaf_path(spec, k)} has dtype {data.dtype}, but "
                        "gradients exist only for float32 or float64 data; convert it "
                        "(.astype(np.float32))"
                        + (" or leave it out of argnums" if op != "vjp" else "")
                        + _STATIC_HINT * bool(leaf_path(spec, k))))
                x = data
            tape, xi = leaf(tape, x, requires_grad=i in diff)
            ids.append(xi)
            if i in diff:
                wrt.append(xi)
        trees.append(spec.unflatten(ids))
        flat[i] = (ids, spec)
    return tape, trees, wrt, flat


# A configuration field (a layer count, an activation's name) inside differentiated params.
_STATIC_HINT = ("; a field that configures the model is marked static: dataclasses.field("
                "metadata={'static': True})")


def _float_id(x: object, op: str, i: int, spec: PyTreeSpec, k: int) -> Id:
    """Leaf `k` of differentiated argument `i` of a tape-first call: a float id, or an error
    naming it by its key path."""
    if isinstance(x, Id) and x.dtype.kind == "f":
        return x
    kind = type(x).__name__
    what = (f"an Id of dtype {x.dtype}" if isinstance(x, Id)
            else f"{'an' if kind[:1] in 'aeiouAEIOU' else 'a'} {kind}")
    hint = ("; with a tape first, arguments are ids on that tape: put arrays on it with "
            "tg.leaf, or call it without the tape, on the arrays"
            if isinstance(x, np.ndarray | AnyTensor) else "; leave it out of argnums")
    raise DTypeError(at_site(
        f"{op}: argument {i}{leaf_path(spec, k)} is {what}, but a differentiated argument's "
        f"leaves must be float ids{hint}" + _STATIC_HINT * bool(leaf_path(spec, k))))


def _host(x: object, op: str, i: int, spec: PyTreeSpec, k: int) -> np.ndarray[Any, Any]:
    """Leaf `k` of argument `i` as host data; an error names it by its key path (found only
    then: it walks the whole tree)."""
    try:
        return host_array(x, op, f"args[{i}]")
    except TapegradError:
        path = leaf_path(spec, k)
        leaf_value: object = x  # checked apart: x keeps its type for host_array below
        if path and not isinstance(leaf_value, np.ndarray | np.generic | int | float | list
                                   | tuple):
            # a string, a function, a layer's settings object: configuration, not data
            kind = type(x).__name__
            raise DTypeError(at_site(
                f"{op}: argument {i}{path} is {'an' if kind[:1] in 'aeiouAEIOU' else 'a'} "
                f"{kind}, neither an array, a number nor an AnyTensor" + _STATIC_HINT)) from None
        return host_array(x, op, f"args[{i}]{path}")


def _scalar_out(out: Any, op: str) -> Id:
    if not isinstance(out, Id):
        raise DTypeError(at_site(f"{op}: f must return (tape, id), got {type(out).__name__} "
                                    "as the second item (use has_aux=True for extra outputs)"))
    if out.shape != ():
        raise ShapeError(at_site(
            f"{op}: f must return a scalar id, got shape {out.shape}; reduce it (tg.sum, "
            "tg.mean) or use tg.vjp / tg.jacobian"))
    return out


def _split_aux(result: Any, has_aux: bool, op: str) -> tuple[Any, Any]:
    if not has_aux:
        return result, None
    if not (isinstance(result, tuple) and len(cast(tuple[Any, ...], result)) == 2):
        raise DTypeError(at_site(
            f"{op}: with has_aux=True, f must return (tape, (id, aux))"))
    pair = cast(tuple[Any, Any], result)
    return pair[0], pair[1]


def _aux_values(tape: Tape, aux: Any) -> Any:
    """`aux` with each id replaced by its value: called with arrays, the tape is made inside
    and never seen by the caller, so its ids could not be read (JAX also returns values)."""
    leaves, spec = flatten(aux)
    return spec.unflatten([tape.node(x, "value_and_grad", "aux").value if isinstance(x, Id)
                           else x for x in leaves])


def _structured(diff: tuple[int, ...], argnums: int | Sequence[int], flat: Flat,
                grads: Mapping[Id, Any]) -> Any:
    """The gradients of the arguments in `diff`, each in its argument's structure."""
    per_arg: list[Any] = []
    for i in diff:
        ids, spec = flat[i]
        per_arg.append(spec.unflatten([grads[x] for x in ids]))
    return per_arg[0] if isinstance(argnums, int) else tuple(per_arg)


def value_and_grad(f: TapeFn, argnums: int | Sequence[int] = 0, has_aux: bool = False
                   ) -> Callable[..., Any]:
    """`f`'s value and its gradient with respect to the arguments in `argnums`.

    With arrays: `(value, grads)` as AnyTensors, or `((value, aux), grads)` with `has_aux`
    (the ids in aux given as their values, AnyTensors).
    With a tape first: `(tape, (value_id, grad_ids))`, recorded and differentiable.
    """
    return _value_and_grad(f, argnums, has_aux, "value_and_grad")


def _named(run: Callable[..., Any], f: object) -> Callable[..., Any]:
    """`run` named as f, as jax.grad's results are, but not wrapping it (no __wrapped__):
    tg.typed and inspect would read f's signature, which takes a tape first where `run`
    takes arrays."""
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        if hasattr(f, name):
            setattr(run, name, getattr(f, name))
    return run


# Python's cyclic collector is paused while value_and_grad (or grad) records and sweeps a step
# given arrays: the step's nodes live through it and die with it by reference counting, but a
# collection during it moves the live ones to the oldest generation, whose full collections
# then walk every object the process tracks (torch's too, where it is imported: see
# docs/BENCHMARKS.md, session 34). The step's objects must be gone when it runs again: the
# first allocation after would otherwise collect them all, every step. One call pauses it at
# a time, whatever the threads: calls overlapping in other threads run as they come, so that
# threads taking turns cannot keep it off for good; a child forked during a pause (its
# pausing thread gone) has it back.
_pause_lock = threading.Lock()
_paused = False


@contextlib.contextmanager
def collector_paused() -> Generator[None]:
    """Within the block, Python's cyclic collector does not run, unless another call holds it
    paused already (then this one leaves it to that one) or it was off."""
    global _paused
    with _pause_lock:
        owner = not _paused and gc.isenabled()
        if owner:
            gc.disable()
            _paused = True
    try:
        yield
    finally:
        if owner:
            with _pause_lock:
                _paused = False
                gc.enable()


def _resume_in_child() -> None:
    global _pause_lock, _paused
    _pause_lock = threading.Lock()  # the parent's may have been held by another thread
    if _paused:
        _paused = False
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_resume_in_child)


def _value_and_grad(f: TapeFn, argnums: int | Sequence[int], has_aux: bool, op: str
                    ) -> Callable[..., Any]:
    """value_and_grad, its errors naming `op` (grad's are grad's)."""
    function(f, op)
    has_aux = flag(op, "has_aux", has_aux)

    def run(*args: Any) -> Any:
        if args and isinstance(args[0], Tape):
            tape: Tape = args[0]
            ids = args[1:]
            diff = _argnums(argnums, len(ids), op)
            # checked before f runs: an array given here would fail first inside f, at an op
            flat = {i: flatten(ids[i]) for i in diff}
            wrt = [_float_id(x, op, i, flat[i][1], k) for i in diff
                   for k, x in enumerate(flat[i][0])]
            tape, result = call(f, op, tape, *ids)
            out, aux = _split_aux(result, has_aux, op)
            out = _scalar_out(out, op)
            tape, grads = backward_on_tape(tape, out, wrt)
            value: Any = (out, aux) if has_aux else out
            return tape, (value, _structured(diff, argnums, flat, grads))
        with collector_paused():
            return on_arrays(*args)  # its tape dies with its frame, before the collector runs

    def on_arrays(*args: Any) -> Any:
        diff = _argnums(argnums, len(args), op)
        tape, trees, wrt, flat = _leaves(Tape(), args, diff, op)
        tape, result = call(f, op, tape, *trees)
        out, aux = _split_aux(result, has_aux, op)
        out = _scalar_out(out, op)
        grads = backward(tape, out, wrt=wrt)
        out_value: Any = tape[out].value
        return ((out_value, _aux_values(tape, aux)) if has_aux else out_value,
                _structured(diff, argnums, flat, grads))

    return _named(run, f)


def grad(f: TapeFn, argnums: int | Sequence[int] = 0, has_aux: bool = False
         ) -> Callable[..., Any]:
    """The gradient of scalar `f` with respect to the arguments in `argnums`.

    With arrays: AnyTensors shaped like the arguments (`(grads, aux)` with `has_aux`).
    With a tape first: `(tape, grad_ids)`, so `tg.grad(tg.grad(f))` works.
    """
    vg = _value_and_grad(f, argnums, has_aux, "grad")

    def run(*args: Any) -> Any:
        if args and isinstance(args[0], Tape):
            tape, (value, grads) = vg(*args)
            return tape, ((grads, value[1]) if has_aux else grads)
        value, grads = vg(*args)
        return (grads, value[1]) if has_aux else grads

    return _named(run, f)


def _message(err: Exception) -> str:
    """An error's message without its call-site line (`at_site` adds it again)."""
    return str(err).split("\n  (called at ")[0]


def vjp(f: TapeFn, *args: Any) -> tuple[Any, Callable[..., Any]]:
    """`(out, vjp_fn)`: `vjp_fn(cotangent)` gives one gradient per argument of `f`.

    With arrays: out is an AnyTensor and `vjp_fn(ct)` returns a tuple of AnyTensors (pytrees
    keep their structure). With a tape first, `tg.vjp(f, tape, *ids)` returns
    `((tape, out_id), vjp_fn)` and `vjp_fn(tape, ct_id)` returns `(tape, grad_ids)`.
    """
    function(f, "vjp")
    if args and isinstance(args[0], Tape):
        tape0: Tape = args[0]
        ids = args[1:]
        tape0, out_id = call(f, "vjp", tape0, *ids)
        out_id = _id_out(out_id, "vjp")
        flat_all = dict(enumerate(flatten(a) for a in ids))
        wrt_all = [x for leaves, _ in flat_all.values() for x in leaves]

        def recorded(tape: Tape, ct: Id) -> tuple[Tape, tuple[Any, ...]]:
            try:
                tape, grads = backward_on_tape(tape, out_id, wrt_all, seed=ct)
            except TapeError as err:
                raise TapeError(at_site(
                    f"vjp's function: {_message(err)}; call it with the tape tg.vjp returned "
                    "(or one grown from it) and a cotangent id on that tape")) from None
            except TapegradError as err:
                raise type(err)(at_site(f"vjp's function: {_message(err)}")) from None
            every = tuple(range(len(ids)))
            return tape, _structured(every, every, flat_all, grads)

        return (tape0, out_id), recorded
    diff = tuple(range(len(args)))
    tape, trees, wrt, flat = _leaves(Tape(), args, diff, "vjp")
    tape, out = call(f, "vjp", tape, *trees)
    if not isinstance(out, Id):
        raise DTypeError(at_site(
            f"vjp: f must return (tape, id), got {type(out).__name__} as the second item"))

    def eager(cotangent: Any) -> tuple[Any, ...]:
        try:
            grads = backward(tape, out, wrt=wrt, seed=cotangent)
        except TapegradError as err:  # its messages say "seed": here it is the cotangent
            raise type(err)(at_site(f"vjp's function: the cotangent: {_message(err)}")) from None
        return _structured(diff, diff, flat, grads)

    return tape[out].value, eager


def _stack_rows(rows: list[AnyTensor], shape: tuple[int, ...], like: Id, device: Any
                ) -> AnyTensor:
    """Write the gradients `rows` (each of `like`'s shape and dtype) as the rows of one fresh
    tensor of `shape`, on the device; no rows (an empty output) give an empty tensor."""
    out = empty((len(rows), *like.shape), like.dtype, device)
    strides = contiguous_strides(like.shape)
    for i, row in enumerate(rows):
        strided_scatter(row, out, strides, base=i * size_of(like.shape))
    return out.with_shape(shape)


def _one_hot_rows(out: Id, device: Any) -> list[AnyTensor]:
    n = size_of(out.shape)
    rows: list[AnyTensor] = []
    for i in range(n):
        seed = np.zeros(n, out.dtype)
        seed[i] = 1
        rows.append(AnyTensor.from_numpy(seed.reshape(out.shape), device))
    return rows


def _at(f: TapeFn, op: str, args: tuple[Any, ...], argnums: object
        ) -> tuple[Tape, Id, Any]:
    """f recorded on a fresh tape at the arrays `args`, the one at `argnums` requiring its
    gradient: (tape, its id, f's result)."""
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise DTypeError(at_site(f"{op}: argnums must be one int, got {shown(argnums)}"))
    diff = _argnums(argnums, len(args), op)
    tape, trees, wrt, _ = _leaves(Tape(), args, diff, op)
    if len(wrt) != 1 or trees[diff[0]] is not wrt[0]:
        raise DTypeError(at_site(
            f"{op}: argument {diff[0]} must be one array, got {describe(args[diff[0]])}"))
    tape, out = call(f, op, tape, *trees)
    return tape, wrt[0], out


@overload
def jacobian(f: TapeFn, *, argnums: int = 0) -> Callable[..., AnyTensor]: ...
@overload
def jacobian(f: TapeFn, x: Any, /, *args: Any, argnums: int = 0) -> AnyTensor: ...
def jacobian(f: TapeFn, *args: Any, argnums: int = 0) -> Any:
    """The Jacobian of `f(tape, *ids)` with respect to argument `argnums`, an array `x`: shape
    `out.shape + x.shape`.

    `jacobian(f, *arrays)` computes it (as `torch.autograd.functional.jacobian`);
    `jacobian(f)` returns the function of the arrays that does (as `jax.jacobian`). Reverse
    mode, one sweep per output element (fine for the small problems it is meant for).
    """
    function(f, "jacobian")
    if not args:
        def curried(*xs: Any) -> AnyTensor:
            return jacobian(f, *xs, argnums=argnums)
        return curried
    tape, xi, out = _at(f, "jacobian", args, argnums)
    out = _id_out(out, "jacobian")
    rows = [backward(tape, out, wrt=[xi], seed=seed)[xi]
            for seed in _one_hot_rows(out, tape.device)]
    return _stack_rows(rows, (*out.shape, *xi.shape), xi, tape.device)


@overload
def hessian(f: TapeFn, *, argnums: int = 0) -> Callable[..., AnyTensor]: ...
@overload
def hessian(f: TapeFn, x: Any, /, *args: Any, argnums: int = 0) -> AnyTensor: ...
def hessian(f: TapeFn, *args: Any, argnums: int = 0) -> Any:
    """The Hessian of scalar `f(tape, *ids)` with respect to argument `argnums`, an array `x`:
    shape `x.shape + x.shape`. `hessian(f, *arrays)` computes it; `hessian(f)` returns the
    function that does, as `jacobian`."""
    function(f, "hessian")
    if not args:
        def curried(*xs: Any) -> AnyTensor:
            return hessian(f, *xs, argnums=argnums)
        return curried
    tape, xi, out = _at(f, "hessian", args, argnums)
    out = _scalar_out(out, "hessian")
    tape, grads = backward_on_tape(tape, out, [xi])
    g = grads[xi]
    rows = [backward(tape, g, wrt=[xi], seed=seed)[xi]
            for seed in _one_hot_rows(g, tape.device)]
    return _stack_rows(rows, (*xi.shape, *xi.shape), xi, tape.device)


def _direction(v: object, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """hvp's v from host data (a numpy array of any real dtype, a number, a list of numbers)
    in x's dtype, converted once (a Python float stays exact for a float64 x)."""
    try:
        array = np.asarray(cast(Any, v))
    except ValueError as err:  # ragged lists
        raise DTypeError(at_site(f"hvp: v is not an array of numbers: {err}")) from None
    if array.dtype.kind not in "fiub":  # None, str, dicts (object), complex
        raise DTypeError(at_site(
            f"hvp: v must be an AnyTensor or real numbers (a numpy array, a number), got "
            f"{type(v).__name__} of dtype {array.dtype}"))
    # copy=False: an array already in x's dtype is uploaded as given, so tg.jit sees it as
    # its input (a copy would be host data it cannot follow)
    return array.astype(dtype, order="C", copy=False)


@overload
def hvp(f: TapeFn) -> Callable[[Any, Any], AnyTensor]: ...
@overload
def hvp(f: TapeFn, x: Any, v: Any, /) -> AnyTensor: ...
def hvp(f: TapeFn, *args: Any) -> Any:
    """The Hessian of scalar `f(tape, x)` at the array `x` times `v`, by one double sweep:
    `hvp(f, x, v)`, or `hvp(f)(x, v)`."""
    function(f, "hvp")
    if not args:
        def curried(x: Any, v: Any) -> AnyTensor:
            return hvp(f, x, v)
        return curried
    if len(args) != 2:
        raise DTypeError(at_site(f"hvp: takes (f, x, v), got {len(args)} arguments after f"))
    x, v = args
    tape, xi = leaf(Tape(), x, requires_grad=True)
    v_tensor = v if isinstance(v, AnyTensor) else AnyTensor.from_numpy(
        _direction(v, xi.dtype), tape.device)
    if v_tensor.device is not tape.device:
        raise DeviceError(at_site(f"hvp: v is on {v_tensor.device!r}, x on {tape.device!r}"))
    if v_tensor.shape != xi.shape:
        raise ShapeError(at_site(f"hvp: v has shape {v_tensor.shape}, expected x's {xi.shape}"))
    tape, out = call(f, "hvp", tape, xi)
    out = _scalar_out(out, "hvp")
    tape, grads = backward_on_tape(tape, out, [xi])
    return backward(tape, grads[xi], wrt=[xi], seed=v_tensor)[xi]
