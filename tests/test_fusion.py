"""Fused elementwise chains: pending values, generated kernels, and the same numbers as op by op."""

from __future__ import annotations

import collections
import gc
import re
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from benchmarks import lstm_fusion

import tapegrad as tg
from cases import on_launch
from tapegrad import _fusion, _kernels
from tapegrad._kernels import _EXPRESSIONS
from tapegrad._ops.broadcast import SUM, ReduceParams
from tapegrad._primitive import EagerEmitter

Counts = collections.Counter[str]
Array = np.ndarray[Any, Any]


@pytest.fixture
def fuse_now() -> Iterator[None]:
    """Build a structure's kernel on its first sighting."""
    old = _fusion.set_fuse_after(1)
    yield
    _fusion.set_fuse_after(old)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Counts:
    """The kernels launched, by name; a generated kernel as "fused" (structures that turn hot
    together are built as one program, their kernels named fused_0, fused_1, ...)."""
    counts: Counts = collections.Counter()
    on_launch(monkeypatch, lambda name: counts.update([_GENERATED.sub("fused", name)]))
    return counts


_GENERATED = re.compile(r"^fused_\d+$")


def _chain(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, list[tg.Id]]:
    ids: list[tg.Id] = []
    h = x
    for k in range(6):
        if k == 0:
            tape, h = tg.mul(tape, h, 1.5)
        elif k == 1:
            tape, h = tg.add(tape, h, -0.25)
        elif k == 2:
            tape, h = tg.relu(tape, h)
        elif k == 3:
            tape, h = tg.sqrt(tape, h)
        elif k == 4:
            tape, h = tg.mul(tape, h, x)
        else:
            tape, h = tg.neg(tape, h)
        ids.append(h)
    return tape, ids


def _all_expressions(args: list[tg.AnyTensor]) -> tg.AnyTensor:
    """Every registered core expression over the inputs, weighted into one sum."""
    total: tg.AnyTensor | None = None
    first = args[0]
    for k, found in enumerate(e for e in _EXPRESSIONS.values() if e.family == "elementwise"):
        # A heavy expression runs at once, in its own kernel; the others join the sum's.
        part = _fusion.elementwise(found, args[: found.arity], first.shape, first.dtype,
                                   first.device)
        if total is None:
            total = part
        else:
            weighted = _fusion.elementwise(_EXPRESSIONS["mul"], [total, 1.0 + k / 64],
                                           first.shape, first.dtype, first.device)
            total = _fusion.elementwise(_EXPRESSIONS["add"], [weighted, part], first.shape,
                                        first.dtype, first.device)
    assert total is not None
    return total


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_expression_in_one_generated_kernel_matches_op_by_op(
        dtype: Any, fuse_now: None, launches: Counts) -> None:
    rng = np.random.default_rng(0)
    data = [rng.uniform(0.5, 1.5, 1000).astype(dtype) for _ in range(3)]
    data[2][::7] = data[1][::7]  # ties for maximum_grad and clip_grad
    args = [tg.AnyTensor.from_numpy(d) for d in data]
    fused = _all_expressions(args)
    assert fused.pending is not None
    got = fused.numpy()
    heavy = {f"{e.name}__{'b' * e.arity}": 1 for e in _EXPRESSIONS.values()
             if e.family == "elementwise" and e.heavy}
    assert len(heavy) >= 10 and launches == {"fused": 1, **heavy}
    old = _fusion.set_fuse_after(0)
    try:
        want = _all_expressions(args).numpy()
    finally:
        _fusion.set_fuse_after(old)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-12 if dtype == np.float64 else 1e-5)


def test_a_hot_chain_is_one_kernel_and_its_inner_nodes_stay_pending(
        fuse_now: None, launches: Counts) -> None:
    x0 = np.linspace(-2, 2, 50)
    tape, x = tg.leaf(tg.Tape(), x0)
    tape, ids = _chain(tape, x)
    assert all(tg.value(tape, i).pending is not None for i in ids)
    want = -(np.sqrt(np.maximum(x0 * 1.5 - 0.25, 0)) * x0)
    np.testing.assert_allclose(tg.value(tape, ids[-1]).numpy(), want, rtol=1e-12)
    assert launches == {"fused": 1}
    assert all(tg.value(tape, i).pending is not None for i in ids[:-1])
    # An inner node read afterwards is computed again from the inputs, in a kernel of its own.
    np.testing.assert_allclose(tg.value(tape, ids[2]).numpy(), np.maximum(x0 * 1.5 - 0.25, 0))
    assert launches == {"fused": 2}


def test_a_cold_structure_runs_node_by_node_then_gets_its_kernel(launches: Counts) -> None:
    old = _fusion.set_fuse_after(2)
    try:
        x0 = np.linspace(0.1, 2, 9)
        for sighting in (1, 2):
            launches.clear()
            tape, x = tg.leaf(tg.Tape(), x0)
            tape, y = tg.sqrt(tape, x)  # a structure no other test builds
            tape, y = tg.neg(tape, y)
            tape, y = tg.mul(tape, y, x)
            np.testing.assert_allclose(tg.value(tape, y).numpy(), -np.sqrt(x0) * x0,
                                       rtol=1e-12)
            if sighting == 1:
                assert launches == {"sqrt__b": 1, "neg__b": 1, "mul__bb": 1}
                # Inner nodes keep the values this path made: reading one launches nothing.
                tg.value(tape, tape[-2].id).numpy()
                assert sum(launches.values()) == 3
            else:
                assert launches == {"fused": 1}
    finally:
        _fusion.set_fuse_after(old)


def test_structures_seen_once_are_built_with_the_first_that_turns_hot(
        launches: Counts) -> None:
    """Seen once, two structures run node by node and wait; when the first turns hot, both
    are built as one program, so the second's next sighting builds nothing."""
    old = _fusion.set_fuse_after(2)
    device = tg.default_device()
    try:
        x0 = np.linspace(0.1, 2, 9)

        def first(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:  # structures no other
            tape, y = tg.mul(tape, x, 0.375)                          # test builds
            tape, y = tg.sub(tape, y, x)
            return tg.mul(tape, y, y)

        def second(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
            tape, y = tg.add(tape, x, 0.625)
            tape, y = tg.mul(tape, y, x)
            return tg.sub(tape, y, 0.125)

        want = {first: (x0 * 0.375 - x0) ** 2, second: (x0 + 0.625) * x0 - 0.125}
        builds: list[int] = []
        for step in (first, second, first, second):
            launches.clear()
            builds.append(device.builds)
            tape, x = tg.leaf(tg.Tape(), x0)
            tape, y = step(tape, x)
            np.testing.assert_allclose(tg.value(tape, y).numpy(), want[step], rtol=1e-12)
            builds[-1] = device.builds - builds[-1]
            fused = sum(n for name, n in launches.items() if name == "fused")
            assert fused == (0 if len(builds) <= 2 else 1)
        assert builds[2] == 1 and builds[3] == 0  # both at the first's second sighting
    finally:
        _fusion.set_fuse_after(old)


def test_a_transcendental_is_computed_once_when_made(
        forwards_at_once: None, fuse_now: None, launches: Counts) -> None:
    """exp, log, tanh, sigmoid, erf, pow are calls into PoCL's library: such an op is computed
    when made, by its own kernel (eight lanes a call in float32), so that no later kernel
    computes it again (tanh_grad reads tanh's output; pending, the backward's kernel
    recomputed the forward's whole chain of them, one lane at a time)."""
    x0 = np.linspace(-2.0, 2.0, 64)
    tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
    tape, a = tg.mul(tape, x, 0.5)
    tape, t = tg.tanh(tape, a)
    tape, m = tg.add(tape, t, 1.0)
    assert tg.value(tape, m).pending is not None  # cheap: pending
    assert tg.value(tape, a).pending is None and tg.value(tape, t).pending is None
    assert launches == {"mul__bs": 1, "tanh__b": 1}  # x * 0.5 first, then tanh
    tape, s = tg.sum(tape, m)
    launches.clear()
    g = tg.backward(tape, s)[x].numpy()
    np.testing.assert_allclose(g, 0.5 * (1 - np.tanh(0.5 * x0) ** 2), rtol=1e-12)
    assert launches == {"fused": 1}  # the backward reads tanh's buffer


def test_long_chains_end_in_buffers(fuse_now: None, launches: Counts) -> None:
    tape, h = tg.leaf(tg.Tape(), np.ones(4))
    n = 3 * _fusion.FUSE_DEPTH + 5
    for _ in range(n):
        tape, h = tg.mul(tape, h, 1.001)
    np.testing.assert_allclose(tg.value(tape, h).numpy(), np.full(4, 1.001**n), rtol=1e-10)
    assert launches == {"fused": 4}


def _postorder(t: tg.AnyTensor) -> list[tg.AnyTensor]:
    """The pending nodes below t, operands first, in the order of a plain recursive walk."""
    order: list[tg.AnyTensor] = []
    seen: set[int] = set()

    def visit(node: tg.AnyTensor) -> None:
        seen.add(id(node))
        assert node.pending is not None
        for a in node.pending.operands:
            if isinstance(a, tg.AnyTensor) and a.pending is not None and id(a) not in seen:
                visit(a)
        order.append(node)

    visit(t)
    return order


def test_a_plan_walks_a_dag_as_a_recursive_walk_would(fuse_now: None) -> None:
    # Diamonds (x feeds both operands of later nodes), a second operand that is a deep chain of
    # its own, and an operand already placed by an earlier branch: the loop down each spine
    # must place every node once, operands first, in the recursive walk's order (the order is
    # part of the structure key, so it must not depend on how the walk is written).
    x = tg.AnyTensor.from_numpy(np.linspace(-1.0, 1.0, 8))
    mul, add, neg = (_EXPRESSIONS[k] for k in ("mul", "add", "neg"))

    def op(found: Any, *args: Any) -> tg.AnyTensor:
        return _fusion.elementwise(found, list(args), x.shape, x.dtype, x.device)

    a = op(neg, x)
    side = a
    for k in range(40):
        side = op(mul, side, 1.0 + k / 100)
    b = op(add, a, side)
    c = op(mul, b, a)
    d = op(add, op(neg, c), op(mul, side, c))
    plan = _fusion._Plan(d)
    want = _postorder(d)
    assert [id(n) for n in plan.order] == [id(n) for n in want]
    assert len(plan.order) == 46
    for j, refs in enumerate(plan.nodes):  # operands come first
        assert all(r < j for r in refs[:-1] if isinstance(r, int) and 0 <= r < _fusion.SCALAR)
    expect = -np.linspace(-1.0, 1.0, 8)
    s = expect * np.prod([1.0 + k / 100 for k in range(40)])
    cc = (expect + s) * expect
    np.testing.assert_allclose(d.numpy(), -cc + s * cc, rtol=1e-12)


def test_equal_scalars_share_an_argument_but_keep_their_sign(fuse_now: None) -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([1.0, 2.0]))
    tape, a = tg.mul(tape, x, -0.0)
    tape, b = tg.mul(tape, x, 0.0)
    tape, a = tg.div(tape, 1.0, a)  # -inf
    tape, b = tg.div(tape, 1.0, b)  # +inf
    tape, d = tg.sub(tape, a, b)
    np.testing.assert_array_equal(tg.value(tape, d).numpy(), [-np.inf, -np.inf])


def test_the_gradient_of_a_full_sum_never_materialises_its_broadcast(
        forwards_at_once: None, fuse_now: None, launches: Counts) -> None:
    x0 = np.random.default_rng(1).standard_normal(1000)
    tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
    tape, r = tg.relu(tape, x)
    tape, p = tg.mul(tape, r, x)
    tape, s = tg.sum(tape, p)
    launches.clear()
    (g,) = tg.backward(tape, s).values()
    np.testing.assert_allclose(g.numpy(), np.where(x0 > 0, 2 * x0, 0.0), rtol=1e-12)
    # One kernel in all: no materialised broadcast, and no fill for the seed (made once).
    assert launches == {"fused": 1}


def test_a_chain_allocates_only_its_result(fuse_now: None) -> None:
    device = tg.default_device()
    n = 1 << 18
    tape, x = tg.leaf(tg.Tape(), np.ones(n, np.float32))
    device.reset_peak()
    base = device.active_bytes()
    h = x
    for _ in range(40):
        tape, h = tg.add(tape, h, 1.0)
    np.testing.assert_array_equal(tg.value(tape, h).numpy(), np.full(n, 41.0, np.float32))
    # Op by op, the tape would hold 40 buffers of 1 MiB; pending, only the result has one.
    assert device.peak_bytes() - base <= 2 * 4 * n


def test_with_fusion_off_every_op_runs_at_once(forwards_at_once: None, launches: Counts) -> None:
    old = _fusion.set_fuse_after(0)
    try:
        tape, x = tg.leaf(tg.Tape(), np.ones(3))
        tape, y = tg.exp(tape, x)
        assert tg.value(tape, y).pending is None
        assert launches == {"exp__b": 1}
    finally:
        _fusion.set_fuse_after(old)


@pytest.mark.parametrize("n", [5000, 37])
def test_the_sum_of_a_hot_chain_never_writes_the_chain(
        n: int, fuse_now: None, launches: Counts) -> None:
    x0 = np.random.default_rng(2).standard_normal((3, n))
    tape, x = tg.leaf(tg.Tape(), x0)
    tape, r = tg.relu(tape, x)
    tape, p = tg.mul(tape, r, x)
    tape, s = tg.sum(tape, p, axis=1)
    got = tg.value(tape, s).numpy()
    assert tg.value(tape, p).pending is not None
    assert launches["fused"] == 1 and not any(k.startswith(("relu", "mul")) for k in launches)
    old = _fusion.set_fuse_after(0)
    try:
        tape, x = tg.leaf(tg.Tape(), x0)
        tape, r = tg.relu(tape, x)
        tape, p = tg.mul(tape, r, x)
        tape, s = tg.sum(tape, p, axis=1)
        want = tg.value(tape, s).numpy()
    finally:
        _fusion.set_fuse_after(old)
    np.testing.assert_array_equal(got, want)  # the same sums in the same order
    np.testing.assert_allclose(got, (np.maximum(x0, 0) * x0).sum(axis=1), rtol=1e-12)


@pytest.mark.parametrize("fuse", [1, 3])
def test_realising_leaves_no_reference_cycles(fuse: int) -> None:
    """Buffers return to the pool when the tape goes, not when the cyclic GC runs."""
    old = _fusion.set_fuse_after(fuse)
    gc.disable()
    try:
        tape, x = tg.leaf(tg.Tape(), np.ones(8), requires_grad=True)
        tape, ids = _chain(tape, x)
        tape, s = tg.sum(tape, ids[-1])
        tg.backward(tape, s)
        inner = weakref.ref(tg.value(tape, ids[2]))
        out = weakref.ref(tg.value(tape, ids[-1]))
        del tape, ids, s
        assert inner() is None and out() is None
    finally:
        gc.enable()
        _fusion.set_fuse_after(old)


def _bias_relu(x0: np.ndarray[Any, Any], b0: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    tape, x = tg.leaf(tg.Tape(), x0)
    tape, b = tg.leaf(tape, b0)
    tape, y = tg.add(tape, x, b)
    tape, y = tg.relu(tape, y)
    tape, y = tg.mul(tape, y, b)
    return tg.value(tape, y).numpy()


BLOCKS = [
    ((4, 512), (512,)),               # a row over leading axes ("@row")
    ((3, 2, 256), (2, 256)),          # a row of two axes
    ((8, 4096), (8, 1)),              # each element over a run ("@each")
    ((2, 3, 16, 16), (1, 3, 1, 1)),   # a per-channel bias
    ((4, 10), (10,)),                 # a short row, read per element ("@rowmod")
    ((300, 7), (7,)),                 # ... many of them: rows across every chunk's ends
    ((2, 3, 100), (3, 100)),          # ... of two axes
    ((5000, 10), (10,)),              # over more than ROW_MOD_MAX elements: copied
    ((5, 3, 256), (5, 1, 256)),       # not one block: copied
]


@pytest.mark.parametrize(("x_shape", "b_shape"), BLOCKS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_broadcast_blocks_read_in_place_match_op_by_op(
        x_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: Any) -> None:
    rng = np.random.default_rng(len(x_shape) + x_shape[-1])
    x0, b0 = rng.standard_normal(x_shape).astype(dtype), rng.standard_normal(b_shape).astype(dtype)
    want = np.maximum(x0 + b0, 0) * b0
    old = _fusion.set_fuse_after(0)
    try:
        eager = _bias_relu(x0, b0)
    finally:
        _fusion.set_fuse_after(old)
    np.testing.assert_allclose(eager, want, rtol=1e-6)
    old = _fusion.set_fuse_after(2)
    try:
        for _ in range(3):  # node by node, then fused (one kernel reading b where it is)
            np.testing.assert_array_equal(_bias_relu(x0, b0), eager)
    finally:
        _fusion.set_fuse_after(old)


def test_a_bias_add_is_one_kernel_with_no_broadcast_copy(
        fuse_now: None, launches: Counts) -> None:
    x0 = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)
    b0 = np.arange(512, dtype=np.float32)
    launches.clear()
    np.testing.assert_array_equal(_bias_relu(x0, b0), np.maximum(x0 + b0, 0) * b0)
    assert launches == {"fused": 1}


@pytest.mark.parametrize("width", [10, 64, 100])
def test_a_small_bias_add_of_a_short_row_is_one_kernel(
        fuse_now: None, launches: Counts, width: int) -> None:
    # A small model's bias (rows of fewer than 256 elements) is read in place too: a copy of
    # it would cost a launch of its own.
    x0 = np.random.default_rng(4).standard_normal((33, width)).astype(np.float32)
    b0 = np.arange(width, dtype=np.float32) - 7.5
    launches.clear()
    np.testing.assert_array_equal(_bias_relu(x0, b0), np.maximum(x0 + b0, 0) * b0)
    assert launches == {"fused": 1}


def test_block_broadcast_shapes() -> None:
    block = _fusion._block
    assert block((512,), (4, 512)) == (512, 1)
    assert block((8, 1), (8, 4096)) == (8, 4096)
    assert block((1, 3, 1, 1), (2, 3, 16, 16)) == (3, 256)
    assert block((2, 256), (3, 2, 256)) == (512, 1)
    assert block((5, 1, 256), (5, 3, 256)) is None  # a broadcast axis inside the block
    assert block((1, 1), (4, 4)) is None             # a splat: not a block


def test_a_mean_cross_entropy_reads_its_cotangent_without_a_copy(
        fuse_now: None, launches: Counts) -> None:
    """The VJP of the mean is a pending splat; the loss's gradient kernel reads its one element
    (stride 0) instead of 256 copies."""
    rng = np.random.default_rng(4)
    logits, labels = rng.standard_normal((256, 10)), rng.integers(0, 10, 256)
    tape, x = tg.leaf(tg.Tape(), logits, requires_grad=True)
    tape, y = tg.leaf(tape, labels)
    tape, loss = tg.cross_entropy(tape, x, y)
    launches.clear()
    (g,) = tg.backward(tape, loss).values()
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    want = (e / e.sum(axis=1, keepdims=True) - np.eye(10)[labels]) / 256
    np.testing.assert_allclose(g.numpy(), want, rtol=1e-10, atol=1e-15)
    assert not any(name.startswith("gather") for name in launches)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "axes"), [
    ((3, 4, 5), (1, 0, 2)),          # whole inner rows
    ((6, 7), (1, 0)),                # an inner step of 7
    ((2, 3, 4, 5), (3, 1, 0, 2)),    # four dims
    ((3, 300), (1, 0)),              # rows longer than one chunk of the copy kernels
])
def test_a_transpose_of_a_pending_value_evaluates_it_in_the_gather(
        forwards_at_once: None, fuse_now: None, launches: Counts, shape: tuple[int, ...],
        axes: tuple[int, ...], dtype: Any) -> None:
    rng = np.random.default_rng(7)
    a0, b0 = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
    tape, a = tg.leaf(tg.Tape(), a0)
    tape, b = tg.leaf(tape, b0)
    tape, h = tg.tanh(tape, a)
    tape, h = tg.mul(tape, h, b)
    launches.clear()
    tape, t = tg.transpose(tape, h, axes)
    got = tg.value(tape, t).numpy()
    assert launches == {"fused": 1}  # no buffer for h, no separate copy
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(got, np.transpose(np.tanh(a0) * b0, axes), rtol=tol, atol=tol)
    assert tape[h].value.pending is not None  # h itself is never written


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("residual", [False, True], ids=["relu", "add-relu"])
def test_a_padded_convolution_of_a_pending_value_evaluates_it_in_the_pad(
        forwards_at_once: None, fuse_now: None, launches: Counts, residual: bool,
        dtype: Any) -> None:
    """A convolution that pads its input (`pad_planes`) over relu(x) or relu(x + r), as a
    ResNet's after a norm: the DAG is computed inside the pad, with no launch or buffer of its
    own, for the forward and for the weight's gradient; the bits those of a convolution of the
    same values read from a buffer."""
    rng = np.random.default_rng(21)
    x0 = rng.standard_normal((2, 3, 5, 8)).astype(dtype)
    r0 = rng.standard_normal((2, 3, 5, 8)).astype(dtype)
    w0 = rng.standard_normal((4, 3, 3, 3)).astype(dtype)

    def conv(pending: bool) -> tuple[Array, Array, Array]:
        h0 = np.maximum(x0 + r0 if residual else x0, 0)
        tape, w = tg.leaf(tg.Tape(), w0, requires_grad=True)
        if pending:
            tape, h = tg.leaf(tape, x0)
            if residual:
                tape, r = tg.leaf(tape, r0)
                tape, h = tg.add(tape, h, r)
            tape, h = tg.relu(tape, h)
        else:
            tape, h = tg.leaf(tape, h0)
        launches.clear()
        tape, y = tg.conv2d(tape, h, w, padding=1)
        tape, loss = tg.sum(tape, y)
        value = tg.value(tape, y).numpy()
        forward = dict(launches)
        grad = tg.backward(tape, loss)[w].numpy()
        if pending:
            assert tape[h].value.pending is not None  # relu's value is never written
            assert "pad_planes" not in forward and forward.get("fused") == 1, forward
        return value, grad, h0

    got, got_grad, h0 = conv(True)
    want, want_grad, _ = conv(False)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_grad, want_grad)
    torch = pytest.importorskip("torch")
    ref = torch.nn.functional.conv2d(torch.from_numpy(h0), torch.from_numpy(w0), padding=1)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, ref.numpy(), rtol=tol, atol=tol)


def test_a_cold_gather_runs_node_by_node_without_a_map_sighting(launches: Counts) -> None:
    # Below the sighting that builds it, the DAG runs with the core kernels and the copy
    # gathers its buffer; only the gather's structure is counted, so no map kernel that the
    # hot path would never use gets built later.
    device = tg.default_device()
    x0 = np.arange(12.0).reshape(3, 4)
    tape, x = tg.leaf(tg.Tape(), x0)
    tape, h = tg.mul(tape, x, 2.5)
    tape, h = tg.add(tape, h, -1.25)
    before = dict(_fusion.kernels_on(device).seen)
    tape, t = tg.transpose(tape, h)
    np.testing.assert_array_equal(tg.value(tape, t).numpy(), (x0 * 2.5 - 1.25).T)
    assert launches == {"mul__bs": 1, "add__bs": 1, "gather4_8": 1}
    counted = {k: v for k, v in _fusion.kernels_on(device).seen.items() if before.get(k) != v}
    assert [k[0] for k in counted] == ["gather2"]


def test_a_pending_repeated_block_is_written_before_its_gather(
        fuse_now: None, launches: Counts) -> None:
    # A repeated block (a per-channel bias) is read per chunk of the map kernel: a gather of it
    # realises the value first (two launches), and the values still match.
    x0 = np.random.default_rng(8).standard_normal((4, 2, 256))
    b0 = np.random.default_rng(9).standard_normal((4, 1, 1))
    tape, x = tg.leaf(tg.Tape(), x0)
    tape, b = tg.leaf(tape, b0)
    tape, h = tg.add(tape, x, b)
    launches.clear()
    tape, t = tg.transpose(tape, h, (2, 1, 0))
    np.testing.assert_allclose(tg.value(tape, t).numpy(), np.transpose(x0 + b0, (2, 1, 0)),
                               rtol=1e-14)
    assert launches["fused"] == 1 and sum(launches.values()) == 2


def test_a_reshape_between_elementwise_ops_keeps_them_one_kernel(
        forwards_at_once: None, fuse_now: None, launches: Counts) -> None:
    x0 = np.random.default_rng(11).standard_normal((4, 6))
    tape, x = tg.leaf(tg.Tape(), x0)
    tape, h = tg.neg(tape, x)
    tape, r = tg.reshape(tape, h, (3, 8))
    assert tape[r].value.pending is not None   # a pending value reshaped stays pending
    tape, y = tg.mul(tape, r, 2.0)
    launches.clear()
    np.testing.assert_allclose(tg.value(tape, y).numpy(), -2 * x0.reshape(3, 8), rtol=1e-14)
    assert launches == {"fused": 1}
    # Realising one of the two shapes gives the other its buffer: no second kernel.
    np.testing.assert_allclose(tg.value(tape, r).numpy(), -x0.reshape(3, 8), rtol=1e-14)
    launches.clear()
    np.testing.assert_allclose(tg.value(tape, h).numpy(), -x0, rtol=1e-14)
    assert launches == {}


@pytest.mark.parametrize("by_node", [False, True])
def test_a_reshaped_pending_broadcast_reads_its_block_by_its_own_shape(
        fuse_now: None, monkeypatch: pytest.MonkeyPatch, by_node: bool) -> None:
    # A bias row broadcast (a repeated block) then reshaped. Run node by node (as a structure
    # not yet hot is), the broadcast's copy must follow its block, not the new shape.
    def never_hot(*args: Any) -> None:
        return None

    if by_node:
        monkeypatch.setattr(_fusion, "_hot_kernel", never_hot)
    x0 = np.random.default_rng(12).standard_normal((4, 256))
    b0 = np.random.default_rng(13).standard_normal(256)
    tape, x = tg.leaf(tg.Tape(), x0)
    tape, b = tg.leaf(tape, b0)
    tape, bb = tg.broadcast_to(tape, b, (4, 256))
    tape, rb = tg.reshape(tape, bb, (8, 2, 64))
    tape, rx = tg.reshape(tape, x, (8, 2, 64))
    tape, y = tg.add(tape, rx, rb)
    np.testing.assert_allclose(tg.value(tape, y).numpy(), (x0 + b0).reshape(8, 2, 64),
                               rtol=1e-14)


# --- replayed walks ---------------------------------------------------------------------------


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the DAGs walked (not replayed), with the skeletons forgotten first."""
    sizes: list[int] = []
    walk = _fusion._Plan.__init__  # pyright: ignore[reportPrivateUsage]

    def counted(plan: Any, t: tg.AnyTensor) -> None:
        walk(plan, t)
        sizes.append(len(plan.order))

    monkeypatch.setattr(_fusion._Plan, "__init__", counted)  # pyright: ignore[reportPrivateUsage]
    monkeypatch.setattr(_fusion, "_skeletons", {})
    return sizes


def _op(found: str, *args: Any) -> tg.AnyTensor:
    first = next(a for a in args if isinstance(a, tg.AnyTensor))
    return _fusion.elementwise(_EXPRESSIONS[found], list(args), first.shape, first.dtype,
                               first.device)


def _ladder(x: tg.AnyTensor, y: tg.AnyTensor, s: float, t: float, share: bool) -> tg.AnyTensor:
    """A DAG of 12 pending nodes with scalars s and t, reading x and y; with `share`, its
    last node reads one node twice, else two equal copies of it."""
    h = x
    for k in range(10):
        h = _op("mul", h, s) if k % 2 else _op("add", h, y if k == 4 else t)
    other = h if share else _op("add", _op("sub", h, t), t)
    return _op("mul", h, other)


def _ladder_value(x: Any, y: Any, s: float, t: float) -> Any:
    h = x
    for k in range(10):
        h = h * s if k % 2 else h + (y if k == 4 else t)
    return h, h * h


def test_a_repeated_structure_replays_its_walk_and_matches_numpy(
        fuse_now: None, walks: list[int]) -> None:
    rng = np.random.default_rng(3)
    xs, ys = rng.standard_normal(8), rng.standard_normal(8)
    x, y = tg.AnyTensor.from_numpy(xs), tg.AnyTensor.from_numpy(ys)
    for step in range(3):  # the same structure each step, other values
        s, t = 1.0 + step / 10, -0.5 - step
        got = _ladder(x, y, s, t, share=True).numpy()
        np.testing.assert_allclose(got, _ladder_value(xs, ys, s, t)[1], rtol=1e-12)
    assert walks == [11]  # walked once (11 distinct nodes), then replayed


@pytest.mark.parametrize("change", ["unshared", "scalars", "zero-sign", "nan", "input",
                                    "realised", "expression"])
def test_a_dag_that_differs_from_the_skeleton_is_walked(
        fuse_now: None, walks: list[int], change: str) -> None:
    """Each way a DAG with the skeleton's top (expression and depth) can differ: a node the
    skeleton shares now two copies, scalars it merged now unequal (or equal with another sign
    of zero, or NaN), an input it read twice now two, a node realised since, another
    expression inside. The DAG is walked and its value is right."""
    rng = np.random.default_rng(4)
    xs = rng.standard_normal(8)
    x = tg.AnyTensor.from_numpy(xs)
    y = tg.AnyTensor.from_numpy(rng.standard_normal(8))
    first = _ladder(x, x if change == "input" else y, 0.0 if change == "zero-sign" else 2.0,
                    0.0 if change == "zero-sign" else 2.0, share=True)
    first.numpy()
    assert len(walks) == 1
    s, t, ys, share = 2.0, 2.0, y, True
    if change == "scalars":
        t = 3.0
    elif change == "zero-sign":
        s, t = 0.0, -0.0
    elif change == "nan":
        t = float("nan")
    # "input": the skeleton read one input twice (x); the DAG reads two (x and y)
    dag = _ladder(x, ys, s, t, share=share)
    if change == "realised":
        inner: Any = dag.pending
        inner.operands[0].buffer  # noqa: B018 - a node of the DAG computed on its own
    if change == "unshared":  # the skeleton's shared node is two now, of other values
        h, hv = x, xs
        for k in range(9):
            h = _op("mul", h, s) if k % 2 else _op("add", h, y if k == 4 else t)
            hv = hv * s if k % 2 else hv + (y.numpy() if k == 4 else t)
        dag = _op("mul", _op("mul", h, 2.0), _op("mul", h, 3.0))
        np.testing.assert_allclose(dag.numpy(), (hv * 2.0) * (hv * 3.0), rtol=1e-12)
        assert len(walks) >= 2, "replayed a DAG that differs from the skeleton"
        return
    if change == "expression":  # the same top and depth, another op below
        h = _op("sub", _op("mul", x, 2.0), 2.0)
        for k in range(2, 10):
            h = _op("mul", h, s) if k % 2 else _op("add", h, y if k == 4 else t)
        dag = _op("mul", h, h)
    got = dag.numpy()
    assert len(walks) >= 2, "replayed a DAG that differs from the skeleton"
    if change == "expression":
        return
    want = _ladder_value(xs, ys.numpy(), s, t)[1]
    np.testing.assert_allclose(got, want, rtol=1e-12, equal_nan=True)


def test_a_dag_sharing_what_the_skeleton_reached_twice_replays_with_the_same_values(
        fuse_now: None, walks: list[int]) -> None:
    """The skeleton's two equal copies are one node now: the replay evaluates it twice (the
    same values) rather than walk."""
    rng = np.random.default_rng(5)
    xs, ys = rng.standard_normal(8), rng.standard_normal(8)
    x, y = tg.AnyTensor.from_numpy(xs), tg.AnyTensor.from_numpy(ys)
    unshared = _ladder(x, y, 2.0, 2.0, share=False)
    unshared.numpy()

    # The same structure, its copy's inputs the very tensors of the first.
    h = x
    for k in range(10):
        h = _op("mul", h, 2.0) if k % 2 else _op("add", h, y if k == 4 else 2.0)
    twice = _op("mul", h, _op("add", _op("sub", h, 2.0), 2.0))
    walked = len(walks)
    np.testing.assert_allclose(twice.numpy(), _ladder_value(xs, ys, 2.0, 2.0)[1], rtol=1e-12)
    assert len(walks) == walked  # replayed


def _lstm(steps: int) -> tuple[np.ndarray[Any, Any], list[np.ndarray[Any, Any]]]:
    """The benchmark's LSTM cell unrolled `steps` times, small (batch 4, hidden 8): the loss (the
    sum of every step's hidden state) and its gradients by the gates' parameters, on the host."""
    return lstm_fusion.lstm_step(*lstm_fusion.device_data(steps, batch=4, hidden=8, features=3))


@pytest.mark.parametrize("steps", [3, 40])
def test_an_unrolled_lstm_fused_matches_op_by_op_bitwise(steps: int) -> None:
    """A long graph of pending values (the cell state's gradient, read by every gate's and by
    the step before, and gradients summed over every step) changes no bit of the loss or the
    gradients, on the node-by-node path or in generated kernels."""
    old = _fusion.set_fuse_after(0)
    try:
        loss0, grads0 = _lstm(steps)
    finally:
        _fusion.set_fuse_after(old)
    for fuse in (3, 1):  # the node-by-node path first, then generated kernels
        old = _fusion.set_fuse_after(fuse)
        try:
            for _ in range(2):
                loss, grads = _lstm(steps)
                assert loss.tobytes() == loss0.tobytes()
                for got, want in zip(grads, grads0, strict=True):
                    assert got.tobytes() == want.tobytes()
        finally:
            _fusion.set_fuse_after(old)



def test_an_unrolled_lstm_walks_each_step_a_bounded_number_of_nodes(
        fuse_now: None, walks: list[int]) -> None:
    """A node that later steps' DAGs read again (the cell state's gradient) is cut out once
    it is seen shared, so the nodes walked grow linearly with the steps, not quadratically."""
    per_step: list[float] = []
    for steps in (10, 40):
        _lstm(steps)  # a first run builds the kernels
        walks.clear()
        _lstm(steps)
        per_step.append(sum(walks) / steps)
    assert per_step[1] < 1.5 * per_step[0], per_step


# --- pending views: a block of a buffer, or a block put into zeros ------------------------------

SPLITS: list[tuple[tuple[int, ...], int, int | list[int]]] = [
    ((16, 256), 1, 4),         # an LSTM's gates
    ((3, 12, 5), 1, [2, 7]),   # unequal pieces, inner axis after the cut
    ((12, 5), 0, 3),           # along the first axis: a contiguous block each
    ((2, 3, 8, 4), 2, [1, 1, 5]),  # an empty piece
    ((4, 12, 3), 1, 12),       # 11 puts summed in place (`_fusion._realise_puts`)
    ((20, 3), 0, 10),          # 9 runs summed in place
]


def _scaled_squares(tape: tg.Tape, pieces: list[tg.Id], ks: list[int]
                    ) -> tuple[tg.Tape, tg.Id]:
    """sum_i (0.5 + ks[i]) * sum(pieces[i] ** 2), summed in order."""
    total: tg.Id | None = None
    for k, piece in zip(ks, pieces, strict=True):
        tape, q = tg.mul(tape, piece, piece)
        tape, q = tg.mul(tape, q, 0.5 + k)
        tape, s = tg.sum(tape, q)
        if total is None:
            total = s
        else:
            tape, total = tg.add(tape, total, s)
    assert total is not None
    return tape, total


def _split_grad(x0: np.ndarray[Any, Any], axis: int, cuts: int | list[int], fuse: int
                ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The gradient of a sum over split pieces, each scaled (one, the second, left out: its
    block of the gradient is zeros), with the given fusion setting, twice: both results."""
    old = _fusion.set_fuse_after(fuse)
    try:
        def f(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
            tape, parts = tg.split(tape, x, cuts, axis=axis)
            return _scaled_squares(tape, [p for k, p in enumerate(parts) if k != 1],
                                   [k for k in range(len(parts)) if k != 1])

        grad = tg.grad(f)
        return (grad(tg.AnyTensor.from_numpy(x0)).numpy(),
                grad(tg.AnyTensor.from_numpy(x0)).numpy())
    finally:
        _fusion.set_fuse_after(old)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "axis", "cuts"), SPLITS)
def test_the_vjps_of_split_pieces_are_put_in_place_bitwise(
        launches: Counts, shape: tuple[int, ...], axis: int, cuts: int | list[int],
        dtype: Any) -> None:
    """A piece's VJP is a pending put that the sum of the pieces' VJPs reads in place: no
    embed kernel runs, and every bit (-0.0, inf, NaN among the values) is the embed kernels'
    and adds' of fusion off, on the node-by-node path and in a generated kernel."""
    x0 = np.random.default_rng(11).standard_normal(shape).astype(dtype)
    x0.flat[:3] = [-0.0, np.inf, np.nan]
    x0.flat[-1] = -0.0
    off, _ = _split_grad(x0, axis, cuts, 0)
    assert launches["embed" + str(x0.itemsize)] > 0
    pieces = np.split(np.arange(shape[axis]), cuts)
    want = np.zeros_like(x0)
    for k, ix in enumerate(pieces):
        if k != 1:
            at = tuple(ix if d == axis else slice(None) for d in range(len(shape)))
            want[at] = x0[at] * (0.5 + k) * 2  # x * x * c: the VJP is c * x + c * x
    np.testing.assert_array_equal(off, want)
    for fuse in (3, 1):  # node by node at its first sightings, then a generated kernel
        launches.clear()
        by_node, hot = _split_grad(x0, axis, cuts, fuse)
        if fuse == 1:  # generated kernels read the puts: no embed (node by node copies them)
            assert not any(name.startswith("embed") for name in launches)
        # Eight puts or more are added into one buffer, whatever the fusion setting.
        assert (launches["add_puts8"] > 0) == (len(pieces) > _fusion.PUTS_MIN), launches
        assert by_node.tobytes() == off.tobytes() and hot.tobytes() == off.tobytes()


def _steps_grad(x0: np.ndarray[Any, Any], steps: list[int], direct: bool, fuse: int
                ) -> np.ndarray[Any, Any]:
    """The gradient of sum_t c_t * sum(x[:, t] ** 2) over `steps` (an RNN's inputs, step by
    step), plus sum(x ** 2) last with `direct`, with the given fusion setting, the second of
    two calls."""
    old = _fusion.set_fuse_after(fuse)
    try:
        def f(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
            pieces: list[tg.Id] = []
            for t in steps:
                tape, xt = tg.slice(tape, x, np.s_[:, t])
                pieces.append(xt)
            tape, total = _scaled_squares(tape, pieces, list(range(len(steps))))
            if direct:
                tape, q = tg.mul(tape, x, x)
                tape, s = tg.sum(tape, q)
                tape, total = tg.add(tape, total, s)
            return tape, total

        grad = tg.grad(f)
        grad(tg.AnyTensor.from_numpy(x0))
        return grad(tg.AnyTensor.from_numpy(x0)).numpy()
    finally:
        _fusion.set_fuse_after(old)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["steps", "first-a-sum", "overlapping"])
def test_the_vjps_of_many_steps_are_added_in_place_bitwise(
        launches: Counts, case: str, dtype: Any) -> None:
    """The VJPs of x[:, t] for ten steps t, summed by the sweep: ten puts, added into one buffer
    (`_fusion._realise_puts`) in two launches, bit for bit (-0.0, inf, NaN among the values)
    fusion off's embeds and adds; after the VJP of x ** 2 (the first term of the sum: x + 0
    first), likewise. Slices that overlap (x[:, 3] twice) are summed by a fused kernel."""
    x0 = np.random.default_rng(13).standard_normal((4, 10, 6)).astype(dtype)
    x0.flat[:3] = [-0.0, np.inf, np.nan]
    x0.flat[-1] = -0.0
    steps = [*range(10), 3] if case == "overlapping" else list(range(10))
    want = 2 * x0 if case == "first-a-sum" else np.zeros_like(x0)
    for k, t in enumerate(steps):
        want[:, t] += x0[:, t] * dtype(0.5 + k) * 2
    off = _steps_grad(x0, steps, case == "first-a-sum", 0)
    np.testing.assert_allclose(off, want, rtol=1e-6)
    for fuse in (3, 1):  # node by node at its first sightings, then generated kernels
        launches.clear()
        got = _steps_grad(x0, steps, case == "first-a-sum", fuse)
        assert got.tobytes() == off.tobytes()
        if case == "overlapping":
            assert not any(name.startswith("add_puts") for name in launches)
        else:
            assert launches["add_puts8"] == launches["add_puts2"] == 2, launches  # two calls
            assert not any(name.startswith("embed") for name in launches)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pending_views_are_read_in_place_by_each_sink(
        fuse_now: None, launches: Counts, dtype: Any) -> None:
    """Takes and puts of buffers inside a DAG that a map, a gather (a transpose) or a row sum
    evaluates: one launch each, the values numpy's."""
    rng = np.random.default_rng(12)
    src0 = rng.standard_normal((6, 10, 4)).astype(dtype)
    part0 = rng.standard_normal((6, 3, 4)).astype(dtype)
    src, part = tg.AnyTensor.from_numpy(src0), tg.AnyTensor.from_numpy(part0)
    put0 = np.zeros_like(src0)
    put0[:, 5:8] = part0
    take0 = src0[:, 2:5]

    def views() -> tuple[tg.AnyTensor, tg.AnyTensor]:
        put = _fusion.pending_view("put", part, (6, 10, 4), 12, 40, 20)
        take = _fusion.pending_view("take", src, (6, 3, 4), 12, 40, 8)
        assert put is not None and take is not None
        return _op("mul", _op("add", put, src), 2.0), _op("add", take, part)

    launches.clear()
    put, take = views()
    assert not launches  # a view of buffers reads them where its consumer runs
    np.testing.assert_array_equal(put.numpy(), (put0 + src0) * 2)
    np.testing.assert_array_equal(take.numpy(), take0 + part0)
    assert launches == {"fused": 2}
    for name, want in (("put", (put0 + src0) * 2), ("take", take0 + part0)):
        put, take = views()
        t = put if name == "put" else take
        launches.clear()
        moved = _kernels.strided_gather(t, (t.shape[2], t.shape[0], t.shape[1]),
                                        [1, t.shape[1] * t.shape[2], t.shape[2]])
        np.testing.assert_array_equal(moved.numpy(), np.transpose(want, (2, 0, 1)))
        put, take = views()
        t = put if name == "put" else take
        # The sum primitive on the pending tensor itself (a leaf would compute it first).
        s = EagerEmitter(t.device).apply(SUM, [t], ReduceParams((1, 2), False))
        np.testing.assert_allclose(s.numpy(), want.sum(axis=(1, 2)),
                                   rtol=1e-6 if dtype == np.float32 else 1e-14)
        assert launches == {"fused": 2}  # the gather's and the row sum's, nothing written


def test_a_pending_view_reshaped_keeps_its_flat_block() -> None:
    """A view's recipe is over flat indices: a reshape of it (sharing the recipe) and the
    node-by-node copy read the same elements."""
    src0 = np.arange(48.0).reshape(4, 12)
    src = tg.AnyTensor.from_numpy(src0)
    take = _fusion.pending_view("take", src, (4, 5), 5, 12, 3)
    assert take is not None
    np.testing.assert_array_equal(take.with_shape((2, 10)).numpy(),
                                  src0[:, 3:8].reshape(2, 10))


def _views_of_pending(tape: tg.Tape, x: tg.Id, y: tg.Id) -> tuple[tg.Tape, tg.Id]:
    """Pieces of a pending value (takes whose source is a DAG), a slice of a piece (a take of a
    take), a transpose and a row sum over them (the sinks); the gradient puts pending
    cotangents, a put of a put among them."""
    tape, h = tg.mul(tape, x, y)
    tape, h = tg.add(tape, h, 0.5)
    tape, (a, b, c) = tg.split(tape, h, [3, 7], axis=1)
    tape, b = tg.slice(tape, b, np.s_[:, 1:, :])
    tape, ac = tg.mul(tape, a, c)
    tape, b2 = tg.mul(tape, b, 2.0)
    tape, s = tg.add(tape, ac, b2)
    tape, t = tg.transpose(tape, s, (2, 0, 1))
    tape, t = tg.tanh(tape, t)
    tape, r = tg.sum(tape, t, axis=(1, 2))
    tape, r = tg.mul(tape, r, r)
    return tg.sum(tape, r)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_views_of_pending_values_evaluate_their_dags_at_the_views_indices(
        launches: Counts, dtype: Any) -> None:
    """A view's pending source is evaluated inside the kernel that reads the view, at the
    view's indices (a put's only on its block): every bit (inf, NaN, -0.0 among the inputs)
    is fusion off's, on the node-by-node path and in generated kernels, in a third of the
    launches and with no embed."""
    rng = np.random.default_rng(13)
    x0 = rng.standard_normal((6, 10, 4)).astype(dtype)
    y0 = rng.standard_normal((6, 10, 4)).astype(dtype)
    x0.flat[:3] = [-0.0, np.inf, np.nan]
    x0.flat[-1] = -0.0
    results: dict[int, list[bytes]] = {}
    counts: dict[int, int] = {}
    for fuse in (0, 3, 1):
        old = _fusion.set_fuse_after(fuse)
        try:
            for _ in range(3):
                launches.clear()
                value, (gx, gy) = tg.value_and_grad(_views_of_pending, argnums=(0, 1))(
                    tg.AnyTensor.from_numpy(x0), tg.AnyTensor.from_numpy(y0))
                got = [value.numpy().tobytes(), gx.numpy().tobytes(), gy.numpy().tobytes()]
                assert got == results.setdefault(fuse, got)
                counts[fuse] = sum(launches.values())
        finally:
            _fusion.set_fuse_after(old)
        assert results[fuse] == results[0]
    assert not any(name.startswith("embed") for name in launches)
    assert counts[1] * 2 < counts[0], counts
    # The value, against numpy (finite inputs: the NaN spreads through the sum).
    x0[np.isnan(x0) | np.isinf(x0)] = 0.5
    h = x0 * y0 + 0.5
    s = h[:, :3] * h[:, 7:] + h[:, 4:7] * 2.0
    want = float(((np.tanh(np.transpose(s, (2, 0, 1))).sum(axis=(1, 2))) ** 2).sum())
    value = tg.value_and_grad(_views_of_pending, argnums=(0, 1))(
        tg.AnyTensor.from_numpy(x0), tg.AnyTensor.from_numpy(y0))[0]
    np.testing.assert_allclose(value.numpy(), want, rtol=1e-5 if dtype == np.float32 else 1e-12)


def test_views_with_rows_of_two_lengths_in_one_kernel(fuse_now: None, launches: Counts
                                                      ) -> None:
    """A put over rows of 40 and a take over rows of 4 in one DAG: the kernel does not run
    along one row length, and each element finds its own row and column."""
    rng = np.random.default_rng(14)
    part0, src0 = rng.standard_normal((6, 3, 4)), rng.standard_normal((6, 10, 8))
    part, src = tg.AnyTensor.from_numpy(part0), tg.AnyTensor.from_numpy(src0)
    for _ in range(2):
        put = _fusion.pending_view("put", _op("mul", part, 3.0), (6, 10, 4), 12, 40, 20)
        take = _fusion.pending_view("take", src, (6, 10, 4), 4, 8, 2)
        assert put is not None and take is not None
        launches.clear()
        got = _op("add", put, take).numpy()
        want = src0[:, :, 2:6].copy()
        want[:, 5:8] += part0 * 3.0
        np.testing.assert_array_equal(got, want)
        assert launches == {"fused": 1}


HEAVY_UNARY = sorted(name for name, e in _EXPRESSIONS.items()
                     if e.heavy and e.arity == 1 and e.family in _kernels.OWN_FAMILIES)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "cut"), [
    ((16, 256), (64, 128)),   # an LSTM's gate: rows of 64 from rows of 256
    ((37, 72), (24, 48)),     # rows of 24 (a multiple of 8) across chunks, a scalar tail
    ((9, 30), (5, 20)),       # rows of 15: not a multiple of 8, copied first in float32
])
def test_a_heavy_op_over_a_take_reads_it_in_place_bitwise(
        launches: Counts, shape: tuple[int, int], cut: tuple[int, int], dtype: Any) -> None:
    """Every heavy one-operand expression over a split's piece (a pending take) is one launch
    of its kernel reading the piece in place, with the lanes, and so the bits, of the copy and
    the plain kernel (inf, NaN, -0.0 and large values among the inputs)."""
    rng = np.random.default_rng(15)
    x0 = (rng.standard_normal(shape) * 3).astype(dtype)
    x0.flat[:5] = [np.inf, -np.inf, np.nan, -0.0, 80.0]
    lo, hi = cut
    src = tg.AnyTensor.from_numpy(x0)
    device = src.device
    for name in HEAVY_UNARY:
        expr = _EXPRESSIONS[name]
        take = _fusion.pending_view("take", src, (shape[0], hi - lo), hi - lo, shape[1], lo)
        assert take is not None
        launches.clear()
        got = _fusion._now(expr, [take], take.shape, take.dtype, device).numpy()
        in_place = (hi - lo) % 8 == 0 or dtype == np.float64
        assert launches == ({f"{name}__v": 1} if in_place else
                            {f"{name}__b": 1, "gather4_" + str(x0.itemsize): 1}), name
        piece = tg.AnyTensor.from_numpy(np.ascontiguousarray(x0[:, lo:hi]))
        want = tg.AnyTensor.from_numpy(np.zeros((shape[0], hi - lo), dtype))
        _kernels.run_expression(expr, [piece], want)
        assert got.tobytes() == want.numpy().tobytes(), name


@pytest.mark.parametrize(("shape", "axes"), [
    ((4, 6, 2, 8), (0, 2, 1, 3)),   # heads of a split's piece: (B, T, H, d) -> (B, H, T, d)
    ((4, 6, 16), (0, 2, 1)),
    ((24, 16), (1, 0)),
])
def test_a_gather_over_a_take_reads_its_source_with_the_copy_kernels(
        launches: Counts, shape: tuple[int, ...], axes: tuple[int, ...]) -> None:
    """A strided gather of a split's piece (a pending take) whose positions compose with the
    take's rows is one copy kernel over the piece's source, not a fused kernel evaluating the
    take at each position."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((24, 3 * 16)).astype(np.float32)
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, (_, k, _) = tg.split(tape, xi, 3, axis=1)
    tape, r = tg.reshape(tape, k, shape)
    launches.clear()
    tape, t = tg.transpose(tape, r, axes)
    got = tg.value(tape, t).numpy()
    np.testing.assert_array_equal(got, x[:, 16:32].reshape(shape).transpose(axes))
    assert launches == {"gather4_4": 1}, launches


def test_a_gather_composes_with_a_take_only_by_whole_rows_or_inside_one() -> None:
    # rows of w = 16 placed 48 apart from 16: (B, H, T, d) over (B, T, H, d) steps whole rows
    # (96, 16) or stays in one (8, 1); a dim of step 8 over 6 entries would cross rows.
    assert _fusion._through_take((4, 2, 6, 8), (96, 8, 16, 1), 0, 16, 48, 16) == (
        [288, 8, 48, 1], 16)
    assert _fusion._through_take((2, 8), (16, 1), 8, 16, 48, 16) == ([48, 1], 24)
    assert _fusion._through_take((6, 8), (8, 1), 0, 16, 48, 16) is None
    assert _fusion._through_take((2, 8), (16, 1), 9, 16, 48, 16) is None  # 9 + 7 >= 16
    assert _fusion._through_take((8,), (-1,), 8, 16, 48, 16) is None


def test_two_structures_with_one_top_and_depth_both_replay(
        fuse_now: None, walks: list[int]) -> None:
    """Skeletons are kept by their top's expression and depth, several a key: two DAGs of
    different structures that share both (an LSTM's gate and cell-state gradients) replay
    alternately, where one skeleton a key had each evict the other and both walk each time."""
    rng = np.random.default_rng(17)
    x0, y0 = rng.standard_normal(300), rng.standard_normal(300)
    x, y = tg.AnyTensor.from_numpy(x0), tg.AnyTensor.from_numpy(y0)

    def one(kind: int) -> tuple[tg.AnyTensor, Any]:
        h, want = x, x0
        for k in range(9):  # depth 10 either way: 9 nodes and the top
            if kind and k % 3 == 0:
                h, want = _op("mul", h, y), want * y0
            else:
                h, want = _op("add", h, 0.5), want + 0.5
        return _op("add", h, y), want + y0

    for round_ in range(4):
        if round_ == 2:
            walks.clear()
        for kind in (0, 1):
            t, want = one(kind)
            np.testing.assert_allclose(t.numpy(), want, rtol=1e-12)
    assert walks == []


def _shifted_sums(levels: int) -> Any:
    """h = (h + pad(h[:-s])) * 0.5, `levels` times: each pad (a put) of a slice (a take) reads
    the h that the add reads too."""
    def loss(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        h = x
        for k in range(levels):
            s = 1 + k % 3
            tape, a = tg.slice(tape, h, np.s_[:-s])
            tape, b = tg.pad(tape, a, ((s, 0),))
            tape, h = tg.add(tape, h, b)
            tape, h = tg.mul(tape, h, 0.5)
        return tg.sum(tape, h)
    return loss


def test_a_node_read_through_views_and_directly_is_walked_once(walks: list[int]) -> None:
    """A node that a view's space reaches and another recipe reads too is cut out of the
    space (a buffer first): nested views over it walked it once per space, 2**levels nodes
    (a shifted sum's 18 levels took minutes). The walk grows linearly; values as fusion off."""
    x0 = np.random.default_rng(18).standard_normal(64)
    walked: list[int] = []
    values: list[bytes] = []
    for levels in (8, 16):
        for fuse in (0, 3):
            old = _fusion.set_fuse_after(fuse)
            try:
                walks.clear()
                value, grad = tg.value_and_grad(_shifted_sums(levels))(
                    tg.AnyTensor.from_numpy(x0))
                values.append(value.numpy().tobytes() + grad.numpy().tobytes())
            finally:
                _fusion.set_fuse_after(old)
        walked.append(sum(walks))
        assert values[-1] == values[-2]
    assert walked[1] < 3 * walked[0], walked


def test_a_sum_of_puts_read_elsewhere_keeps_its_path_under_a_short_one(
        launches: Counts) -> None:
    """Twelve puts summed (`low`, read by another op too) and three more on top: the top's
    chain stops at `low` and has too few puts; `low`, realised first, is still added in place
    (add_puts), not tested put by put at every element. The values numpy's."""
    rng = np.random.default_rng(14)
    shape = (4, 15, 3)
    parts0 = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(15)]
    puts: list[tg.AnyTensor] = []
    want = np.zeros(shape, np.float32)
    for t, part0 in enumerate(parts0):
        put = _fusion.pending_view("put", tg.AnyTensor.from_numpy(part0), shape, 3, 45, 3 * t)
        assert put is not None
        puts.append(put)
        want[:, t] = part0
    low = puts[0]
    for put in puts[1:12]:
        low = _op("add", low, put)
    other = _op("mul", low, 3.0)
    top = low
    for put in puts[12:]:
        top = _op("add", top, put)
    launches.clear()
    np.testing.assert_array_equal(_op("mul", top, 1.0).numpy(), want)
    assert launches["add_puts8"] == 1 and launches["add_puts4"] == 1, launches
    low0 = want.copy()
    low0[:, 12:] = 0
    np.testing.assert_array_equal(other.numpy(), low0 * 3)
