"""The matmul primitive's kernels, on every transpose combination and awkward sizes.

Which kernel runs depends on the product's size (one `mm_small` launch up to SMALL_PRODUCT
multiply-adds, tiles of 8 or 4 columns), the number of rows (packed panels from
`PACK_MIN_ROWS` on) and the operands' layout (panels read in place, dot products), and each
has full-tile and edge paths; sizes here are chosen to hit partial tiles in every dim,
several k chunks (`KC`) with a partial last one, and several row blocks per work-item.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from cases import on_launch
from tapegrad._ops import linalg
from tapegrad._ops.linalg import COLUMN_BIAS, MATMUL, NO_BIAS, ROW_BIAS, MatmulParams
from tapegrad._primitive import EagerEmitter

# Products of up to SMALL_PRODUCT multiply-adds are one mm_small launch whatever the flags; the
# larger ones reach each path of `linalg._product`: packed panels with C cut to n (64, 31, 48),
# few rows with in-place panels and an mm_small tail (13, 40, 200), (5, 17, 900), or an mm_dot
# tail with transposing copies (20, 47, 1000); many rows over a short k, read in place
# (300, 16, 20).
SIZES = [(1, 1, 1), (3, 5, 2), (4, 16, 8), (5, 17, 9), (7, 33, 15), (13, 40, 70), (300, 16, 7),
         (25, 5, 20), (64, 31, 48), (50, 37, 300), (97, 48, 129), (13, 40, 200), (5, 17, 900),
         (20, 47, 1000), (300, 16, 20)]


@pytest.mark.parametrize(("m", "n", "k"), SIZES)
@pytest.mark.parametrize(("ta", "tb"), list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [NO_BIAS, COLUMN_BIAS, ROW_BIAS])
def test_matmul_t_matches_numpy(m: int, n: int, k: int, ta: bool, tb: bool, dtype: Any,
                                bias: int) -> None:
    # The bias rides on every kernel (the tiles start from it, mm_dot adds it at the store),
    # through padded C and in-place tails alike.
    rng = np.random.default_rng(m * 100 + n + k)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
    args = [tg.AnyTensor.from_numpy(a), tg.AnyTensor.from_numpy(b)]
    want = (a.T if ta else a) @ (b.T if tb else b)
    if bias:
        c = rng.standard_normal(n if bias == COLUMN_BIAS else m).astype(dtype)
        args.append(tg.AnyTensor.from_numpy(c))
        want = want + (c if bias == COLUMN_BIAS else c[:, None])
    e = EagerEmitter(tg.default_device())
    out = e.apply(MATMUL, args, MatmulParams(ta, tb, bias)).numpy()
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * k)


@pytest.mark.parametrize(("ta", "tb"), list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize(("m", "n", "k"), [(5, 18, 9), (40, 18, 9), (40, 32, 70), (30, 18, 130)])
def test_batched_matmul_t(ta: bool, tb: bool, m: int, n: int, k: int) -> None:
    # (40, 32, 70): full panels of every batch packed by the 8-wide copies, partial k block
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, k, m) if ta else (3, m, k))
    b = rng.standard_normal((3, n, k) if tb else (3, k, n))
    e = EagerEmitter(tg.default_device())
    out = e.apply(MATMUL, [tg.AnyTensor.from_numpy(a), tg.AnyTensor.from_numpy(b)],
                  MatmulParams(ta, tb)).numpy()
    want = (a.transpose(0, 2, 1) if ta else a) @ (b.transpose(0, 2, 1) if tb else b)
    np.testing.assert_allclose(out, want, rtol=1e-12)


@pytest.mark.parametrize(("m", "n", "k", "split"), [
    (4, 24, 5, 6),        # mm_small, any block size
    (8, 4096, 9, 64),     # a conv's W @ cols: in-place panels (few rows), blocks of 64
    (40, 256, 100, 16),   # packed panels
    (40, 96, 100, 24),    # blocks of 24: each 8-column half still in one block
    (40, 100, 100, 20),   # n not a multiple of 16: the plain product, then a transposing copy
    (30, 90, 200, 9),     # blocks of 9: likewise
])
@pytest.mark.parametrize("bias", [NO_BIAS, ROW_BIAS])
def test_a_split_product_is_written_batch_major(m: int, n: int, k: int, split: int,
                                                bias: int) -> None:
    # C (m, n) lands as (n // split, m, split): a convolution's output in NCHW.
    rng = np.random.default_rng(m + n + k)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    args = [tg.AnyTensor.from_numpy(a), tg.AnyTensor.from_numpy(b)]
    want = a @ b
    if bias:
        c = rng.standard_normal(m)
        args.append(tg.AnyTensor.from_numpy(c))
        want = want + c[:, None]
    out = EagerEmitter(tg.default_device()).apply(
        MATMUL, args, MatmulParams(False, False, bias, split=split)).numpy()
    np.testing.assert_allclose(out, want.reshape(m, n // split, split).transpose(1, 0, 2),
                               rtol=1e-12, atol=1e-12)


def test_zero_inner_size_gives_zeros() -> None:
    tape, a = tg.leaf(tg.Tape(), np.ones((3, 0), np.float32))
    tape, b = tg.leaf(tape, np.ones((0, 4), np.float32))
    tape, c = tg.matmul(tape, a, b)
    np.testing.assert_array_equal(tg.value(tape, c).numpy(), np.zeros((3, 4)))
    # With a bias, the product is the bias broadcast (torch's addmm gives the same).
    tape, bias = tg.leaf(tape, np.arange(4, dtype=np.float32))
    tape, y = tg.linear(tape, a, b, bias)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), np.tile(np.arange(4.0), (3, 1)))


@pytest.mark.parametrize(("ta", "tb"), list(itertools.product((False, True), repeat=2)))
def test_a_tiny_product_is_one_launch(ta: bool, tb: bool, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    """A small layer's products (here the digits CNN's 64x64 @ 64x10) read both operands in
    place in one launch: no pack, no padded C cut to size, no transposing copy. Where both run
    along k (a @ b^T, as g W^T) that launch is the dot products, else mm_small."""
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    m, n, k = 64, 10, 64
    rng = np.random.default_rng(1)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    args = [tg.AnyTensor.from_numpy(a), tg.AnyTensor.from_numpy(b)]
    out = EagerEmitter(tg.default_device()).apply(MATMUL, args, MatmulParams(ta, tb)).numpy()
    assert names == ["mm_dot" if tb and not ta else "mm_small8"]  # n = 10: tiles of 8
    want = (a.T if ta else a) @ (b.T if tb else b)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 6, 8, 10, 12, 13, 15])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [NO_BIAS, COLUMN_BIAS, ROW_BIAS])
def test_mm_small_vector_tiles_and_column_chains_give_the_same_bits(
        n: int, dtype: Any, bias: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """mm_small's tiles take a vector FMA where B's rows are contiguous and sum a column at a
    time where they are strided (and in the last partial tile): each column's k summed in
    order from its bias either way, so B given as itself or as the transpose of B^T gives
    the same bits, at tiles of 8 and of 4, whole and partial. (A^T keeps both products off
    the dot kernels; under 16 columns, as 16 contiguous ones take the panel kernel.)"""
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    m, k = 33, 37
    rng = np.random.default_rng(n)
    at = rng.standard_normal((k, m)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    extra = [] if not bias else [tg.AnyTensor.from_numpy(
        rng.standard_normal(n if bias == COLUMN_BIAS else m).astype(dtype))]
    e = EagerEmitter(tg.default_device())
    rows = e.apply(MATMUL, [tg.AnyTensor.from_numpy(at), tg.AnyTensor.from_numpy(b), *extra],
                   MatmulParams(True, False, bias)).numpy()
    strided = e.apply(MATMUL, [tg.AnyTensor.from_numpy(at),
                               tg.AnyTensor.from_numpy(np.ascontiguousarray(b.T)), *extra],
                      MatmulParams(True, True, bias)).numpy()
    width = 4 if n % 8 >= 4 else 8
    assert names == [f"mm_small{width}"] * 2
    np.testing.assert_array_equal(rows, strided)
    want = at.T.astype(np.float64) @ b + (0 if not bias else extra[0].numpy()[
        slice(None) if bias == COLUMN_BIAS else (slice(None), None)])
    np.testing.assert_allclose(rows, want, rtol=1e-4 if dtype == np.float32 else 1e-12,
                               atol=1e-4 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 256, 256), (32, 32, 32), (8, 64, 64)])
def test_a_tiny_product_the_panel_or_dot_kernels_take_in_one_launch_skips_mm_small(
        m: int, k: int, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """mm_small sums each column's k in a chain, slower than the panel and dot kernels, so a
    tiny product that those take in one launch (B's whole panels in place, or both operands
    along k) goes to them: the forward and both products of the backward."""
    names: list[str] = []
    on_launch(monkeypatch, lambda name: names.append(name) if name.startswith("mm") else None)
    rng = np.random.default_rng(2)
    a0, b0 = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    tape, a = tg.leaf(tg.Tape(), a0, requires_grad=True)
    tape, b = tg.leaf(tape, b0, requires_grad=True)
    tape, c = tg.matmul(tape, a, b)
    tape, loss = tg.sum(tape, c)
    grads = tg.backward(tape, loss, wrt=[a, b])
    assert names == ["mm_panel", "mm_dot", "mm_panel"]
    np.testing.assert_allclose(tg.value(tape, c).numpy(), a0 @ b0, rtol=1e-12)
    np.testing.assert_allclose(grads[a].numpy(), np.tile(b0.sum(1), (m, 1)), rtol=1e-12)
    np.testing.assert_allclose(grads[b].numpy(), np.tile(a0.sum(0)[:, None], (1, n)),
                               rtol=1e-12)


@pytest.mark.parametrize(("m", "n", "k"), [(50, 37, 300), (20, 47, 1000), (97, 48, 600)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_transposed_a_over_long_k_packed_or_in_place_gives_the_same_bits(
        m: int, n: int, k: int, dtype: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A^T over k > KC is packed row-major from AT_PACK_MIN elements on and read in place
    below: the same sums in the same order either way (here both, for shapes that take the
    packed panels, the in-place panels with an mm_small tail, and the mm_dot tail)."""
    from tapegrad._ops import linalg

    rng = np.random.default_rng(k)
    a = rng.standard_normal((k, m)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    args = [tg.AnyTensor.from_numpy(a), tg.AnyTensor.from_numpy(b)]
    outs: list[Any] = []
    for pack_from in (0, 1 << 40):
        names: list[str] = []
        with monkeypatch.context() as patch:
            patch.setattr(linalg, "AT_PACK_MIN", pack_from)
            on_launch(patch, names.append)
            e = EagerEmitter(tg.default_device())
            outs.append(e.apply(MATMUL, args, MatmulParams(True, False)).numpy())
        assert ("gather4_" + str(np.dtype(dtype).itemsize) in names[:1]) == (pack_from == 0)
    np.testing.assert_array_equal(outs[0], outs[1])
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(outs[1], a.T @ b, rtol=tol, atol=tol * k)


@pytest.mark.parametrize("gpu", [False, True])
def test_float32_products_over_long_k_err_like_blas(gpu: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Each chunk of k is summed from 0 and added to C: a running sum through every chunk
    # erred 3.3e-6 relative at k = 4096 on data around 10 (PyTorch's BLAS 3.4e-7), and a
    # weight gradient over a batch of 1e4 rows (A^T packed, chunked) 3.2e-6. A GPU's kernel
    # (`mm_tiled`) sums blocks of k the same way.
    if gpu:
        _as_gpu(monkeypatch)
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((64, 4096)) + 10).astype(np.float32)
    b = (rng.standard_normal((4096, 48)) + 10).astype(np.float32)
    tape, ai = tg.leaf(tg.Tape(), a)
    tape, bi = tg.leaf(tape, b)
    tape, c = tg.matmul(tape, ai, bi)
    truth = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(tg.value(tape, c).numpy() - truth).max() <= 1e-6 * np.abs(truth).max()
    x = (rng.standard_normal((10000, 32)) + 1).astype(np.float32)
    g = (rng.standard_normal((10000, 16)) + 1).astype(np.float32)
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, w = tg.leaf(tape, np.zeros((32, 16), np.float32), requires_grad=True)
    tape, y = tg.matmul(tape, xi, w)
    gw = tg.backward(tape, y, seed=g)[w].numpy()
    truth = x.astype(np.float64).T @ g.astype(np.float64)
    assert np.abs(gw - truth).max() <= 1e-6 * np.abs(truth).max()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("x_shape", "index", "w_shape"), [
    ((20, 16, 32), 3, (32, 256)),                  # x[t] of a sequence: a contiguous run
    ((16, 256), np.s_[:, 64:128], (64, 40)),       # a split's piece: rows 256 apart
    ((300, 128), np.s_[100:250], (128, 24)),       # rows of a matrix, packed B
    ((4, 16, 256), np.s_[:, :, 64:128], (64, 40)),  # a batched piece
    ((64, 512), np.s_[:, 128:256], (128, 300)),    # mm_panel over many rows
])
def test_a_product_reads_a_slice_of_rows_in_place(
        monkeypatch: pytest.MonkeyPatch, x_shape: tuple[int, ...], index: Any,
        w_shape: tuple[int, int], dtype: Any) -> None:
    """op(a) of a pending take (see `_fusion.pending_view`) is read where its source holds
    it, at the take's offset and row stride: the product launches what the product of a
    contiguous copy launches (no copy first), with the same bits, and so does the weight's
    gradient, which reads it transposed."""
    rng = np.random.default_rng(16)
    x0 = rng.standard_normal(x_shape).astype(dtype)
    w0 = rng.standard_normal(w_shape).astype(dtype)
    results: list[tuple[list[str], bytes, bytes]] = []
    for copy in (True, False):
        tape, x = tg.leaf(tg.Tape(), np.ascontiguousarray(x0[index]) if copy else x0)
        tape, w = tg.leaf(tape, w0, requires_grad=True)
        tape, xt = (tape, x) if copy else tg.slice(tape, x, index)
        names: list[str] = []
        on_launch(monkeypatch, names.append)
        tape, y = tg.matmul(tape, xt, w)
        forward = list(names)
        tape, y2 = tg.mul(tape, y, y)
        tape, total = tg.sum(tape, y2)
        grad = tg.backward(tape, total)[w].numpy()
        results.append((forward, tg.value(tape, y).numpy().tobytes(), grad.tobytes()))
        monkeypatch.undo()
    assert results[0] == results[1]  # the same launches: no copy of the slice first
    got = np.frombuffer(results[1][1], dtype).reshape(x0[index].shape[:-1] + w_shape[1:])
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, x0[index] @ w0, rtol=tol, atol=tol)


def _rnn_steps(x: Any, w: Any, steps: int) -> tuple[tg.Tape, tg.Id, tg.Id]:
    """h <- tanh(h @ w), `steps` times, from h = x: the same weight multiplies every step."""
    tape, h = tg.leaf(tg.Tape(), x)
    tape, wi = tg.leaf(tape, w, requires_grad=True)
    for _ in range(steps):
        tape, h = tg.matmul(tape, h, wi)
        tape, h = tg.tanh(tape, h)
    tape, total = tg.sum(tape, h)
    return tape, total, wi


def test_an_operand_packed_again_in_a_layout_keeps_its_panels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A recurrent weight's panels are packed twice, then kept while it lives: the forward's
    later steps and the backward's products with its transpose read them, with the bits of
    products that each pack their own (the panels are the same data)."""
    rng = np.random.default_rng(5)
    # rows, k and bytes enough to pack B (see _product)
    x = rng.standard_normal((32, 160)).astype(np.float32)
    w = (rng.standard_normal((160, 160)) * 0.1).astype(np.float32)

    class Forgetful(dict[Any, Any]):
        def __setitem__(self, key: Any, value: Any) -> None:
            pass  # nothing kept: every product packs its own panels

    runs: list[tuple[int, bytes, bytes]] = []
    for keep in (True, False):
        if not keep:
            monkeypatch.setattr(linalg, "_PACKED", Forgetful())
        names: list[str] = []
        on_launch(monkeypatch, names.append)
        tape, total, wi = _rnn_steps(x, tg.AnyTensor.from_numpy(w), 6)
        grad = tg.backward(tape, total)[wi].numpy()
        runs.append((names.count("mm_pack"), tg.value(tape, total).numpy().tobytes(),
                     grad.tobytes()))
        monkeypatch.undo()
    # w packed at forward steps 1 and 2, w^T at the backward's first two: four, where each
    # product packing its own is eleven (six steps, five cotangents of h: x needs none)
    assert (runs[0][0], runs[1][0]) == (4, 11)
    assert runs[0][1:] == runs[1][1:]


def test_panels_kept_outside_a_recording_are_not_read_inside_it() -> None:
    """A weight packed twice eagerly, then given to a jitted step: the step packs it itself
    (a recorded launch), so a replay on another weight packs that one, and equals eager."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((32, 160)).astype(np.float32)
    w = tg.AnyTensor.from_numpy((rng.standard_normal((160, 160)) * 0.1).astype(np.float32))

    def step(x: Any, w: Any) -> tuple[tg.AnyTensor, tg.AnyTensor]:
        tape, total, wi = _rnn_steps(x, w, 4)
        return tg.value(tape, total), tg.backward(tape, total)[wi]

    step(x, w)  # eager: w's panels kept
    jitted = tg.jit(step)
    jitted(x, w)
    for k in range(3):
        w2 = tg.AnyTensor.from_numpy((rng.standard_normal((160, 160)) * 0.1).astype(np.float32))
        got = [t.numpy().tobytes() for t in jitted(x, w2)]
        want = [t.numpy().tobytes() for t in step(x, w2)]
        assert got == want, k
    assert jitted.replays >= 1


def test_a_recordings_panels_are_its_own_and_let_go_when_it_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Panels kept eagerly and those a tg.jit recording keeps are apart (one thread's eager
    products on a weight did replace a recording's entry in another, so its checks saw other
    launches and it gave up), and a recording's go when it ends: nothing but the eager
    panels stays held for the weight (a closure weight held its recorded panels while it
    lived)."""
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((32, 160)).astype(np.float32)
    w = tg.AnyTensor.from_numpy((rng.standard_normal((160, 160)) * 0.05).astype(np.float32))

    def forward(x: Any) -> tg.AnyTensor:
        tape, h = tg.leaf(tg.Tape(), x)
        tape, wi = tg.leaf(tape, w)
        for _ in range(3):
            tape, h = tg.matmul(tape, h, wi)
        return tg.value(tape, h)

    eager = [forward(x).numpy().tobytes() for _ in range(2)]  # w's panels kept eagerly
    jitted = tg.jit(forward)
    for _ in range(5):
        assert jitted(x).numpy().tobytes() == eager[0]
    assert jitted.replays >= 1
    owners = linalg._PACKED[id(w)][1]
    assert list(owners) == [0]  # the eager panels only: the recordings' went with them
    names.clear()
    assert forward(x).numpy().tobytes() == eager[0]
    assert "mm_pack" not in names  # and the eager ones are still kept


@pytest.mark.parametrize(("m", "k", "n", "batches"), [
    (512, 64, 192, 1), (64, 256, 64, 1), (100, 96, 32, 2)])
@pytest.mark.parametrize("wide", [False, True])
def test_a_small_b_within_one_chunk_is_read_in_place_with_the_packed_bits(
        monkeypatch: pytest.MonkeyPatch, m: int, k: int, n: int, batches: int,
        wide: bool) -> None:
    """B of at most PACK_MIN_BYTES whose panels can be read in place within one chunk of k
    is not packed: one launch fewer, the same sums (one chunk either way), so the same bits;
    panels of 16 or 32 columns, many rows (several row blocks a work-item) or few."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((batches, m, k)).astype(np.float32)
    b = rng.standard_normal((batches, k, n)).astype(np.float32)
    assert batches * k * n * 4 <= linalg.PACK_MIN_BYTES and k <= linalg.KC[np.dtype(np.float32)]
    runs: list[tuple[list[str], bytes]] = []
    for limit in (linalg.PACK_MIN_BYTES, 0):
        monkeypatch.setattr(linalg, "PACK_MIN_BYTES", limit)
        names: list[str] = []
        on_launch(monkeypatch, names.append)
        monkeypatch.setattr(linalg, "wide_panels", _wide if wide else _narrow)
        tape, i = tg.leaf(tg.Tape(), a)
        tape, j = tg.leaf(tape, b)
        tape, y = tg.matmul(tape, i, j)
        runs.append((names, tg.value(tape, y).numpy().tobytes()))
        monkeypatch.undo()
    suffix = "32" if wide else ""
    assert runs[0][0] == [f"mm_panel{suffix}"]
    assert runs[1][0] == [f"mm_pack{suffix}", f"mm_panel{suffix}"]
    assert runs[0][1] == runs[1][1]
    np.testing.assert_allclose(np.frombuffer(runs[0][1], np.float32).reshape(batches, m, n),
                               a @ b, rtol=1e-4, atol=1e-4)


def _wide(device: Any, dtype: Any) -> bool:
    return True


def _narrow(device: Any, dtype: Any) -> bool:
    return False


@pytest.mark.parametrize(("m", "n", "k", "batches"), [
    (64, 96, 300, 1), (97, 784, 300, 1), (40, 120, 600, 2), (300, 256, 300, 1),
    (130, 64, 400, 3)])
@pytest.mark.parametrize(("ta", "tb"), list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize("bias", [NO_BIAS, COLUMN_BIAS, ROW_BIAS])
def test_panels_of_32_give_the_bits_of_panels_of_16(
        m: int, n: int, k: int, batches: int, ta: bool, tb: bool, bias: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device's vectors hold 16 floats, float32 products with packed panels take
    panels of 32 columns (`mm_panel32`, `mm_pack32`): the same sums in the same order as
    panels of 16, so the same bits, forced here either way on any device (n padded to 32
    and cut; several k chunks; batches; both biases; transposed operands)."""
    rng = np.random.default_rng(m + n + k)
    a = rng.standard_normal((batches, k, m) if ta else (batches, m, k)).astype(np.float32)
    b = rng.standard_normal((batches, n, k) if tb else (batches, k, n)).astype(np.float32)
    args = [tg.AnyTensor.from_numpy(a if batches > 1 else a[0]),
            tg.AnyTensor.from_numpy(b if batches > 1 else b[0])]
    if bias != NO_BIAS and batches > 1:
        pytest.skip("a bias is a 2-D product's")
    if bias != NO_BIAS:
        args.append(tg.AnyTensor.from_numpy(
            rng.standard_normal(n if bias == COLUMN_BIAS else m).astype(np.float32)))
    outs: list[Any] = []
    names: list[str] = []
    for wide in (False, True):
        with monkeypatch.context() as patch:
            on_launch(patch, names.append)
            patch.setattr(linalg, "wide_panels", _wide if wide else _narrow)
            e = EagerEmitter(tg.default_device())
            outs.append(e.apply(MATMUL, args, MatmulParams(ta, tb, bias)).numpy())
    assert outs[0].tobytes() == outs[1].tobytes()
    assert "mm_panel32" in names and "mm_pack32" in names  # the wide path ran
    want = np.swapaxes(a, 1, 2) if ta else a
    want = want @ (np.swapaxes(b, 1, 2) if tb else b)
    if bias == COLUMN_BIAS:
        want = want + args[2].numpy()
    elif bias == ROW_BIAS:
        want = want + args[2].numpy()[:, None]
    np.testing.assert_allclose(outs[1], want if batches > 1 else want[0], rtol=1e-4,
                               atol=1e-4 * k)


@pytest.mark.parametrize(("m", "n", "k", "batches"), [
    (512, 128, 1024, 1), (161, 160, 128, 1), (130, 96, 300, 3), (200, 64, 256, 2),
    (64, 64, 256, 2)])
def test_a_transposed_as_blocks_of_8_rows_gives_the_bits_of_a_in_place(
        m: int, n: int, k: int, batches: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wide tiles read A^T (a weight gradient's activations) from A_BLOCKS_MIN_K on, its
    rows at least A_BLOCKS_MIN_STRIDE bytes apart, as blocks of 8 rows (`mm_pack_a`: zeros
    past m, a partial group of 64, batches): the same sums as A^T read in place, so the same
    bits. Narrower A (64 floats a row) is read in place."""
    rng = np.random.default_rng(m + k)
    a = rng.standard_normal((batches, k, m)).astype(np.float32)
    b = rng.standard_normal((batches, k, n)).astype(np.float32)
    args = [tg.AnyTensor.from_numpy(a if batches > 1 else a[0]),
            tg.AnyTensor.from_numpy(b if batches > 1 else b[0])]
    outs: list[Any] = []
    names: list[list[str]] = []
    for blocks_from in (linalg.A_BLOCKS_MIN_K, 1 << 40):
        launched: list[str] = []
        with monkeypatch.context() as patch:
            on_launch(patch, launched.append)
            patch.setattr(linalg, "wide_panels", _wide)
            patch.setattr(linalg, "A_BLOCKS_MIN_K", blocks_from)
            e = EagerEmitter(tg.default_device())
            outs.append(e.apply(MATMUL, args, MatmulParams(True, False)).numpy())
        names.append(launched)
    assert ("mm_pack_a" in names[0]) == (m * 4 >= linalg.A_BLOCKS_MIN_STRIDE)
    assert "mm_pack_a" not in names[1]
    assert "mm_panel32" in names[0] and "mm_panel32" in names[1]
    assert outs[0].tobytes() == outs[1].tobytes()
    want = np.swapaxes(a, 1, 2).astype(np.float64) @ b
    np.testing.assert_allclose(outs[0], want if batches > 1 else want[0], rtol=1e-4,
                               atol=1e-4 * k)


@pytest.mark.parametrize(("m", "n", "k", "batches"), [
    (16, 256, 64, 1), (8, 64, 300, 1), (5, 32, 600, 1), (16, 256, 32, 2)])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("bias", [NO_BIAS, COLUMN_BIAS, ROW_BIAS])
def test_few_rows_read_panels_of_32_in_place_with_the_bits_of_16(
        m: int, n: int, k: int, batches: int, ta: bool, bias: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Few rows of C (below PACK_MIN_ROWS) read B's panels where they are: 32 columns at a
    time where vectors hold 16 floats and n is a multiple of 32 (an RNN's batch of 16 times
    its weights), the same bits as 16 at a time."""
    if bias != NO_BIAS and batches > 1:
        pytest.skip("a bias is a 2-D product's")
    rng = np.random.default_rng(m * n + k)
    a = rng.standard_normal((batches, k, m) if ta else (batches, m, k)).astype(np.float32)
    b = rng.standard_normal((batches, k, n)).astype(np.float32)
    args = [tg.AnyTensor.from_numpy(a if batches > 1 else a[0]),
            tg.AnyTensor.from_numpy(b if batches > 1 else b[0])]
    if bias != NO_BIAS:
        args.append(tg.AnyTensor.from_numpy(
            rng.standard_normal(n if bias == COLUMN_BIAS else m).astype(np.float32)))
    outs: list[Any] = []
    names: list[list[str]] = []
    for wide in (False, True):
        launched: list[str] = []
        with monkeypatch.context() as patch:
            on_launch(patch, launched.append)
            patch.setattr(linalg, "wide_panels", _wide if wide else _narrow)
            e = EagerEmitter(tg.default_device())
            outs.append(e.apply(MATMUL, args, MatmulParams(ta, False, bias)).numpy())
        names.append(launched)
    assert names == [["mm_panel"], ["mm_panel32"]]
    assert outs[0].tobytes() == outs[1].tobytes()


@pytest.mark.parametrize(("m", "n", "k", "batches"), [
    (1, 1, 1, 1), (5, 7, 3, 1), (64, 64, 16, 1), (70, 130, 33, 2), (200, 96, 300, 1)])
@pytest.mark.parametrize(("ta", "tb"), list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_gpu_tiled_product_matches_numpy(m: int, n: int, k: int, batches: int, ta: bool,
                                              tb: bool, dtype: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`mm_tiled`, a GPU's product (run here on the default device, which takes its local
    memory and barriers too): any strides, batches, ragged tiles and k chunks."""
    rng = np.random.default_rng(m * 7 + n + k)
    a = rng.standard_normal((batches, k, m) if ta else (batches, m, k)).astype(dtype)
    b = rng.standard_normal((batches, n, k) if tb else (batches, k, n)).astype(dtype)
    args = [tg.AnyTensor.from_numpy(a if batches > 1 else a[0]),
            tg.AnyTensor.from_numpy(b if batches > 1 else b[0])]
    want = (np.swapaxes(a, 1, 2) if ta else a) @ (np.swapaxes(b, 1, 2) if tb else b)
    names = _as_gpu(monkeypatch)
    got = EagerEmitter(tg.default_device()).apply(MATMUL, args, MatmulParams(ta, tb))
    # few tiles over more than a block of k: the blocks apart, then added (mm_parts)
    blocks = k > linalg.KC[np.dtype(dtype)]
    assert names == (["mm_tiled", "mm_parts"] if blocks else ["mm_tiled"])
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got.numpy(), want if batches > 1 else want[0], rtol=tol,
                               atol=tol * np.sqrt(k))


def _as_gpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The default device taken for a GPU by the products (launched at once, as a GPU's are);
    the names of the kernels launched from here on (`on_launch`, its CPU pin undone)."""
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    monkeypatch.setattr(tg.default_device(), "is_gpu", True)
    monkeypatch.setattr(tg.default_device(), "_defers", False)
    return names


@pytest.mark.parametrize(("m", "n", "k", "batches", "bias", "split"), [
    (16, 144, 1000, 1, NO_BIAS, 0), (37, 70, 513, 2, NO_BIAS, 0), (16, 96, 700, 1, ROW_BIAS, 8),
    (20, 33, 257, 1, COLUMN_BIAS, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_gpu_product_of_few_tiles_sums_its_blocks_of_k_apart_to_the_same_bits(
        m: int, n: int, k: int, batches: int, bias: int, split: int, dtype: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A product with few tiles of C over a long k (a convolution's weight gradient) runs
    its blocks of k as work-groups of their own and adds them in order (mm_parts): the bits
    of the one walk over k (GPU_MIN_GROUPS 0), with biases and split layouts."""
    rng = np.random.default_rng(m + n + k)
    shape_a, shape_b = ((batches, m, k), (batches, k, n)) if batches > 1 else ((m, k), (k, n))
    a = rng.standard_normal(shape_a).astype(dtype)
    b = rng.standard_normal(shape_b).astype(dtype)
    args = [tg.AnyTensor.from_numpy(a), tg.AnyTensor.from_numpy(b)]
    want = a @ b
    if bias != NO_BIAS:
        v = rng.standard_normal(n if bias == COLUMN_BIAS else m).astype(dtype)
        args.append(tg.AnyTensor.from_numpy(v))
        want = want + (v if bias == COLUMN_BIAS else v[:, None])
    if split:
        want = want.reshape(m, n // split, split).transpose(1, 0, 2)
    names = _as_gpu(monkeypatch)
    got: list[np.ndarray[Any, Any]] = []
    for min_groups in (linalg.GPU_MIN_GROUPS, 0):
        monkeypatch.setattr(linalg, "GPU_MIN_GROUPS", min_groups)
        got.append(EagerEmitter(tg.default_device()).apply(
            MATMUL, args, MatmulParams(False, False, bias, split)).numpy())
    assert names == ["mm_tiled", "mm_parts", "mm_tiled"]
    assert got[0].tobytes() == got[1].tobytes()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got[0], want, rtol=tol, atol=tol * np.sqrt(k))


@pytest.mark.parametrize(("m", "n", "k", "max_z"), [(600, 600, 300, 65535), (16, 144, 1000, 3)])
def test_a_gpu_product_walks_all_of_k_where_its_blocks_would_not_fit(
        m: int, n: int, k: int, max_z: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """No blocks of k apart where their sums would take more memory than A and B (600 x 600
    over k = 300) or their (batch, block) pairs exceed a launch's third dimension."""
    rng = np.random.default_rng(k)
    a = rng.standard_normal((m, k))
    b = rng.standard_normal((k, n))
    names = _as_gpu(monkeypatch)
    monkeypatch.setattr(linalg, "GPU_MAX_Z", max_z)
    got = EagerEmitter(tg.default_device()).apply(
        MATMUL, [tg.AnyTensor.from_numpy(a), tg.AnyTensor.from_numpy(b)],
        MatmulParams(False, False))
    assert names == ["mm_tiled"]
    np.testing.assert_allclose(got.numpy(), a @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("bias", "split"), [(COLUMN_BIAS, 0), (ROW_BIAS, 0), (NO_BIAS, 8),
                                             (ROW_BIAS, 12)])
def test_the_gpu_tiled_product_adds_biases_and_writes_split_layouts(
        bias: int, split: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(bias + split)
    m, n, k = 37, 96, 50
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    want = a @ b
    args = [tg.AnyTensor.from_numpy(a), tg.AnyTensor.from_numpy(b)]
    if bias != NO_BIAS:
        v = rng.standard_normal(n if bias == COLUMN_BIAS else m).astype(np.float32)
        args.append(tg.AnyTensor.from_numpy(v))
        want = want + (v if bias == COLUMN_BIAS else v[:, None])
    names = _as_gpu(monkeypatch)
    got = EagerEmitter(tg.default_device()).apply(
        MATMUL, args, MatmulParams(False, False, bias, split)).numpy()
    assert names[0] == "mm_tiled"
    if split:  # C (m, n) batch-major as (n // S, m, S)
        want = want.reshape(m, n // split, split).transpose(1, 0, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("m", "n", "k"), [(7, 45, 219), (4, 64, 256), (1, 70, 1000),
                                           (13, 6, 1030), (22, 33, 96)])
@pytest.mark.parametrize("bias", [NO_BIAS, COLUMN_BIAS, ROW_BIAS])
@pytest.mark.parametrize("batches", [1, 3])
def test_the_sixteen_lane_dot_products_match_numpy(m: int, n: int, k: int, bias: int,
                                                   batches: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """g @ W^T with few rows of g: mm_dot16 where vectors hold 16 floats (4 rows a work-item,
    k sixteen at a time, then eight, then one by one: here every tail), else mm_dot."""
    if not linalg.wide_panels(tg.default_device(), np.dtype(np.float32)):
        pytest.skip("mm_dot16 runs where the device's vectors hold 16 floats")
    if bias and batches > 1:
        pytest.skip("a bias is a 2-D product's")
    names: list[str] = []
    launch = tg.Device.launch

    def noting(self: tg.Device, kernel: Any, *args: Any, largest: int | None = None) -> None:
        names.append(str(kernel.function_name))
        launch(self, kernel, *args, largest=largest)

    monkeypatch.setattr(tg.Device, "launch", noting)
    rng = np.random.default_rng(m + n + k)
    lead = (batches,) if batches > 1 else ()
    a = rng.standard_normal((*lead, m, k)).astype(np.float32)
    b = rng.standard_normal((*lead, n, k)).astype(np.float32)
    args = [tg.AnyTensor.from_numpy(a), tg.AnyTensor.from_numpy(b)]
    want = a.astype(np.float64) @ np.swapaxes(b, -1, -2).astype(np.float64)
    if bias:
        c = rng.standard_normal(n if bias == COLUMN_BIAS else m).astype(np.float32)
        args.append(tg.AnyTensor.from_numpy(c))
        want = want + (c if bias == COLUMN_BIAS else c[:, None])
    out = EagerEmitter(tg.default_device()).apply(
        MATMUL, args, MatmulParams(False, True, bias)).numpy()
    assert "mm_dot16" in names
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5 * k)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("op", ["matmul", "linear", "linear_bias"])
def test_the_quick_path_of_two_matrices_records_the_general_node(op: str, grad: bool) -> None:
    """matmul and linear of two float matrices that fit skip record's rule and operand loop
    (`record_known`): the node is the one `record` makes (op, params, parents, gradient flag,
    aval, value), at the user's line, and a gradient flows through it as through `record`'s."""
    rng = np.random.default_rng(3)
    x0, w0, b0 = (rng.standard_normal(s) for s in [(3, 4), (4, 5), (5,)])
    tape, x = tg.leaf(tg.Tape(), x0, requires_grad=grad)
    tape, w = tg.leaf(tape, w0, requires_grad=True)
    tape, b = tg.leaf(tape, b0)
    bias = b if op == "linear_bias" else None
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    quick, out = tg.matmul(tape, x, w) if op == "matmul" else tg.linear(tape, x, w, bias)
    params = MatmulParams(False, False, COLUMN_BIAS if op == "linear_bias" else NO_BIAS)
    ids = [x, w, b] if op == "linear_bias" else [x, w]
    general, same = tg._tape.record(tape, MATMUL, ids, params)  # pyright: ignore[reportPrivateUsage]
    made, want = quick[out], general[same]
    assert (made.op, made.params, made.parents, made.requires_grad, out.shape, out.dtype) == (
        want.op, want.params, want.parents, want.requires_grad, same.shape, same.dtype)
    assert made.requires_grad and made.location == (__file__, line)
    np.testing.assert_array_equal(tg.value(quick, out).numpy(), tg.value(general, same).numpy())
    for t, y in ((quick, out), (general, same)):
        t, s = tg.sum(t, y)
        gw = tg.backward(t, s, wrt=[w])[w]
        np.testing.assert_allclose(gw.numpy(), x0.sum(0)[:, None] * np.ones((1, 5)))
