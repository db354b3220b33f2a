"""Shape and indexing ops beyond the op table: determinism of take's gradient, stop_gradient,
errors and their messages, zero-size tensors, no-copy views and the kernel cache."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest

import tapegrad as tg
from cases import on_launch, warm_up
from tapegrad import _fusion
from tapegrad._ops import indexing

Array = np.ndarray[Any, Any]


def _take_grad(x: Array, idx: Array, axis: int, seed: Array) -> Array:
    tape, a = tg.leaf(tg.Tape(), x, requires_grad=True)
    tape, i = tg.leaf(tape, idx)
    tape, y = tg.take(tape, a, i, axis=axis)
    return tg.backward(tape, y, seed=seed)[a].numpy()


PATHS = ("scan", "rows", "sorted", "runs", "firsts")


def _path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make take_grad take one of its kernels whatever the sizes: "scan", "rows" (the row
    scan), "sorted" (a work-item per row after the sort), or zeros and then a work-item per
    index position: "runs" (after the sort) or "firsts" (no sort)."""
    def scan(outputs: int, j: int) -> bool:
        return path == "scan"

    def rows(items: int, j: int) -> bool:
        return path == "rows"

    def sparse(rows: int, j: int) -> bool:
        return path in ("runs", "firsts")

    monkeypatch.setattr(indexing, "scan_wins", scan)
    monkeypatch.setattr(indexing, "rowscan_wins", rows)
    monkeypatch.setattr(indexing, "sparse_wins", sparse)
    monkeypatch.setattr(indexing, "FIRSTS_LIMIT", 1 << 62 if path == "firsts" else 0)


def _add_at(shape: tuple[int, ...], idx: Array, axis: int, g: Array) -> Array:
    """numpy's scatter-add reference of take's VJP, in float64."""
    out = np.zeros(shape, np.float64)
    moved = np.moveaxis(out, axis, 0)  # a view: adding into it fills `out`
    gm = np.moveaxis(g.astype(np.float64), list(range(axis, axis + idx.ndim)),
                     list(range(idx.ndim)))
    np.add.at(moved, idx % shape[axis], gm)
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_take_gradient_is_bitwise_deterministic(
    monkeypatch: pytest.MonkeyPatch, path: str, dtype: Any
) -> None:
    """Many repeated indices: the gradient is bitwise the same on every run, and right."""
    _path(monkeypatch, path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, 5)).astype(dtype)
    idx = rng.integers(0, 3, size=(40, 25))  # 1000 indices into 3 rows: heavy repetition
    seed = (rng.standard_normal((3, 40, 25, 5)) * 1e3).astype(dtype)
    first = _take_grad(x, idx, 1, seed)
    for _ in range(3):
        again = _take_grad(x, idx, 1, seed)
        assert np.array_equal(first.view(np.uint8), again.view(np.uint8))
    want = _add_at(x.shape, idx, 1, seed)
    tol = 1e-3 if dtype == np.float32 else 1e-9
    np.testing.assert_allclose(first, want, rtol=tol, atol=tol * 1e3)
    assert np.all(first[:, 3:] == 0)


def test_scan_rows_and_sorted_paths_agree_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The three kernels add the matching positions in ascending order, so they agree
    exactly, including at sizes that are not powers of two, with negative and wrapped indices,
    and rows of more than one chunk (300 columns)."""
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 17, 64, 333):
        for width in (4, 300):
            x = rng.standard_normal((6, width)).astype(np.float32)
            idx = rng.integers(-6, 6, size=(n,)).astype(np.int32 if n % 2 else np.int64)
            seed = rng.standard_normal((n, width)).astype(np.float32)
            got: dict[str, bytes] = {}
            for path in PATHS:
                _path(monkeypatch, path)
                got[path] = _take_grad(x, idx, 0, seed).tobytes()
                monkeypatch.undo()
            assert len(set(got.values())) == 1, (n, width)
            grad = np.frombuffer(got["scan"], np.float32).reshape(x.shape)
            np.testing.assert_allclose(grad, _add_at(x.shape, idx, 0, seed), rtol=1e-5,
                                       atol=1e-5)


@pytest.mark.parametrize(("shape", "axis", "n"), [
    ((70000,), 0, 3000),  # rows past 2^16: three radix passes
    ((2, 300, 300), 1, 700),  # rows of 300 elements (two chunks), two blocks before the axis
    ((3, 5, 2), 2, 1),  # one index, short rows
], ids=["3-passes", "long-rows", "one-index"])
def test_sorted_path_matches_the_scan_across_radix_passes_and_chunks(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], axis: int, n: int
) -> None:
    """The radix sort's passes and the per-chunk rows give the scan's sums bitwise; the
    forward gathers across row and block boundaries as numpy's take."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)
    k = shape[axis]
    idx = rng.integers(-k, k, size=n)
    idx[: n // 3] = idx[0]  # a long run of one row
    seed = rng.standard_normal((*shape[:axis], n, *shape[axis + 1:])).astype(np.float32)
    tape, a = tg.leaf(tg.Tape(), x)
    tape, i = tg.leaf(tape, idx)
    tape, y = tg.take(tape, a, i, axis=axis)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), np.take(x, idx, axis=axis))
    _path(monkeypatch, "scan")
    scan = _take_grad(x, idx, axis, seed)
    _path(monkeypatch, "rows")
    rows = _take_grad(x, idx, axis, seed)
    _path(monkeypatch, "sorted")
    sort = _take_grad(x, idx, axis, seed)
    _path(monkeypatch, "runs")
    runs = _take_grad(x, idx, axis, seed)
    assert scan.tobytes() == rows.tobytes() == sort.tobytes() == runs.tobytes()
    np.testing.assert_allclose(sort, _add_at(shape, idx, axis, seed), rtol=1e-5, atol=1e-5)


def test_few_rows_from_many_indices_take_the_scan() -> None:
    """The scan visits every (gradient element, index) pair; the sort costs a few passes over
    the indices and ~10 launches: the scan is kept for few pairs or a handful of rows."""
    assert indexing.scan_wins(8, 10**6) and not indexing.scan_wins(64, 10**6)
    assert not indexing.scan_wins(1000, 10**5) and not indexing.scan_wins(10**4, 10**4)
    assert indexing.scan_wins(10**4, 10)  # few pairs: no sort's launches
    rng = np.random.default_rng(5)
    j = 200000
    assert 8 * j > indexing.SCAN_LIMIT  # the scan by its rows, not by the pair count
    idx = rng.integers(-8, 8, size=j)
    seed = rng.standard_normal(j).astype(np.float32)
    got = _take_grad(np.zeros(8, np.float32), idx, 0, seed)
    np.testing.assert_allclose(got, _add_at((8,), idx, 0, seed), rtol=1e-4, atol=1e-3)


def test_embedding_gradient_at_a_size_that_takes_the_sorted_path() -> None:
    rng = np.random.default_rng(2)
    table = rng.standard_normal((3000, 16))
    idx = rng.integers(0, 3000, size=(32, 16))
    assert not indexing.scan_wins(table.size, idx.size)
    assert not indexing.rowscan_wins(3000, idx.size)  # a row (one chunk) per work-item
    tape, w = tg.leaf(tg.Tape(), table, requires_grad=True)
    tape, i = tg.leaf(tape, idx)
    tape, e = tg.embedding(tape, w, i)
    np.testing.assert_array_equal(tg.value(tape, e).numpy(), table[idx])
    seed = rng.standard_normal((32, 16, 16))
    g1 = tg.backward(tape, e, seed=seed)[w].numpy()
    g2 = tg.backward(tape, e, seed=seed)[w].numpy()
    assert np.array_equal(g1.view(np.uint8), g2.view(np.uint8))
    np.testing.assert_allclose(g1, _add_at(table.shape, idx, 0, seed), rtol=1e-12, atol=1e-12)


def test_take_out_of_range_indices_raise_if_from_the_host_else_wrap() -> None:
    """Indices made from a numpy array are checked before anything runs, as numpy checks
    them; indices computed on the device are not read back, and wrap modulo n (numpy's
    mode='wrap'): a documented choice."""
    x = np.arange(12.0).reshape(3, 4)
    idx = np.array([3, -4, 7, -1], np.int64)
    tape, a = tg.leaf(tg.Tape(), x, requires_grad=True)
    tape, host = tg.leaf(tape, idx)
    with pytest.raises(IndexError, match=r"take: index -4 is out of bounds for axis 0 with "
                                         r"size 3 \(indices must lie in \[-3, 3\)\)"):
        tg.take(tape, a, host, axis=0)
    with pytest.raises(tg.ShapeError, match="embedding: index -4 is out of bounds"):
        tg.embedding(tape, a, host)
    tape, f = tg.leaf(tape, idx.astype(np.float64))
    tape, i = tg.astype(tape, f, np.int64)  # computed on the device: its range is unknown
    tape, y = tg.take(tape, a, i, axis=0)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), np.take(x, idx, 0, mode="wrap"))
    tape, s = tg.sum(tape, y)
    np.testing.assert_array_equal(tg.backward(tape, s)[a].numpy(),
                                  np.array([[1.0] * 4, [1.0] * 4, [2.0] * 4]))


def test_host_indices_moved_by_shape_ops_are_still_checked() -> None:
    """A reshape, squeeze, transpose, broadcast, concat, stack or integer cast of host indices
    holds exactly their values, so their range still refuses bad ones (they wrapped); a slice
    holds a subset whose range is unknown, so it is not checked (a wider range could refuse
    valid indices)."""
    x = np.arange(3.0)
    tape, a = tg.leaf(tg.Tape(), x, requires_grad=True)
    tape, bad = tg.leaf(tape, np.array([[5, -4]]))
    tape, good = tg.leaf(tape, np.array([[2, -3]]))
    tape, none = tg.leaf(tape, np.zeros((0, 2), np.int64))  # no range: an empty part
    moves: list[tuple[str, Callable[[tg.Tape, tg.Id], tuple[tg.Tape, tg.Id]]]] = [
        ("reshape", lambda t, i: tg.reshape(t, i, (2,))),
        ("squeeze", lambda t, i: tg.squeeze(t, i, 0)),
        ("transpose", lambda t, i: tg.transpose(t, i)),
        ("broadcast_to", lambda t, i: tg.broadcast_to(t, i, (3, 2))),
        ("concat", lambda t, i: tg.concat(t, [i, none, i], axis=0)),
        ("stack", lambda t, i: tg.stack(t, [i, i])),
        ("astype", lambda t, i: tg.astype(t, i, np.int32)),
    ]
    for name, move in moves:
        t, moved = move(tape, bad)
        with pytest.raises(IndexError, match="take: index -4 is out of bounds"):
            tg.take(t, a, moved)
        t, labels = tg.reshape(t, moved, (-1,))
        t, logits = tg.leaf(t, np.zeros((labels.shape[0], 3)))
        with pytest.raises(tg.ShapeError, match="cross_entropy: label -4 is out of"):
            tg.cross_entropy(t, logits, labels)
        t, moved = move(tape, good)
        t, y = tg.take(t, a, moved)
        want = np.take(x, tg.value(t, moved).numpy())
        np.testing.assert_array_equal(tg.value(t, y).numpy(), want, err_msg=name)
    tape, part = tg.slice(tape, bad, np.s_[:, :1])  # [[5]]: unknown range, wraps to x[2]
    tape, y = tg.take(tape, a, part)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), [[2.0]])


def test_a_pending_broadcast_of_host_indices_keeps_their_range_when_reshaped() -> None:
    # One index broadcast is pending (fused kernels read it in place), and so is its reshape:
    # the range must follow the pending value too (it was dropped, and the index wrapped).
    tape, a = tg.leaf(tg.Tape(), np.arange(3.0))
    for index, ok in ((5, False), (-2, True)):
        tape, i = tg.leaf(tape, np.array([[index]]))
        tape, b = tg.broadcast_to(tape, i, (1, 4))
        tape, r = tg.reshape(tape, b, (4,))
        assert tape[r].value.pending is not None
        if ok:
            tape, y = tg.take(tape, a, r)
            np.testing.assert_array_equal(tg.value(tape, y).numpy(), [1.0] * 4)
        else:
            with pytest.raises(IndexError, match="take: index 5 is out of bounds"):
                tg.take(tape, a, r)


def test_take_of_integer_values_and_flat_axis() -> None:
    x = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    tape, a = tg.leaf(tg.Tape(), x)
    tape, i = tg.leaf(tape, np.array([[23, 0], [-1, 5]], np.int32))
    tape, y = tg.take(tape, a, i, axis=None)
    got = tg.value(tape, y).numpy()
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.take(x, np.array([[23, 0], [-1, 5]])))


# --- stop_gradient ----------------------------------------------------------------------------


def test_stop_gradient_passes_nothing() -> None:
    x = np.array([1.0, -2.0, 3.0])
    tape, a = tg.leaf(tg.Tape(), x, requires_grad=True)
    tape, c = tg.stop_gradient(tape, a)
    node = tape[c]
    assert node.op == "stop_gradient" and not node.requires_grad
    assert node.prim is not None and node.prim.vjp is None
    assert node.value.buffer is tape[a].value.buffer  # no copy
    tape, y = tg.mul(tape, a, c)  # d/da (a * const) = const, not 2a
    tape, loss = tg.sum(tape, y)
    np.testing.assert_array_equal(tg.value(tape, loss).numpy(), np.sum(x * x))
    np.testing.assert_array_equal(tg.backward(tape, loss)[a].numpy(), x)
    # Only through the stop: explicit wrt gets zeros; the default finds no leaf to reach.
    tape, only = tg.sum(tape, c)
    np.testing.assert_array_equal(tg.backward(tape, only, wrt=[a])[a].numpy(), np.zeros(3))
    assert dict(tg.backward(tape, only)) == {}
    # Recorded (second-order) sweeps stop there too.
    tape, grads = tg.backward_on_tape(tape, loss, [a])
    np.testing.assert_array_equal(tg.value(tape, grads[a]).numpy(), x)


# --- no copies, zero sizes, kernel cache ------------------------------------------------------


def test_free_views_share_the_buffer() -> None:
    tape, a = tg.leaf(tg.Tape(), np.ones((1, 3, 1), np.float32))
    buf = tape[a].value.buffer
    views = [tg.expand_dims(tape, a, (0, -1)), tg.squeeze(tape, a), tg.squeeze(tape, a, -1),
             tg.slice(tape, a, np.s_[0, ..., None])]
    for t, y in views:
        assert t[y].op == "reshape" and t[y].value.buffer is buf
    tape2, same = tg.slice(tape, a, np.s_[...])
    assert same == a and len(tape2) == len(tape)


def test_zero_size_tensors() -> None:
    tape, a = tg.leaf(tg.Tape(), np.zeros((0, 3)), requires_grad=True)
    tape, b = tg.leaf(tape, np.ones((2, 3)), requires_grad=True)
    tape, c = tg.concat(tape, [a, b], axis=0)
    tape, s = tg.slice(tape, a, np.s_[::-1, 1:])
    assert s.shape == (0, 2)
    tape, p = tg.pad(tape, a, ((1, 1), (0, 0)))
    np.testing.assert_array_equal(tg.value(tape, p).numpy(), np.zeros((2, 3)))
    tape, st = tg.stack(tape, [a, a], axis=1)
    assert st.shape == (0, 2, 3)
    tape, i = tg.leaf(tape, np.zeros((0,), np.int64))
    tape, t0 = tg.take(tape, b, i, axis=1)
    assert t0.shape == (2, 0)
    tape, i2 = tg.leaf(tape, np.array([1, 1], np.int64))
    tape, t1 = tg.take(tape, a, i2, axis=1)
    assert t1.shape == (0, 2)
    total = tape
    ids = [c, s, p, st, t0, t1]
    parts: list[tg.Id] = []
    for y in ids:
        total, r = tg.sum(total, y)
        parts.append(r)
    loss = parts[0]
    for r in parts[1:]:
        total, loss = tg.add(total, loss, r)
    grads = tg.backward(total, loss)
    assert grads[a].numpy().shape == (0, 3)
    np.testing.assert_array_equal(grads[b].numpy(), np.ones((2, 3)))  # t0 gives b nothing


def test_a_small_vocabularys_embedding_gradient_is_one_row_scan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A character model's embedding (76 x 64, 512 tokens): too many pairs for the scan, few
    enough rows for the row scan: one launch, where the sort took ~10, with the same bits."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((76, 64)).astype(np.float32)
    idx = rng.integers(0, 76, size=(16, 32))
    seed = rng.standard_normal((16, 32, 64)).astype(np.float32)
    assert not indexing.scan_wins(table.size, idx.size)
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    got = _take_grad(table, idx, 0, seed)
    monkeypatch.undo()
    assert [n for n in names if n.startswith("take")] == ["take_fwd", "take_grad_rowscan"]
    _path(monkeypatch, "sorted")
    assert _take_grad(table, idx, 0, seed).tobytes() == got.tobytes()


def test_new_sizes_build_no_programs() -> None:
    device = tg.default_device()

    def step(n: int, path: str) -> None:
        with pytest.MonkeyPatch.context() as patch:
            _path(patch, path)
            rng = np.random.default_rng(n)
            tape, x = tg.leaf(tg.Tape(), rng.standard_normal((n, 3)).astype(np.float32),
                              requires_grad=True)
            tape, i = tg.leaf(tape, rng.integers(0, n, size=(n + 1,)))
            tape, y = tg.take(tape, x, i)
            tape, y = tg.slice(tape, y, np.s_[::-2, 1:])
            tape, y = tg.pad(tape, y, ((1, 0), (0, 1)))
            tape, y = tg.concat(tape, [y, y], axis=1)
            tape, loss = tg.sum(tape, y)
            tg.backward(tape, loss)[x].numpy()

    paths = ("scan", "rows", "sorted")
    warm_up(device, lambda: [step(4, path) for path in paths])
    before = device.builds
    for n in (5, 9, 100):
        for path in paths:
            step(n, path)
    assert device.builds == before


def _numpy_ints(index: object) -> Any:
    """`index` with its ints as numpy ints: the same view, parsed at every call (not kept)."""
    def one(item: object) -> object:
        if type(item) is int:
            return np.int64(item)
        if isinstance(item, slice):
            part = cast("slice[int | None, int | None, int | None]", item)
            bounds = (part.start, part.stop, part.step)
            return slice(*(None if v is None else np.int64(v) for v in bounds))
        return item
    if isinstance(index, tuple):
        return tuple(one(item) for item in cast(tuple[object, ...], index))
    return one(index)


@pytest.mark.parametrize(("shape", "index", "op"), [
    ((5, 3, 2), 3, "slice"), ((5, 3, 2), -1, "slice"), ((1, 4), 0, "reshape"), ((6,), 2, "slice"),
    ((4, 5, 3), np.s_[:, 2], "slice"), ((4, 5, 3), np.s_[:, -1, ::2], "slice"),
    ((4, 5, 3), np.s_[1:, ..., None], "slice"), ((4, 5), np.s_[::-1, 1:4:2], "slice"),
    ((4, 5), np.s_[..., None], "reshape"), ((1, 4), np.s_[0, :], "reshape"),
])
def test_a_row_recorded_again_is_the_same_node(shape: tuple[int, ...], index: Any,
                                               op: str) -> None:
    """x[t] and x[:, t] again (their views kept per shape and index after the first) record
    the node the first call recorded, and the one an index of numpy ints (parsed at each call)
    records: op, params, parents, gradient flag, call site, value; a view that keeps every
    element in order stays a reshape."""
    x0 = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
    recorded: list[tuple[object, ...]] = []
    for at in (index, index, index, _numpy_ints(index)):
        t, row = tg.slice(tape, x, at)
        node = t[row]
        recorded.append((node.op, node.params, node.parents, node.requires_grad,
                         node.location, row.shape))
        np.testing.assert_array_equal(tg.value(t, row).numpy(), x0[index])
    assert recorded[0] == recorded[1] == recorded[2] == recorded[3]
    assert recorded[0][0] == op and recorded[0][3]
    # the same params object again: a kept view (a reshape's too, see the test below)
    assert recorded[1][1] is recorded[2][1]


@pytest.mark.parametrize(("shape", "wanted"), [
    ((2, 3, 4), (6, 4)), ((2, 3, 4), (-1, 4)), ((2, 3, 4), (2, 12)), ((6,), (1, 6, 1)),
    ((0, 3), (3, 0)), ((2, 3), (2, 3)),
])
def test_a_reshape_kept_per_shape_records_what_the_general_path_records(
        shape: tuple[int, ...], wanted: tuple[int, ...]) -> None:
    """A reshape to a tuple of ints takes its (params, aval) kept per shape; a list takes the
    general path. Both record the same node (op, params, parents, gradient flag, call site,
    values), and a reshape to x's own shape records none."""
    x0 = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
    nodes: list[tuple[object, ...]] = []
    for target in (wanted, list(wanted), wanted):
        t, y = tg.reshape(tape, x, target)
        np.testing.assert_array_equal(tg.value(t, y).numpy(), x0.reshape(wanted))
        if y == x:
            assert len(t) == len(tape)
            continue
        node = t[y]
        nodes.append((node.op, node.params, node.parents, node.requires_grad,
                      node.location, y.shape))
    assert all(n == nodes[0] for n in nodes)
    assert (not nodes) == (x0.reshape(wanted).shape == shape)
    assert all(str(n[4]).find("test_ops_shape.py") >= 0 for n in nodes)  # the user's line


@pytest.mark.parametrize(("shape", "axes"), [
    ((2, 3, 4), (0, 2, 1)), ((2, 3, 4), (-1, 0, 1)), ((2, 3, 4), None), ((2, 3), (0, 1)),
    ((2, 1, 3, 4), (0, 2, 1, 3)),
])
def test_a_transpose_kept_per_shape_records_what_the_general_path_records(
        shape: tuple[int, ...], axes: tuple[int, ...] | None) -> None:
    """As the reshape above: a tuple of ints (or None) takes the kept permutation, a list the
    general path; the same node either way, none where the order is kept; bad axes still
    raise, with the user's line."""
    x0 = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
    nodes: list[tuple[object, ...]] = []
    for given in (axes, None if axes is None else list(axes), axes):
        t, y = tg.transpose(tape, x, given)
        np.testing.assert_array_equal(tg.value(t, y).numpy(), np.transpose(x0, axes))
        if y == x:
            continue
        node = t[y]
        nodes.append((node.op, node.params, node.parents, node.requires_grad, node.location))
    assert all(n == nodes[0] for n in nodes)
    assert (not nodes) == (axes is not None
                           and [a % len(shape) for a in axes] == list(range(len(shape))))
    with pytest.raises(tg.ShapeError, match="not a permutation") as err:
        tg.transpose(tape, x, (0,) * len(shape))
    assert "test_ops_shape.py" in str(err.value)


# --- errors -------------------------------------------------------------------------------------


def _tape() -> tuple[tg.Tape, tg.Id, tg.Id]:
    tape, a = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
    tape, b = tg.leaf(tape, np.ones((4, 3), np.float64))
    return tape, a, b


def test_slice_errors() -> None:
    tape, a, _ = _tape()
    with pytest.raises(tg.ShapeError,
                       match=r"slice: index 3 is out of bounds for axis 1 with size 3"):
        tg.slice(tape, a, np.s_[:, 3])
    with pytest.raises(tg.ShapeError, match=r"index -3 is out of bounds for axis 0 with size 2"):
        tg.slice(tape, a, -3)
    with pytest.raises(tg.ShapeError, match=r"too many indices.*\(2, 3\).*3 were indexed"):
        tg.slice(tape, a, np.s_[0, 0, 0])
    with pytest.raises(tg.ShapeError, match="only one ellipsis"):
        tg.slice(tape, a, np.s_[..., ...])
    with pytest.raises(tg.TapegradError, match=r"advanced .*tg\.take"):
        tg.slice(tape, a, np.array([0, 1]))
    with pytest.raises(tg.TapegradError, match=r"list is advanced .*tg\.take"):
        tg.slice(tape, a, ([0, 1], 0))  # type: ignore[arg-type]
    with pytest.raises(tg.TapegradError, match=r"Id is advanced .*tg\.take"):
        tg.slice(tape, a, a)  # type: ignore[arg-type]
    with pytest.raises(tg.TapegradError, match=r"bool is advanced"):
        tg.slice(tape, a, True)
    with pytest.raises(tg.TapegradError, match="slice step cannot be zero"):
        tg.slice(tape, a, np.s_[::0])
    with pytest.raises(tg.TapegradError, match="'a' of type str"):
        tg.slice(tape, a, "a")  # type: ignore[arg-type]
    assert len(tape) == 2


def test_expand_dims_and_squeeze_errors() -> None:
    tape, a, _ = _tape()
    with pytest.raises(tg.ShapeError, match=r"expand_dims: axis 3 is out of range .*rank 3"):
        tg.expand_dims(tape, a, 3)
    with pytest.raises(tg.ShapeError, match="repeats an axis"):
        tg.expand_dims(tape, a, (0, -4))
    with pytest.raises(tg.ShapeError,
                       match=r"squeeze: axis 1 of x \(shape \(2, 3\)\) has size 3"):
        tg.squeeze(tape, a, 1)
    assert len(tape) == 2


def test_concat_and_stack_errors() -> None:
    tape, a, b = _tape()
    tape, c = tg.leaf(tape, np.ones((4, 2), np.float32))
    with pytest.raises(tg.DTypeError, match="operand 1 has dtype float64 but operand 0 has "
                                            "float32"):
        tg.concat(tape, [a, b])
    with pytest.raises(tg.ShapeError, match=r"concat: operand 2 has shape \(4, 2\).*axis 1 has "
                                            r"size 2, expected 3.*concat axis 0"):
        tg.concat(tape, [a, a, c], axis=0)
    with pytest.raises(tg.ShapeError, match=r"axis 0 has size 4, expected 2"):
        tg.concat(tape, [a, c], axis=-1)
    with pytest.raises(tg.ShapeError, match="concat: axis 2 is out of range"):
        tg.concat(tape, [a, a], axis=2)
    with pytest.raises(tg.ShapeError, match="empty list"):
        tg.concat(tape, [])
    with pytest.raises(tg.TapegradError, match="takes a list of ids"):
        tg.concat(tape, a)  # type: ignore[arg-type]
    tape, s = tg.leaf(tape, np.float32(1.0))
    with pytest.raises(tg.ShapeError, match="rank-0 tensors cannot be concatenated"):
        tg.concat(tape, [s, s])
    with pytest.raises(tg.ShapeError, match=r"stack: operand 1 has shape \(4, 2\).*axis 0 has "
                                            "size 4, expected 2"):
        tg.stack(tape, [a, c])
    with pytest.raises(tg.ShapeError, match="stack: axis 3 is out of range"):
        tg.stack(tape, [a, a], axis=3)
    with pytest.raises(tg.ShapeError, match="concat: axis must be an int, got '0'"):
        tg.concat(tape, [a, a], axis="0")  # type: ignore[arg-type]
    n = len(tape)
    with pytest.raises(tg.ShapeError):
        tg.stack(tape, [a, a, c])
    assert len(tape) == n


def test_pad_errors() -> None:
    tape, a, _ = _tape()
    with pytest.raises(tg.ShapeError, match="negative width"):
        tg.pad(tape, a, ((1, -1), (0, 0)))
    with pytest.raises(tg.ShapeError, match=r"not one \(before, after\) pair .*2 axes"):
        tg.pad(tape, a, ((1, 1), (0, 0), (2, 2)))
    with pytest.raises(tg.ShapeError, match="pad_width"):
        tg.pad(tape, a, "wide")  # type: ignore[arg-type]


def test_take_errors() -> None:
    tape, a, _ = _tape()
    tape, f = tg.leaf(tape, np.zeros(2, np.float32))
    tape, i = tg.leaf(tape, np.zeros(2, np.int64))
    with pytest.raises(tg.DTypeError, match="take: indices has dtype float32, expected int32 or "
                                            "int64"):
        tg.take(tape, a, f)
    with pytest.raises(tg.TapegradError, match="indices must be an integer Id, not ndarray"):
        tg.take(tape, a, np.zeros(2, np.int64))  # type: ignore[arg-type]
    with pytest.raises(tg.ShapeError, match="take: axis 2 is out of range"):
        tg.take(tape, a, i, axis=2)
    with pytest.raises(tg.ShapeError, match=r"take: axis must be an int, got 1\.0"):
        tg.take(tape, a, i, axis=1.0)  # type: ignore[arg-type]
    tape, empty = tg.leaf(tape, np.zeros((2, 0), np.float32))
    with pytest.raises(tg.ShapeError, match=r"cannot take 2 elements from axis 1 .* empty"):
        tg.take(tape, empty, i, axis=1)
    tape, s = tg.leaf(tape, np.float32(1.0))
    with pytest.raises(tg.ShapeError, match="embedding: table has shape"):
        tg.embedding(tape, s, i)
    n = len(tape)
    with pytest.raises(tg.ShapeError):
        tg.take(tape, empty, i, axis=None)
    assert len(tape) == n


@pytest.mark.parametrize(("shape", "axis", "cuts"), [
    ((16, 256), 1, 4),             # an LSTM's gates: pieces along the last axis
    ((3, 6, 5), 1, [2, 2, 5]),     # a middle axis, an empty piece
    ((300, 7), 0, [100, 250]),     # the first axis, rows longer than a work-item's chunk
])
@pytest.mark.parametrize("fuse", [0, 3])
def test_a_split_pieces_gradient_is_one_launch_each(
        monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], axis: int,
        cuts: int | list[int], fuse: int) -> None:
    """The transpose of a slice along one axis (slice_grad) writes its zeros and its block in
    one kernel, where a fill and a scatter were two; with fusion on, it is a pending put that
    the sum of the pieces' VJPs reads in place once its kernel is built, and no piece is
    written. Values as numpy's."""
    old = _fusion.set_fuse_after(fuse)
    names: list[str] = []
    try:
        for _ in range(3):  # fusion's kernel is built at the third sighting
            names = _split_grad_launches(monkeypatch, shape, axis, cuts)
    finally:
        _fusion.set_fuse_after(old)
    pieces = [ix.size for ix in np.split(np.arange(shape[axis]), cuts)]
    assert "scatter4_8" not in names and "fill8" not in names
    # With fusion on, an empty piece's VJP (zeros, not a view of anything) is the only embed.
    assert names.count("embed8") == (pieces.count(0) if fuse else len(pieces))


def _split_grad_launches(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], axis: int,
                         cuts: int | list[int]) -> list[str]:
    rng = np.random.default_rng(4)
    x0 = rng.standard_normal(shape)
    tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
    tape, pieces = tg.split(tape, x, cuts, axis=axis)
    weights = [rng.standard_normal(tape[p].value.shape) for p in pieces]
    total: tg.Id | None = None
    for p, w in zip(pieces, weights, strict=True):
        tape, wi = tg.leaf(tape, w)
        tape, term = tg.mul(tape, p, wi)
        tape, term = tg.sum(tape, term)
        tape, total = (tape, term) if total is None else tg.add(tape, total, term)
    assert total is not None
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    grad = tg.backward(tape, total)[x].numpy()
    np.testing.assert_array_equal(grad, np.concatenate(weights, axis=axis))
    return names


def test_the_gradient_of_a_pad_of_an_empty_tensor() -> None:
    """A pad that keeps a tensor empty (4x0 -> 6x0) and its gradient: empty results, no
    division by the empty axis."""
    def loss(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, p = tg.pad(tape, x, ((1, 1), (0, 0)))
        return tg.sum(tape, p)

    value, grad = tg.value_and_grad(loss)(tg.AnyTensor.from_numpy(np.zeros((4, 0), np.float32)))
    assert value.numpy() == 0.0 and grad.shape == (4, 0)


def test_a_flat_gather_of_few_labels_sums_into_zeros_without_a_work_item_per_row() -> None:
    """A log-probability (N * C) gathered flat at N labels: gx has far more rows than there
    are indices, so it is zeros and then a work-item per index position (sorted, or for few
    indices each finding its row's first position), repeats and negative indices included;
    the same bits as the per-row kernel."""
    rng = np.random.default_rng(11)
    for n in (40, 700):  # `firsts` (no sort), `runs` (after the sort)
        x = rng.standard_normal(50_000).astype(np.float32)
        idx = rng.integers(-50_000, 50_000, size=n)
        idx[: n // 4] = idx[0]
        seed = rng.standard_normal(n).astype(np.float32)
        assert indexing.sparse_wins(x.size, n)
        assert (n * n <= indexing.FIRSTS_LIMIT) == (n == 40)
        got = _take_grad(x, idx, 0, seed)
        np.testing.assert_allclose(got, _add_at(x.shape, idx, 0, seed), rtol=1e-6, atol=1e-6)
        assert np.count_nonzero(got) <= n
        with pytest.MonkeyPatch.context() as patch:
            _path(patch, "sorted")
            assert _take_grad(x, idx, 0, seed).tobytes() == got.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.bool_])
def test_concat_writes_up_to_eight_parts_a_launch(
        monkeypatch: pytest.MonkeyPatch, dtype: Any) -> None:
    """concat (and stack) writes its parts side by side, up to CONCAT_PARTS a launch: 17 parts
    of unequal widths, empty ones among them (skipped), at every axis, each element size."""
    rng = np.random.default_rng(12)
    widths = [3, 0, 1, 5, 2, 2, 0, 4, 1, 1, 3, 2, 6, 1, 1, 2, 3]
    for axis in range(3):
        xs: list[Array] = []
        for w in widths:
            shape = [2, 3, 4]
            shape[axis] = w
            xs.append((rng.standard_normal(shape) * 100).astype(dtype))
        tape = tg.Tape()
        ids: list[tg.Id] = []
        for x in xs:
            tape, i = tg.leaf(tape, x)
            ids.append(i)
        names: list[str] = []
        with pytest.MonkeyPatch.context() as patch:
            on_launch(patch, names.append)
            tape, c = tg.concat(tape, ids, axis=axis)
            got = tg.value(tape, c).numpy()
        np.testing.assert_array_equal(got, np.concatenate(xs, axis=axis))
        size = np.dtype(dtype).itemsize
        assert names == [f"concat{n}_{size}" for n in (8, 7)], names
    tape, a = tg.leaf(tg.Tape(), np.ones((2, 3), dtype))
    tape, b = tg.leaf(tape, np.zeros((2, 3), dtype))
    tape, s = tg.stack(tape, [a, b, a], axis=2)
    np.testing.assert_array_equal(tg.value(tape, s).numpy(), np.stack(
        [np.ones((2, 3), dtype), np.zeros((2, 3), dtype), np.ones((2, 3), dtype)], axis=2))


@pytest.mark.parametrize("op", ["concat", "concat_neg", "stack", "stack_last", "expand_dims",
                                "expand_dims_neg", "squeeze"])
def test_a_public_shape_op_records_the_node_record_makes(op: str) -> None:
    """concat, stack, expand_dims and squeeze check their operands and record through their
    quick paths (`record_known`, a reshape kept per shape): the node is the one `record`
    makes from the same primitive and params (op, params, parents, gradient flag, aval,
    value), and a gradient flows through it."""
    from tapegrad._ops.shape import CONCAT, RESHAPE, ConcatParams, ReshapeParams
    from tapegrad._tape import record
    rng = np.random.default_rng(5)
    a0, b0 = rng.standard_normal((2, 1, 3)), rng.standard_normal((2, 1, 3))
    tape, a = tg.leaf(tg.Tape(), a0, requires_grad=True)
    tape, b = tg.leaf(tape, b0)
    made: dict[str, Callable[[], tuple[tg.Tape, tg.Id]]] = {
        "concat": lambda: tg.concat(tape, [a, b], axis=2),
        "concat_neg": lambda: tg.concat(tape, [a, b, a], axis=-3),
        "stack": lambda: tg.stack(tape, [a, b], axis=0),
        "stack_last": lambda: tg.stack(tape, [b, a], axis=-1),
        "expand_dims": lambda: tg.expand_dims(tape, a, 1),
        "expand_dims_neg": lambda: tg.expand_dims(tape, a, -1),
        "squeeze": lambda: tg.squeeze(tape, a, 1)}
    wanted = {"concat": (CONCAT, [a, b], ConcatParams(2)),
              "concat_neg": (CONCAT, [a, b, a], ConcatParams(0)),
              "stack": (CONCAT, [a, b], ConcatParams(0, True)),
              "stack_last": (CONCAT, [b, a], ConcatParams(3, True)),
              "expand_dims": (RESHAPE, [a], ReshapeParams((2, 1, 1, 3))),
              "expand_dims_neg": (RESHAPE, [a], ReshapeParams((2, 1, 3, 1))),
              "squeeze": (RESHAPE, [a], ReshapeParams((2, 3)))}
    quick, out = made[op]()
    prim, ids, params = wanted[op]
    general, same = record(tape, prim, ids, params)
    node, want = quick[out], general[same]
    assert (node.op, node.params, node.parents, node.requires_grad, out.shape, out.dtype) == (
        want.op, want.params, want.parents, want.requires_grad, same.shape, same.dtype)
    assert node.requires_grad and node.location[0] == __file__
    np.testing.assert_array_equal(tg.value(quick, out).numpy(), tg.value(general, same).numpy())
    t, s = tg.sum(quick, out)
    uses = 2 if op == "concat_neg" else 1
    np.testing.assert_array_equal(tg.backward(t, s, wrt=[a])[a].numpy(), np.full((2, 1, 3), uses))
