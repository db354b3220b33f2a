"""Property tests: random small graphs of the core ops over random broadcastable shapes.

Each example is a little program: float64 input leaves, then a few steps, each an op applied to
earlier nodes (so values are shared and reused) or to a Python scalar. It is evaluated twice,
by numpy and by tapegrad, and the forward values must agree; then `tg.gradcheck` compares every
input's analytic gradient with float64 central differences.

Programs are drawn together with their input values, so each step is chosen only where it is
smooth enough for finite differences: `exp` on |x| <= 3, `div` by |x| >= 0.25, `relu` and `max`
away from their kinks and ties, and values below 50 in magnitude. Steps whose value nothing
uses are folded into the output (`out + mean(unused)`), so every step is differentiated.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import tapegrad as tg

Array = np.ndarray[Any, Any]
Ref = tuple[str, int]  # ("leaf", k) or ("step", k)
Operand = Ref | float
Draw = Callable[..., Any]

# 35 examples take a few seconds; TAPEGRAD_PROPERTY_EXAMPLES=2000 is a longer hunt.
EXAMPLES = int(os.environ.get("TAPEGRAD_PROPERTY_EXAMPLES", "35"))
MAX_SIZE = 36     # elements in any node
MAX_ABS = 50.0    # magnitude of any value
MARGIN = 1e-2     # distance from relu's kink and between a max and the runner-up
SCALARS = (-1.5, -0.5, 0.5, 2.0)

UNARY: dict[str, tuple[Callable[..., tuple[tg.Tape, tg.Id]], Callable[[Array], Array]]] = {
    "neg": (tg.neg, np.negative),
    "exp": (tg.exp, np.exp),
    "tanh": (tg.tanh, np.tanh),
    "sigmoid": (tg.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    "relu": (tg.relu, lambda x: np.maximum(x, 0)),
}
BINARY: dict[str, tuple[Callable[..., tuple[tg.Tape, tg.Id]], Callable[[Any, Any], Array]]] = {
    "add": (tg.add, np.add),
    "sub": (tg.sub, np.subtract),
    "mul": (tg.mul, np.multiply),
    "div": (tg.div, np.divide),
}
REDUCE: dict[str, tuple[Callable[..., tuple[tg.Tape, tg.Id]], Callable[..., Array]]] = {
    "sum": (tg.sum, np.sum),
    "mean": (tg.mean, np.mean),
    "max": (tg.max, np.max),
}
OPS = (*BINARY, *UNARY, *REDUCE, "reshape", "transpose", "broadcast_to", "matmul")


@dataclass(frozen=True)
class Step:
    op: str
    args: tuple[Operand, ...]
    params: dict[str, Any] = field(default_factory=dict[str, Any])

    def __repr__(self) -> str:
        args = ", ".join(_name(a) if isinstance(a, tuple) else repr(a) for a in self.args)
        params = "".join(f", {k}={v!r}" for k, v in self.params.items())
        return f"{self.op}({args}{params})"


def _name(ref: Ref) -> str:
    return f"{'x' if ref[0] == 'leaf' else 'y'}{ref[1]}"


@dataclass
class Program:
    leaves: list[Array]
    steps: list[Step]
    values: dict[Ref, Array]  # numpy value of every node

    def __repr__(self) -> str:
        lines = [f"x{k}: shape {a.shape}" for k, a in enumerate(self.leaves)]
        lines += [f"y{k} = {s!r}" for k, s in enumerate(self.steps)]
        return "\n".join(lines)

    @property
    def out(self) -> Array:
        return self.values["step", len(self.steps) - 1]

    def run(self, tape: tg.Tape, *ids: tg.Id) -> tuple[tg.Tape, tg.Id]:
        """The program on a tape: the function gradcheck differentiates."""
        env: dict[Ref, tg.Id] = {("leaf", k): i for k, i in enumerate(ids)}

        def operand(a: Operand) -> tg.Id | float:
            return env[a] if isinstance(a, tuple) else a

        def node(a: Operand) -> tg.Id:
            assert isinstance(a, tuple)
            return env[a]

        out: tg.Id | None = None
        for k, s in enumerate(self.steps):
            p = s.params
            if s.op in BINARY:
                tape, out = BINARY[s.op][0](tape, *(operand(a) for a in s.args))
            elif s.op == "matmul":
                tape, out = tg.matmul(tape, node(s.args[0]), node(s.args[1]))
            elif s.op in UNARY:
                tape, out = UNARY[s.op][0](tape, node(s.args[0]))
            elif s.op in REDUCE:
                tape, out = REDUCE[s.op][0](tape, node(s.args[0]), **p)
            elif s.op == "reshape":
                tape, out = tg.reshape(tape, node(s.args[0]), p["shape"])
            elif s.op == "transpose":
                tape, out = tg.transpose(tape, node(s.args[0]), p["axes"])
            else:
                tape, out = tg.broadcast_to(tape, node(s.args[0]), p["shape"])
            env["step", k] = out
        assert out is not None
        return tape, out


def _ok(v: Array) -> bool:
    return v.size <= MAX_SIZE and bool(np.all(np.isfinite(v))) and float(
        np.max(np.abs(v), initial=0.0)) <= MAX_ABS


def _shape(draw: Draw, base: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts with `base`: a suffix of it with some sizes set to 1."""
    k = draw(st.integers(0, len(base)))
    return tuple(1 if draw(st.booleans()) else n for n in base[len(base) - k:])


def _values(rng: np.random.Generator, shape: tuple[int, ...]) -> Array:
    return np.asarray(rng.uniform(-2.0, 2.0, shape))


def _reduce_step(draw: Draw, op: str, ref: Ref, v: Array) -> tuple[Step, Array] | None:
    nd = v.ndim
    kind = draw(st.sampled_from(["none", "int", "tuple"] if nd else ["none"]))
    axis: Any
    if kind == "none":
        axis = None
        axes = tuple(range(nd))
    elif kind == "int":
        axis = draw(st.integers(-nd, nd - 1))
        axes = (axis % nd,)
    else:
        axes = tuple(sorted(draw(st.sets(st.integers(0, nd - 1)))))  # () reduces nothing
        axis = tuple(a - nd if draw(st.booleans()) else a for a in axes)
    keepdims = draw(st.booleans())
    if op == "max":
        # a unique maximum with a margin over the runner-up, in every reduced slice
        moved = np.moveaxis(v, axes, tuple(range(nd - len(axes), nd)))
        flat = moved.reshape(*moved.shape[:nd - len(axes)], -1)
        if flat.shape[-1] > 1:
            top = np.sort(flat, axis=-1)
            if float(np.min(top[..., -1] - top[..., -2])) < MARGIN:
                return None
    want = REDUCE[op][1](v, axis=axis, keepdims=keepdims)
    return Step(op, (ref,), {"axis": axis, "keepdims": keepdims}), np.asarray(want)


def _reshape_target(draw: Draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    size = math.prod(shape)
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    d = draw(st.sampled_from(divisors))
    options: list[tuple[int, ...]] = [(size,), (-1,), shape[::-1], (d, size // d), (d, -1),
                                      (1, *shape), (*shape, 1)]
    if size == 1:
        options.append(())
    return draw(st.sampled_from(options))


def _broadcast_target(draw: Draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    return (*lead, *(draw(st.integers(1, 3)) if n == 1 else n for n in shape))


def _matmul_step(draw: Draw, rng: np.random.Generator, program: Program, ref: Ref, v: Array
                 ) -> tuple[Step, Array] | None:
    """`v @ new` or `new @ v` with a new input leaf of a fitting shape."""
    if v.ndim == 0:
        return None
    n = draw(st.integers(1, 3))
    if draw(st.booleans()):  # v on the left: contract its last axis
        k = v.shape[-1]
        if v.ndim == 1 or draw(st.booleans()):
            other_shape: tuple[int, ...] = draw(st.sampled_from([(k, n), (k,)]))
        else:
            batch = tuple(1 if draw(st.booleans()) else b for b in v.shape[:-2])
            other_shape = (*batch, k, n)
        left = True
    else:  # v on the right: contract its second-to-last axis (or its only one)
        k = v.shape[0] if v.ndim == 1 else v.shape[-2]
        other_shape = draw(st.sampled_from([(n, k), (k,)]))
        left = False
    other = _values(rng, other_shape)
    new_ref: Ref = ("leaf", len(program.leaves))
    a, b = (v, other) if left else (other, v)
    out = np.asarray(np.matmul(a, b))
    if not _ok(out):
        return None
    program.leaves.append(other)
    program.values[new_ref] = other
    return Step("matmul", (ref, new_ref) if left else (new_ref, ref)), out


def _step(draw: Draw, rng: np.random.Generator, program: Program) -> tuple[Step, Array] | None:
    """One step: an op on an earlier node it fits (three tries), or None."""
    refs = list(program.values)[::-1]  # latest first: the simplest draw extends a chain
    op = draw(st.sampled_from(OPS))
    for _ in range(3):
        made = _try(draw, rng, program, op, draw(st.sampled_from(refs)))
        if made is not None and _ok(made[1]):
            return made
    return None


def _try(draw: Draw, rng: np.random.Generator, program: Program, op: str, ref: Ref
         ) -> tuple[Step, Array] | None:
    """`op` on `ref`, or None where it does not fit its value smoothly."""
    refs = list(program.values)[::-1]
    v = program.values[ref]
    if op in UNARY:
        if op == "exp" and float(np.max(np.abs(v), initial=0.0)) > 3.0:
            return None
        if op == "relu" and float(np.min(np.abs(v), initial=1.0)) < MARGIN:
            return None
        return Step(op, (ref,)), np.asarray(UNARY[op][1](v))
    if op in BINARY:
        fits = [r for r in refs if _broadcasts(v.shape, program.values[r].shape)]
        other: Operand = (draw(st.sampled_from(SCALARS)) if draw(st.booleans())
                          else draw(st.sampled_from(fits)))
        args: tuple[Operand, Operand] = (ref, other) if draw(st.booleans()) else (other, ref)
        a, b = (program.values[x] if isinstance(x, tuple) else np.float64(x) for x in args)
        if op == "div" and float(np.min(np.abs(b), initial=1.0)) < 0.25:
            return None
        return Step(op, args), np.asarray(BINARY[op][1](a, b))
    if op in REDUCE:
        return _reduce_step(draw, op, ref, v)
    if op == "reshape":
        shape = _reshape_target(draw, v.shape)
        return Step(op, (ref,), {"shape": shape}), v.reshape(shape)
    if op == "transpose":
        axes = (None if draw(st.booleans())
                else tuple(draw(st.permutations(range(v.ndim)))))
        return Step(op, (ref,), {"axes": axes}), np.transpose(v, axes)
    if op == "broadcast_to":
        shape = _broadcast_target(draw, v.shape)
        return Step(op, (ref,), {"shape": shape}), np.broadcast_to(v, shape).copy()
    return _matmul_step(draw, rng, program, ref, v)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


@st.composite
def programs(draw: Draw) -> Program:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    leaves = [_values(rng, _shape(draw, base)) for _ in range(draw(st.integers(1, 3)))]
    program = Program(leaves, [], {("leaf", k): a for k, a in enumerate(leaves)})
    for _ in range(draw(st.sampled_from([2, 3, 4, 5, 6]))):
        made = _step(draw, rng, program)
        if made is not None:
            _append(program, *made)
    if not program.steps:
        _append(program, Step("neg", (("leaf", 0),)), -leaves[0])
    # Fold every step whose value nothing used into the output, so that every step is checked:
    # out = last + mean(unused) + ...
    used = {a for step in program.steps for a in step.args if isinstance(a, tuple)}
    last: Ref = ("step", len(program.steps) - 1)
    for k in range(len(program.steps) - 1):
        if ("step", k) not in used:
            m = _append(program, Step("mean", (("step", k),), {"axis": None, "keepdims": False}),
                        np.asarray(np.mean(program.values["step", k])))
            last = _append(program, Step("add", (last, m)),
                           np.asarray(program.values[last] + program.values[m]))
    return program


def _append(program: Program, step: Step, value: Array) -> Ref:
    ref: Ref = ("step", len(program.steps))
    program.steps.append(step)
    program.values[ref] = value
    return ref


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs())
def test_random_graphs_match_numpy_and_finite_differences(program: Program) -> None:
    note(repr(program))
    for step in program.steps:
        event(step.op)
    event(f"{len(program.steps)} steps")
    tape = tg.Tape()
    ids: list[tg.Id] = []
    for a in program.leaves:
        tape, i = tg.leaf(tape, a)
        ids.append(i)
    tape, out = program.run(tape, *ids)
    got = tg.value(tape, out).numpy()
    assert got.dtype == np.float64
    assert got.shape == program.out.shape
    np.testing.assert_allclose(got, program.out, rtol=1e-9, atol=1e-12)
    assert tg.gradcheck(program.run, *program.leaves)
