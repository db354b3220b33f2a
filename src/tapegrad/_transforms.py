"""JAX-style transforms over tape functions `f(tape, *ids) -> (tape, id)`.

Each transform works two ways:
- called with arrays (or pytrees of arrays: dicts, lists, tuples), it makes a fresh tape, runs
  `f`, and returns AnyTensors in the structure of the differentiated arguments;
- called with a tape first, `tg.grad(f)(tape, *ids)` records the backward on that tape
  (`backward_on_tape`) and returns `(tape, grad_ids)`, so it is itself a tape function and nests:
  `tg.grad(tg.grad(f))`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast, overload

import numpy as np

from ._errors import DeviceError, DTypeError, ShapeError, TapeError, TapegradError, at_site, flag
from ._kernels import contiguous_strides, strided_scatter
from ._sweep import backward, backward_on_tape
from ._tape import Id, Tape, leaf
from ._tensor import AnyTensor, empty, host_array, size_of

TapeFn = Callable[..., tuple[Tape, Any]]


# --- pytrees: dicts, lists and tuples of leaves -------------------------------------------------

def flatten(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The leaves of a pytree in order, and a function that rebuilds the tree from new leaves.
    None is an empty subtree, as in JAX (a layer without a bias: `{"w": w, "b": None}`)."""
    if tree is None:
        return [], lambda leaves: None
    if isinstance(tree, dict):
        d = cast(dict[Any, Any], tree)
        keys = list(d)
        parts = [flatten(d[k]) for k in keys]

        def rebuild_dict(leaves: list[Any]) -> Any:
            out: dict[Any, Any] = {}
            for k, (flat, rebuild) in zip(keys, parts, strict=True):
                out[k] = rebuild(leaves[: len(flat)])
                leaves = leaves[len(flat):]
            return out

        return [x for flat, _ in parts for x in flat], rebuild_dict
    if isinstance(tree, list | tuple):
        seq = cast(Sequence[Any], tree)
        kind = type(seq)
        items = [flatten(x) for x in seq]

        def rebuild_seq(leaves: list[Any]) -> Any:
            out: list[Any] = []
            for flat, rebuild in items:
                out.append(rebuild(leaves[: len(flat)]))
                leaves = leaves[len(flat):]
            if kind is list or kind is tuple:
                return out if kind is list else tuple(out)
            # A namedtuple keeps its class (JAX's too); other subclasses become the base.
            return kind(*out) if hasattr(kind, "_fields") else (
                tuple(out) if issubclass(kind, tuple) else out)

        return [x for flat, _ in items for x in flat], rebuild_seq
    return [tree], lambda leaves: leaves[0]


def flatten_like(tree: Any, like: Any, op: str, what: str, path: str = ""
                 ) -> list[tuple[str, Any]]:
    """The leaves of `tree` in the order of `like`'s (see `flatten`), each with its path
    (`['w'][0]`): dicts are matched by key, so {"w", "b"} against {"b", "w"} pairs w with w. A
    different structure is an error naming `what`, the op and where the two differ."""
    if like is None:
        if tree is not None:
            raise ShapeError(at_site(
                f"{op}: {what}{path} must be None like params{path}, got "
                f"{_shape_of(cast(object, tree))}"))
        return []
    if isinstance(like, dict):
        like_d = cast(dict[Any, Any], like)
        if not isinstance(tree, dict) or set(cast(dict[Any, Any], tree)) != set(like_d):
            ids = isinstance(tree, dict) and any(
                isinstance(k, Id) for k in cast(dict[Any, Any], tree))
            raise ShapeError(at_site(
                f"{op}: {what}{path} must be a dict with the keys of params{path} "
                f"({_keys(like_d)}), got {_shape_of(cast(object, tree))}"
                + ("; tg.backward's result is keyed by Id: rebuild the params' structure from "
                   "it, e.g. {name: grads[i] for name, i in ids.items()}" if ids else "")))
        tree_d = cast(dict[Any, Any], tree)
        return [pair for k in like_d
                for pair in flatten_like(tree_d[k], like_d[k], op, what, f"{path}[{k!r}]")]
    if isinstance(like, list | tuple):
        like_s = cast(Sequence[Any], like)
        if not isinstance(tree, list | tuple) or len(cast(Sequence[Any], tree)) != len(like_s):
            raise ShapeError(at_site(
                f"{op}: {what}{path} must be a list or tuple of {len(like_s)} like "
                f"params{path}, got {_shape_of(cast(object, tree))}"))
        tree_s = cast(Sequence[Any], tree)
        return [pair for i, (t, lk) in enumerate(zip(tree_s, like_s, strict=True))
                for pair in flatten_like(t, lk, op, what, f"{path}[{i}]")]
    if isinstance(tree, dict | list | tuple):
        raise ShapeError(at_site(
            f"{op}: {what}{path} must be a tensor like params{path}, got "
            f"{_shape_of(cast(object, tree))}"))
    return [(path, tree)]


def _keys(d: dict[Any, Any]) -> str:
    return ", ".join(sorted(map(repr, d)))


def _shape_of(tree: object) -> str:
    """A pytree node in words, for errors: "a dict with keys 'b', 'w'", 'a list of 2'."""
    if isinstance(tree, dict):
        return f"a dict with keys {_keys(cast(dict[Any, Any], tree))}"
    if isinstance(tree, list | tuple):
        return f"a {type(cast(object, tree)).__name__} of {len(cast(Sequence[Any], tree))}"
    name = type(tree).__name__
    return "None" if tree is None else f"{'an' if name[0] in 'AEIOUaeiou' else 'a'} {name}"


def call(f: TapeFn, op: str, tape: Tape, *args: Any) -> tuple[Tape, Any]:
    """f(tape, *args), checked to return (tape, result) as a tape function must."""
    result: Any = f(tape, *args)
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
            raise DTypeError(at_site(f"{op}: argnums must be ints, got {argnums!r}"))
        if not -nargs <= n < nargs:
            raise ShapeError(at_site(
                f"{op}: argnums {n} is out of range for a call with {nargs} arguments"))
    return tuple(cast(int, n) % nargs for n in nums)


def _leaves(tape: Tape, args: Sequence[Any], diff: tuple[int, ...], op: str
            ) -> tuple[Tape, list[Any], list[Id]]:
    """Put array arguments on a fresh tape; returns id trees and the ids to differentiate.
    A differentiated argument that is not float data is an error naming `op` and it."""
    trees: list[Any] = []
    wrt: list[Id] = []
    for i, arg in enumerate(args):
        flat, rebuild = flatten(arg)
        ids: list[Id] = []
        for x in flat:
            if i in diff:
                data = x if isinstance(x, AnyTensor) else host_array(x, op, f"args[{i}]")
                if data.dtype.kind != "f":
                    raise DTypeError(at_site(
                        f"{op}: argument {i} has dtype {data.dtype}, but gradients exist only "
                        "for float32 or float64 data; convert it (.astype(np.float32))"
                        + (" or leave it out of argnums" if op != "vjp" else "")))
                x = data
            tape, xi = leaf(tape, x, requires_grad=i in diff)
            ids.append(xi)
            if i in diff:
                wrt.append(xi)
        trees.append(rebuild(ids))
    return tape, trees, wrt


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
    flat, rebuild = flatten(aux)
    return rebuild([tape.node(x, "value_and_grad", "aux").value if isinstance(x, Id) else x
                    for x in flat])


def _structured(diff: tuple[int, ...], argnums: int | Sequence[int], trees: list[Any],
                grads: dict[Id, Any]) -> Any:
    per_arg: list[Any] = []
    for i in diff:
        flat, rebuild = flatten(trees[i])
        per_arg.append(rebuild([grads[x] for x in flat]))
    return per_arg[0] if isinstance(argnums, int) else tuple(per_arg)


def value_and_grad(f: TapeFn, argnums: int | Sequence[int] = 0, has_aux: bool = False
                   ) -> Callable[..., Any]:
    """`f`'s value and its gradient with respect to the arguments in `argnums`.

    With arrays: `(value, grads)` as AnyTensors, or `((value, aux), grads)` with `has_aux`
    (the ids in aux given as their values, AnyTensors).
    With a tape first: `(tape, (value_id, grad_ids))`, recorded and differentiable.
    """
    return _value_and_grad(f, argnums, has_aux, "value_and_grad")


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
            tape, result = call(f, op, tape, *ids)
            out, aux = _split_aux(result, has_aux, op)
            out = _scalar_out(out, op)
            wrt = [x for i in diff for x in flatten(ids[i])[0]]
            tape, grads = backward_on_tape(tape, out, wrt)
            value: Any = (out, aux) if has_aux else out
            return tape, (value, _structured(diff, argnums, list(ids), dict(grads)))
        diff = _argnums(argnums, len(args), op)
        tape, trees, wrt = _leaves(Tape(), args, diff, op)
        tape, result = call(f, op, tape, *trees)
        out, aux = _split_aux(result, has_aux, op)
        out = _scalar_out(out, op)
        grads = dict(backward(tape, out, wrt=wrt))
        out_value: Any = tape[out].value
        return ((out_value, _aux_values(tape, aux)) if has_aux else out_value,
                _structured(diff, argnums, trees, grads))

    return run


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

    return run


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
        wrt_all = [x for a in ids for x in flatten(a)[0]]

        def recorded(tape: Tape, ct: Id) -> tuple[Tape, tuple[Any, ...]]:
            try:
                tape, grads = backward_on_tape(tape, out_id, wrt_all, seed=ct)
            except TapeError as err:
                raise TapeError(at_site(
                    f"vjp's function: {_message(err)}; call it with the tape tg.vjp returned "
                    "(or one grown from it) and a cotangent id on that tape")) from None
            except TapegradError as err:
                raise type(err)(at_site(f"vjp's function: {_message(err)}")) from None
            return tape, _structured(tuple(range(len(ids))), tuple(range(len(ids))),
                                     list(ids), dict(grads))

        return (tape0, out_id), recorded
    diff = tuple(range(len(args)))
    tape, trees, wrt = _leaves(Tape(), args, diff, "vjp")
    tape, out = call(f, "vjp", tape, *trees)
    if not isinstance(out, Id):
        raise DTypeError(at_site(
            f"vjp: f must return (tape, id), got {type(out).__name__} as the second item"))

    def eager(cotangent: Any) -> tuple[Any, ...]:
        try:
            grads = dict(backward(tape, out, wrt=wrt, seed=cotangent))
        except TapegradError as err:  # its messages say "seed": here it is the cotangent
            raise type(err)(at_site(f"vjp's function: the cotangent: {_message(err)}")) from None
        return _structured(diff, diff, trees, grads)

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
        raise DTypeError(at_site(f"{op}: argnums must be one int, got {argnums!r}"))
    diff = _argnums(argnums, len(args), op)
    tape, trees, wrt = _leaves(Tape(), args, diff, op)
    if len(wrt) != 1 or trees[diff[0]] is not wrt[0]:
        raise DTypeError(at_site(
            f"{op}: argument {diff[0]} must be one array, got {_shape_of(args[diff[0]])}"))
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
    return array.astype(dtype, order="C")


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
