"""The reverse sweep: one loop over ids from the loss down.

The tape is already in topological order, so no graph walk is needed. A node is visited only if
it has a cotangent (it reaches the loss) and lies above something we want a gradient for. A
cotangent is dropped as soon as it has been handed to the parents (its buffer returns to the
pool). Missing cotangents mean zero: no kernel is launched to make zeros, except for a `wrt` id
that the loss does not reach, which gets an explicit zero tensor (JAX's choice).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any, TypeVar

import numpy as np

from ._anomaly import anomaly_enabled, nonfinite
from ._backend import cast, constant, full
from ._errors import (
    AnomalyError,
    DeviceError,
    DTypeError,
    MissingGradientError,
    NotAnIdError,
    ShapeError,
    TapeError,
    at_site,
    flag,
)
from ._primitive import EagerEmitter, Emitter, registered
from ._tape import Id, Node, RecordingEmitter, Tape, leaf, takes_tape
from ._tensor import FLOATS, AnyTensor, host_array, is_float, upload
from ._traced import TracedInt

G = TypeVar("G", AnyTensor, Id)

# A first-order sweep's result: the cotangent of each kept node (None: known to be zero).
Reached = dict[int, Any]
# The sweep node by node, its cotangents computed: `sweep(params, args)` gives the VJP of node i
# the params `params[i]` and the operands `args[i]` (the node's ids, its numbers replaced)
# instead of the node's own where given (a recording's traced seeds and numbers).
Sweep = Callable[[Mapping[int, Any], Mapping[int, tuple[Any, ...]]], Reached]
# How `backward` runs a first-order sweep when one is installed: replayer(nodes, loss, need,
# low, seed, keep, sweep) gives what `sweep({}, {})` would. `tg.jit`'s module installs one that
# replays a sweep whose structure it has seen before as a recorded program
# (`_jit.SweepReplays`); this layer knows nothing of kernels.
Replayer = Callable[[list[Node], Id, list[bool], int, AnyTensor, "set[int] | None", Sweep],
                    Reached]
_replayer: Replayer | None = None


def set_replayer(replayer: Replayer | None) -> None:
    global _replayer
    _replayer = replayer


class Gradients(dict[Id, G]):
    """A sweep's result: gradients by id. A missing key says why it is missing and what to do
    (PyTorch says "does not require grad"; a bare KeyError of an Id says nothing)."""

    __slots__ = ("_loss", "_op", "_tape")

    def __init__(self, tape: Tape, loss: Id, op: str) -> None:
        super().__init__()
        self._tape, self._loss, self._op = tape, loss, op

    def __missing__(self, key: Id) -> G:
        raise MissingGradientError(at_site(_why_missing(self._tape, self._loss, key, self._op)))


def _why_missing(tape: Tape, loss: Id, key: object, op: str) -> str:
    head = f"{op}'s result holds no gradient for {key!r}"
    if not isinstance(key, Id):
        return f"{op}'s result is keyed by the Ids of the tape, not {type(key).__name__}"
    try:
        node = tape.node(key, op, "key")
    except TapeError:
        return f"{head}: it is not a node of the tape that {op} swept"
    what = (f"node {key.index} ({'leaf' if node.prim is None else 'op ' + repr(node.op)}"
            f"{' ' + repr(node.name) if node.name else ''}, recorded at {node.site})")
    if not is_float(key.dtype):
        return f"{head}, {what}: it is {key.dtype}, and only float values take gradients"
    if node.prim is not None:
        return (f"{head}, {what}: it is not a leaf, and by default {op} returns the gradients "
                f"of requires_grad leaves only; pass wrt=[...] with it to get its gradient")
    if not node.requires_grad:
        return (f"{head}, {what}: it does not require grad; make it with tg.leaf(tape, data, "
                f"requires_grad=True), or pass wrt=[...] with it")
    return (f"{head}, {what}: the loss (node {loss.index}) does not depend on it; pass "
            f"wrt=[...] with it to get zeros")


def _needs_mask(nodes: list[Node], loss: Id, wrt: Sequence[Id] | None
                ) -> tuple[list[bool], int]:
    """need[i]: node i lies on a path from a wanted id (default: requires_grad) to the loss."""
    if wrt is None:
        return [n.requires_grad and is_float(n.value.dtype) for n in nodes], 0
    wanted = {w.index for w in wrt}
    low = min(wanted)
    need = [False] * (loss.index + 1)
    for i in range(low, loss.index + 1):
        node = nodes[i]
        if node.value.dtype not in FLOATS:
            continue
        if i in wanted:
            need[i] = True
            continue
        for p in node.parents:
            if need[p.index]:
                need[i] = True
                break
    return need, low


def _check_wrt(tape: Tape, loss: Id, wrt: Id | Sequence[Id] | None, op: str
               ) -> list[Id] | None:
    if wrt is None:
        return None
    if isinstance(wrt, Id):
        ids = [wrt]
    elif isinstance(wrt, list | tuple):  # pyright: ignore[reportUnnecessaryIsInstance]
        ids = list(wrt)
    else:
        raise NotAnIdError(at_site(
            f"{op}: wrt must be an Id or a sequence of Ids, not {type(wrt).__name__}"))
    for i, w in enumerate(ids):
        tape.node(w, op, f"wrt[{i}]")
        if not is_float(w.dtype):
            raise DTypeError(at_site(
                f"{op}: wrt[{i}] ({w!r}) is {w.dtype}; gradients exist only for float ids"))
    return ids


def _seed(tape: Tape, loss: Id, seed: Any, op: str, convert: bool = True) -> AnyTensor:
    """The seed cotangent as a tensor of the loss's shape and dtype.

    A seed of the other float dtype is converted on the device when `convert` (a cotangent is
    data handed in, not an id, as in PyTorch's backward(gradient)); an id seed of a recorded
    sweep must match exactly, since ids never mix float32 and float64.
    """
    if not is_float(loss.dtype):
        raise DTypeError(at_site(
            f"{op}: loss has dtype {loss.dtype}; gradients flow only from a float32 or float64 "
            "loss (integer and bool values take no gradient)"))
    if seed is None:
        if loss.shape != ():
            raise ShapeError(at_site(
                f"{op}: loss has shape {loss.shape}, not a scalar; pass seed= (a cotangent of "
                f"shape {loss.shape}) or reduce the loss first, e.g. with tg.sum"))
        # A kept constant (tensors are immutable): a backward launches no fill kernel, a cold
        # start compiles one kernel fewer, and a mean's VJP folds it (`elementwise._times`).
        return constant(1.0, loss.dtype, tape.device)
    if isinstance(seed, AnyTensor):
        if seed.device is not tape.device:
            raise DeviceError(at_site(
                f"{op}: seed is on {seed.device!r} but the tape is on {tape.device!r}"))
        value = seed
    elif (isinstance(seed, int | float | TracedInt) and not isinstance(seed, np.generic)
          and loss.shape == ()):
        # A Python number has no dtype of its own: it takes the loss's, as in the ops.
        try:
            number = float(seed)
        except OverflowError:
            raise DTypeError(at_site(
                f"{op}: seed is an int too large for a float ({len(str(seed).lstrip('-'))} "
                "digits)")) from None
        value = full((), number, loss.dtype, tape.device)
    else:
        value = upload(host_array(seed, op, "seed"), tape.device)
    if value.shape != loss.shape:
        raise ShapeError(at_site(
            f"{op}: seed has shape {value.shape} but the loss has shape {loss.shape}; "
            "they must match"))
    if value.dtype != loss.dtype:
        if convert and is_float(value.dtype):
            return cast(value, loss.dtype)
        raise DTypeError(at_site(
            f"{op}: seed has dtype {value.dtype} but the loss has dtype {loss.dtype}"
            + ("; convert it with tg.astype" if is_float(value.dtype) else
               "; a cotangent must be float32 or float64")))
    return value


def _sweep(
    tape: Tape, nodes: list[Node], loss: Id, need: list[bool], low: int, g0: Any, e: Emitter,
    handle: Any, check: bool, keep: set[int] | None, params: Mapping[int, Any] | None = None,
    operands: Mapping[int, tuple[Any, ...]] | None = None,
) -> dict[int, Any]:
    """Propagate cotangents from `loss` down to `low`; returns the cotangents of kept nodes
    (None for one reached only by cotangents known to be zero).

    `keep` lists the nodes whose cotangents are returned (None: requires_grad leaves); every
    other cotangent is dropped once handed on. `handle(node)` is what a VJP sees for a node:
    its value (eager) or its id (recording). `params` and `operands` give some nodes' VJPs
    other params and number operands than their own (see `Sweep`).
    """
    cotangents: dict[int, Any] = {loss.index: g0}
    reached: dict[int, Any] = {}
    # Needed nodes that a VJP reached with a cotangent it knew to be zero (it gave None, as
    # pow's for a ** 0.0): if nothing else reaches them they and what they need get zeros,
    # None in `reached`, as PyTorch's sweep would give (no kernel runs for them here).
    zeros: set[int] = set()
    add = registered("add")  # defined by the ops layer, which this one does not import
    for i in range(loss.index, low - 1, -1):
        g = cotangents.pop(i, None)
        if g is None:
            if zeros and i in zeros:
                _zero_reached(nodes[i], i, need, keep, zeros, reached)
            continue
        node = nodes[i]
        if i in keep if keep is not None else (node.prim is None and node.requires_grad):
            reached[i] = g
        prim = node.prim
        if prim is None or prim.vjp is None:
            continue
        node_args = node.args if not operands else operands.get(i, node.args)
        # One loop, not two comprehensions: in Python 3.11 each is a function call, and this
        # runs for every node of the sweep.
        needs: list[bool] = []
        args: list[Any] = []
        for a in node_args:
            if a.__class__ is Id:
                index: int = a.index
                needs.append(need[index])
                args.append(handle(nodes[index]))
            else:
                needs.append(False)
                args.append(a)
        if True not in needs:
            continue
        try:
            node_params = node.params if not params else params.get(i, node.params)
            parts = prim.vjp(e, g, handle(node), args, node_params, needs)
            if len(parts) != len(node_args):
                raise AssertionError(f"the VJP of {node.op!r} gave {len(parts)} cotangents for "
                                     f"{len(node_args)} operands")
            for k, part in enumerate(parts):
                if part is None or not needs[k]:
                    if needs[k]:
                        zeros.add(node_args[k].index)
                    continue
                arg = node_args[k]
                j: int = arg.index
                if check:
                    _check_finite(part, tape, node, k, arg)
                prev = cotangents.get(j)
                if prev is None:
                    cotangents[j] = part
                else:
                    cotangents[j] = e.apply(add, [prev, part])
                    if check:
                        _check_sum(cotangents[j], tape, nodes[j])
        except AnomalyError as err:
            if check:
                raise
            # A recorded sweep in anomaly mode: `record` caught a NaN/Inf in one VJP step.
            raise AnomalyError(
                f"{err}\n  while computing the VJP of node {i} (op {node.op!r}, recorded at "
                f"{node.site})") from None
    return reached


def _zero_reached(node: Node, i: int, need: list[bool], keep: set[int] | None, zeros: set[int],
                  reached: dict[int, Any]) -> None:
    """Node i has only zero cotangents: kept, it is reached with None (zeros); either way its
    needed operands are reached with zero too."""
    if i in keep if keep is not None else (node.prim is None and node.requires_grad):
        reached[i] = None
    for a in node.args:
        if a.__class__ is Id and need[a.index]:
            zeros.add(a.index)


# What a VJP sees of a node: its value (eager) or its id (recording). C getters: called per
# operand of every node the sweep visits.
_value_of: Callable[[Node], AnyTensor] = attrgetter("value")
_id_of: Callable[[Node], Id] = attrgetter("id")


def _check_forward_values(tape: Tape, loss: Id) -> None:
    """The computed float values the loss depends on, checked in the order they were recorded,
    so that the first NaN or Inf named is where it arose, not the loss it reached. (Inside
    `detect_anomaly` each was checked when recorded; `check_finite` alone comes after.)"""
    nodes = tape.prefix(loss.index + 1)
    seen = {loss.index}
    stack = [loss.index]
    while stack:
        for p in nodes[stack.pop()].parents:
            if p.index not in seen:
                seen.add(p.index)
                stack.append(p.index)
    for i in sorted(seen):
        node = nodes[i]
        if node.prim is None or not is_float(node.value.dtype):
            continue  # leaves are inputs, not computed values (see _anomaly)
        bad = nonfinite(node.value)
        if bad is not None:
            raise AnomalyError(
                f"backward: the forward value of node {i} (op {node.op!r}, recorded at "
                f"{node.site}) holds {bad}")


def _check_finite(t: Any, tape: Tape, node: Node, k: int, arg: Id) -> None:
    """A cotangent made by `node`'s VJP for its operand #k (`arg`)."""
    bad = nonfinite(t) if isinstance(t, AnyTensor) else None
    if bad is not None:
        parent = tape[arg.index]
        raise AnomalyError(
            f"backward: the VJP of node {node.id.index} (op {node.op!r}, recorded at "
            f"{node.site}) gave a cotangent holding {bad} for its operand #{k} (node "
            f"{arg.index}, op {parent.op!r}, recorded at {parent.site})")


def _check_sum(t: Any, tape: Tape, node: Node) -> None:
    """The cotangent of `node` after adding one more contribution from a use of it."""
    bad = nonfinite(t) if isinstance(t, AnyTensor) else None
    if bad is not None:
        raise AnomalyError(
            f"backward: the cotangent of node {node.id.index} (op {node.op!r}, recorded at "
            f"{node.site}) holds {bad} after summing the contributions of its uses (each "
            "was finite: the sum overflowed)")


@takes_tape
def backward(
    tape: Tape, loss: Id, *, wrt: Id | Sequence[Id] | None = None, seed: Any = None,
    check_finite: bool = False,
) -> Mapping[Id, AnyTensor]:
    """Gradients of `loss` with respect to `wrt` (default: every requires_grad leaf reached).

    A non-scalar loss needs `seed`, a cotangent of its shape. A `wrt` id that the loss does not
    reach gets zeros. A loss that reaches no requires_grad leaf gives an empty result, not an
    error (code over many losses need not special-case a constant one); asking the result for
    an id it lacks raises `MissingGradientError` (a KeyError) saying why and what to do.
    With `check_finite` (or inside `tg.detect_anomaly()`), the first NaN or Inf raises
    `AnomalyError` naming the op and its line; otherwise nothing is read to the host.
    """

    tape.node(loss, "backward", "loss")
    check = flag("backward", "check_finite", check_finite) or anomaly_enabled()
    wrt_ids = _check_wrt(tape, loss, wrt, "backward")
    g0 = _seed(tape, loss, seed, "backward")
    if check:
        bad = nonfinite(g0)
        if bad is not None:
            raise AnomalyError(at_site(f"backward: the seed holds {bad}"))
        _check_forward_values(tape, loss)
    reachable = [w for w in wrt_ids if w.index <= loss.index] if wrt_ids is not None else None
    result: Gradients[AnyTensor] = Gradients(tape, loss, "backward")
    if reachable is None or reachable:
        nodes = tape.prefix(loss.index + 1)
        need, low = _needs_mask(nodes, loss, reachable)
        e = EagerEmitter(tape.device)
        keep = None if wrt_ids is None else {w.index for w in wrt_ids}

        def sweep(params: Mapping[int, Any], operands: Mapping[int, tuple[Any, ...]]
                  ) -> Reached:
            """The sweep node by node, its gradients computed (not left pending) inside it:
            a recorded sweep's outputs."""
            loss_value = nodes[loss.index].value
            if loss_value.thunk is not None:
                # A deferred loss is computed with the sweep (and so by its program): the
                # caller reads it next (value_and_grad returns it), and a VJP may not.
                loss_value.buffer  # noqa: B018
            found = _sweep(tape, nodes, loss, need, low, g0, e, _value_of, check, keep, params,
                           operands)
            for g in found.values():
                if g is not None:
                    g.buffer  # noqa: B018
            return found

        replayer = _replayer
        reached = sweep({}, {}) if check or replayer is None else replayer(
            nodes, loss, need, low, g0, keep, sweep)
        if wrt_ids is None:
            for i, g in reached.items():
                w = tape[i].id
                result[w] = g if g is not None else full(w.shape, 0.0, w.dtype, tape.device)
    else:
        reached = {}
    if wrt_ids is not None:
        for w in wrt_ids:
            g = reached.get(w.index)
            result[w] = g if g is not None else full(w.shape, 0.0, w.dtype, tape.device)
    return result  # computed, not pending: the sweep's (see `sweep`) or full()'s


@takes_tape
def backward_on_tape(
    tape: Tape, loss: Id, wrt: Id | Sequence[Id] | None, seed: Id | None = None
) -> tuple[Tape, dict[Id, Id]]:
    """Record the sweep on the tape: gradients are ids, and can be differentiated again.

    `wrt=None` means, as in `backward`, every requires_grad leaf that the loss reaches."""

    tape.node(loss, "backward_on_tape", "loss")
    wrt_ids = _check_wrt(tape, loss, wrt, "backward_on_tape")
    only_reached = wrt_ids is None
    if wrt_ids is None:
        wrt_ids = [n.id for n in tape.prefix(loss.index + 1)
                   if n.prim is None and n.requires_grad and is_float(n.value.dtype)]
    if seed is None:
        g0 = _seed(tape, loss, None, "backward_on_tape")
        tape, seed_id = leaf(tape, g0)
    else:
        node = tape.node(seed, "backward_on_tape", "seed")
        _seed(tape, loss, node.value, "backward_on_tape", convert=False)
        seed_id = seed
    reachable = [w for w in wrt_ids if w.index <= loss.index]
    reached: dict[int, Any] = {}
    e = RecordingEmitter(tape)
    if reachable:
        nodes = tape.prefix(loss.index + 1)
        need, low = _needs_mask(nodes, loss, reachable)
        base = tape
        keep = {w.index for w in wrt_ids}
        reached = _sweep(base, nodes, loss, need, low, seed_id, e, _id_of, False, keep)
    tape = e.tape
    out: Gradients[Id] = Gradients(tape, loss, "backward_on_tape")
    for w in wrt_ids:
        g = reached.get(w.index)
        if g is None:
            if only_reached and w.index not in reached:
                continue
            tape, g = leaf(tape, full(w.shape, 0.0, w.dtype, tape.device))
        out[w] = g
    return tape, out
