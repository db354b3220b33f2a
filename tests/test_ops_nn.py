"""nn ops beyond the op table: dropout's mask, max-pool tie routing, padding rules, second-order
gradients through conv2d and the pools, determinism, the kernel cache, and error messages."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from cases import on_launch, warm_up
from cases_nn import conv2d_ref, dropout_mask_ref
from tapegrad._ops import conv
from tapegrad._ops import nn as nn_ops
from tapegrad._primitive import EagerEmitter
from tapegrad._tape import record

Array = np.ndarray[Any, Any]


def _leaf(tape: tg.Tape, a: Array, grad: bool = False) -> tuple[tg.Tape, tg.Id]:
    return tg.leaf(tape, a, requires_grad=grad)


def _dropout(x: Array, p: float, seed: int) -> Array:
    tape, xi = _leaf(tg.Tape(), x)
    tape, y = tg.dropout(tape, xi, p, seed)
    return tg.value(tape, y).numpy()


# --- dropout ----------------------------------------------------------------------------------


def test_dropout_same_seed_same_mask_other_seed_other_mask() -> None:
    x = np.ones((64, 50), np.float32)
    first, again, other = _dropout(x, 0.5, 11), _dropout(x, 0.5, 11), _dropout(x, 0.5, 12)
    np.testing.assert_array_equal(first, again)
    differ = np.count_nonzero((first != 0) != (other != 0)) / first.size
    assert 0.4 < differ < 0.6  # independent masks of p=0.5 disagree on half the elements
    np.testing.assert_array_equal(first != 0, dropout_mask_ref(x.shape, 0.5, 11))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_keeps_one_minus_p_and_scales_the_kept(p: float) -> None:
    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32) + 5.0  # nonzero
    y = _dropout(x, p, 1234)
    kept = y != 0
    assert abs(float(kept.mean()) - (1 - p)) < 0.006  # > 5 standard deviations
    np.testing.assert_array_equal(y[kept], x[kept] * np.float32(1 / (1 - p)))
    # no visible structure in the mask: neighbours are kept independently
    both = np.count_nonzero(kept[1:] & kept[:-1]) / (kept.size - 1)
    assert abs(both - (1 - p) ** 2) < 0.006


def test_dropout_vjp_uses_the_same_mask() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 7)) + 10.0
    r = rng.standard_normal((6, 7))
    tape, xi = _leaf(tg.Tape(), x, grad=True)
    tape, ri = _leaf(tape, r)
    tape, y = tg.dropout(tape, xi, 0.4, 99)
    tape, yr = tg.mul(tape, y, ri)
    tape, loss = tg.sum(tape, yr)
    mask = tg.value(tape, y).numpy() != 0
    assert 0 < mask.sum() < mask.size
    want = np.where(mask, r / 0.6, 0.0)
    np.testing.assert_allclose(tg.backward(tape, loss)[xi].numpy(), want, rtol=1e-14)
    tape, grads = tg.backward_on_tape(tape, loss, [xi])  # recorded: the same mask again
    np.testing.assert_allclose(tg.value(tape, grads[xi]).numpy(), want, rtol=1e-14)


def test_dropout_p0_is_identity_and_p1_is_zeros() -> None:
    tape, xi = _leaf(tg.Tape(), np.arange(1.0, 7.0, dtype=np.float32), grad=True)
    tape2, y = tg.dropout(tape, xi, 0.0, 3)
    assert y == xi and len(tape2) == len(tape)
    tape, z = tg.dropout(tape, xi, 1.0, 3)
    np.testing.assert_array_equal(tg.value(tape, z).numpy(), np.zeros(6, np.float32))
    tape, loss = tg.sum(tape, z)
    np.testing.assert_array_equal(tg.backward(tape, loss)[xi].numpy(), np.zeros(6, np.float32))


def test_dropout_multiplies_by_the_mask_as_pytorch() -> None:
    """x * 0 for a dropped element, as PyTorch's x * mask / (1 - p): a dropped inf or NaN is
    NaN (a select gave 0, hiding it from the finite check), a dropped -1 is -0.0."""
    x = np.array([np.inf, np.nan, -1.0, 2.0] * 64, np.float32)
    tape, xi = _leaf(tg.Tape(), x)
    tape, y = tg.dropout(tape, xi, 1.0, 5)
    out = tg.value(tape, y).numpy()
    assert np.isnan(out[0::4]).all() and np.isnan(out[1::4]).all()
    assert (out[2::4] == 0).all() and np.signbit(out[2::4]).all()
    assert not np.signbit(out[3::4]).any()
    tape, y = tg.dropout(tape, xi, 0.5, 5)
    out = tg.value(tape, y).numpy()
    dropped = np.isnan(out[0::4])  # inf * 0; kept: inf * 2
    assert dropped.any() and not dropped.all() and (out[0::4][~dropped] == np.inf).all()


def test_dropout_rejects_bad_arguments_before_recording() -> None:
    tape, xi = _leaf(tg.Tape(), np.ones(4, np.float32))
    for p in (-0.1, 1.5, float("nan")):
        with pytest.raises(tg.TapegradError, match=r"dropout: p must be a probability in \[0, 1\]"):
            tg.dropout(tape, xi, p, 0)
    with pytest.raises(tg.TapegradError, match=r"dropout: seed must be an int, got 1\.5"):
        tg.dropout(tape, xi, 0.5, 1.5)  # type: ignore[arg-type]
    tape, ii = _leaf(tape, np.ones(4, np.int32))
    with pytest.raises(tg.DTypeError, match="dropout: x has dtype int32, expected float32"):
        tg.dropout(tape, ii, 0.5, 0)
    assert len(tape) == 2


# --- pooling ----------------------------------------------------------------------------------


def _pool_grad(fn: Callable[..., tuple[tg.Tape, tg.Id]], x: Array, *args: Any, **kw: Any
               ) -> tuple[Array, Array]:
    tape, xi = _leaf(tg.Tape(), x, grad=True)
    tape, y = fn(tape, xi, *args, **kw)
    tape, loss = tg.sum(tape, y)
    return tg.value(tape, y).numpy(), tg.backward(tape, loss)[xi].numpy()


def test_max_pool_ties_route_to_the_first_maximum_in_window_order() -> None:
    # Four overlapping 2x2 windows of zeros: each picks its top-left element.
    _, g = _pool_grad(tg.max_pool2d, np.zeros((1, 1, 3, 3)), 2, stride=1)
    np.testing.assert_array_equal(g[0, 0], [[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    # A tie between (0, 1) and (1, 0): row-major window order picks (0, 1).
    x = np.array([[[[1.0, 3.0], [3.0, 2.0]]]])
    y, g = _pool_grad(tg.max_pool2d, x, 2)
    np.testing.assert_array_equal(y, [[[[3.0]]]])
    np.testing.assert_array_equal(g[0, 0], [[0, 1], [0, 0]])
    # Padding is -inf and never wins a tie; one element that is every window's first maximum
    # collects every window's cotangent.
    y, g = _pool_grad(tg.max_pool2d, np.zeros((1, 1, 2, 2)), 3, stride=1, padding=1)
    np.testing.assert_array_equal(y, np.zeros((1, 1, 2, 2)))
    np.testing.assert_array_equal(g[0, 0], [[4, 0], [0, 0]])
    # Negative inputs beside the padding: the real maximum, not the padding.
    y, _ = _pool_grad(tg.max_pool2d, -np.ones((1, 1, 3, 3)), 2, stride=2, padding=1)
    np.testing.assert_array_equal(y, -np.ones((1, 1, 2, 2)))


def test_max_pool_nan_is_the_maximum() -> None:
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    x[0, 0, 0, 1] = np.nan
    y, g = _pool_grad(tg.max_pool2d, x, 2)
    assert np.isnan(y[0, 0, 0, 0])
    np.testing.assert_array_equal(y[0, 0].reshape(-1)[1:], [7.0, 13.0, 15.0])
    assert g[0, 0, 0, 1] == 1 and g[0, 0, 1, 1] == 0


@pytest.mark.parametrize("fast", [True, False], ids=["2x2", "general"])
def test_max_pool_gradient_goes_to_the_last_nan_as_pytorch(
        monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    """PyTorch's CPU kernel takes a cell that is greater or NaN, so of two NaNs in a window the
    later one gets the gradient (torch.nn.functional.max_pool2d on [nan, 1, nan, 0] with a
    (1, 4) window: the gradient at index 2); tapegrad gave it to the first."""
    monkeypatch.setattr(conv, "FAST_2X2", fast)
    _, g = _pool_grad(tg.max_pool2d, np.array([[[[np.nan, 1.0, np.nan, 0.0]]]]), (1, 4))
    np.testing.assert_array_equal(g.reshape(-1), [0.0, 0.0, 1.0, 0.0])
    x = np.array([[[[np.nan, np.nan], [1.0, np.nan]]]])  # the 2x2 kernel's window
    _, g = _pool_grad(tg.max_pool2d, x, 2)
    np.testing.assert_array_equal(g.reshape(-1), [0.0, 0.0, 0.0, 1.0])


def test_max_pool_is_one_kernel_and_pool_gather_still_reads_any_x(
        forwards_at_once: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # The argmax kernel writes the maxima too; pool_gather over that x takes them. Over another
    # x (the adjoint of pool_scatter, say) at the same positions it reads that x itself.
    x = np.random.default_rng(5).standard_normal((2, 3, 6, 6))
    other = np.random.default_rng(6).standard_normal((2, 3, 6, 6))
    tape, xi = _leaf(tg.Tape(), x)
    tape, oi = _leaf(tape, other)
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    tape, y = tg.max_pool2d(tape, xi, 2)
    assert names == ["max_pool2x2_argmax"]  # 2x2 at stride 2: the fast path
    windows = x.reshape(2, 3, 3, 2, 3, 2).transpose(0, 1, 2, 4, 3, 5).reshape(2, 3, 3, 3, 4)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), windows.max(axis=-1))
    at = tape[y].parents[1]
    tape, z = record(tape, conv.POOL_GATHER, [oi, at], tape[y].params)
    assert names == ["max_pool2x2_argmax", "pool_gather"]
    picked = np.take_along_axis(other.reshape(2, 3, 36),
                                tg.value(tape, at).numpy().reshape(2, 3, 9), axis=-1)
    np.testing.assert_array_equal(tg.value(tape, z).numpy(), picked.reshape(2, 3, 3, 3))


def test_linear_and_conv2d_add_their_bias_in_the_products_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(10)
    x, w, b = rng.standard_normal((64, 64)), rng.standard_normal((64, 10)), rng.standard_normal(10)
    xc, wc, bc = (rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((4, 3, 3, 3)),
                  rng.standard_normal(4))
    tape, ids = _ids(x, w, b, xc, wc, bc)
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    tape, y = tg.linear(tape, ids[0], ids[1], ids[2])
    np.testing.assert_allclose(tg.value(tape, y).numpy(), x @ w + b, rtol=1e-12)
    assert names == ["mm_small8"]  # no broadcast copy of b, no add
    names.clear()
    tape, yc = tg.conv2d(tape, ids[3], ids[4], ids[5], padding=1)
    np.testing.assert_allclose(tg.value(tape, yc).numpy(), conv2d_ref(xc, wc, bc, 1, 1),
                               rtol=1e-12, atol=1e-12)
    assert names == ["conv_panel"]  # patches gathered as it multiplies; + bias, written NCHW


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels", [16, 32])
def test_conv_panel_is_bitwise_the_patch_matrix_then_the_product(
        monkeypatch: pytest.MonkeyPatch, dtype: type, channels: int) -> None:
    # The same chunks of k, the same tiles: the same sums in the same order as im2col then
    # the packed product (forced here by the fallback's size limit); 32 channels make k 288,
    # more than one chunk in either dtype.
    rng = np.random.default_rng(3)
    x: Array = rng.standard_normal((2, channels, 8, 8)).astype(dtype)
    w: Array = rng.standard_normal((24, channels, 3, 3)).astype(dtype)
    b: Array = rng.standard_normal(24).astype(dtype)

    def run() -> Array:
        tape, ids = _ids(x, w, b)
        tape, y = tg.conv2d(tape, ids[0], ids[1], ids[2], padding=1)
        return tg.value(tape, y).numpy()

    names: list[str] = []
    on_launch(monkeypatch, names.append)
    in_place = run()  # rows of 8 outputs: read where they lie in x, padded first
    assert names == ["pad_planes", "conv_direct"]
    names.clear()
    with monkeypatch.context() as patch:
        patch.setattr(conv, "_direct", _never)
        fused = run()
    assert names == ["conv_panel"]
    names.clear()
    monkeypatch.setattr(conv, "_INT_MAX", 0)
    product = run()
    assert names == ["im2col", "mm_pack", "mm_panel"]
    np.testing.assert_array_equal(fused, product)
    np.testing.assert_array_equal(in_place, product)
    np.testing.assert_allclose(fused, conv2d_ref(x, w, b, 1, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_pointwise_conv2d_is_a_product_per_image(monkeypatch: pytest.MonkeyPatch,
                                                   dtype: type) -> None:
    """A 1x1 window at stride 1 without padding over planes of whole 16-column panels is W @
    each image's planes, one mm_panel launch (the panel kernel reading them in place), with
    conv_panel's bits (the same chunks of k: 300 channels are two or three) and its bias; x's
    cotangent is W^T @ each image's g, col2im's sums, a NaN weight reaching its channel
    everywhere."""
    rng = np.random.default_rng(8)
    x: Array = rng.standard_normal((3, 300, 4, 4)).astype(dtype)
    w: Array = rng.standard_normal((20, 300, 1, 1)).astype(dtype)
    b: Array = rng.standard_normal(20).astype(dtype)

    def run() -> Array:
        tape, ids = _ids(x, w, b)
        tape, y = tg.conv2d(tape, ids[0], ids[1], ids[2])
        return tg.value(tape, y).numpy()

    names: list[str] = []
    on_launch(monkeypatch, names.append)
    product = run()
    assert names == ["mm_panel"]
    def never(win: conv.Window, s: int) -> bool:
        return False

    with monkeypatch.context() as patch:
        patch.setattr(conv, "_pointwise", never)
        panel = run()
    np.testing.assert_array_equal(product, panel)
    np.testing.assert_allclose(product, conv2d_ref(x, w, b, 1, 0), rtol=1e-4, atol=1e-4)

    window = conv.Window(4, 4, 1, 1, 1, 1, 0, 0)
    g: Array = rng.standard_normal((3, 20, 4, 4)).astype(dtype)
    w[7, 5] = np.nan
    names.clear()
    args = [tg.AnyTensor.from_numpy(g), tg.AnyTensor.from_numpy(w)]
    fast = EagerEmitter(tg.default_device()).apply(conv.CONV_DGRAD, args, window).numpy()
    assert names == ["mm_panel"]
    with monkeypatch.context() as patch:
        patch.setattr(conv, "_INT_MAX", 0)
        on_launch(patch, names.append)
        by_cols = EagerEmitter(tg.default_device()).apply(conv.CONV_DGRAD, args, window).numpy()
    assert "col2im" in names
    assert np.isnan(fast[:, 5]).all() and not np.isnan(np.delete(fast, 5, axis=1)).any()
    np.testing.assert_array_equal(np.isnan(fast), np.isnan(by_cols))
    want = np.einsum("nohw,oc->nchw", g.astype(np.float64), w[:, :, 0, 0].astype(np.float64))
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(fast, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(fast, by_cols, rtol=tol, atol=tol)


def test_a_pointwise_conv2d_second_order_gradcheck() -> None:
    """The product path of a 1x1 convolution (4x4 planes: one panel) and its input gradient,
    to second order, with the weight's gradient (conv_wgrad) beside them."""
    rng = np.random.default_rng(9)

    def op(t: tg.Tape, xi: tg.Id, wi: tg.Id, bi: tg.Id) -> tuple[tg.Tape, tg.Id]:
        return tg.conv2d(t, xi, wi, bi)

    assert tg.gradcheck(_squared_grads(op), rng.standard_normal((2, 3, 4, 4)),
                        rng.standard_normal((5, 3, 1, 1)), rng.standard_normal(5))


def test_conv2d_input_gradient_with_a_nan_weight_reaches_only_where_that_weight_does() -> None:
    # As PyTorch: x's gradient sums w over the windows that exist. The convolution of g with
    # the flipped weight (JAX's form) multiplies g's zero padding by the NaN too, which made
    # every element NaN (the reviewer's case; 0 * NaN).
    x = np.ones((1, 1, 4, 4))
    w = np.ones((1, 1, 3, 3))
    w[0, 0, 2, 2] = np.nan
    tape, xi = _leaf(tg.Tape(), x, grad=True)
    tape, wi = _leaf(tape, w, grad=True)
    tape, y = tg.conv2d(tape, xi, wi, padding=1)
    tape, s = tg.sum(tape, y)
    gx = tg.backward(tape, s)[xi].numpy()[0, 0]
    want = np.zeros((4, 4))
    for yy, xx, i, j in itertools.product(range(4), range(4), range(3), range(3)):
        if 0 <= yy + 1 - i < 4 and 0 <= xx + 1 - j < 4:  # output (yy + 1 - i, xx + 1 - j)
            want[yy, xx] += w[0, 0, i, j]
    assert np.isnan(want[1:, 1:]).all() and np.isfinite(want[0]).all()
    np.testing.assert_array_equal(gx, want)  # NaN where want is NaN, the rest exactly


def _input_grad_both_ways(monkeypatch: pytest.MonkeyPatch, g: Array, w: Array,
                          window: conv.Window) -> tuple[Array, Array, list[str]]:
    """conv2d_input_grad(g, w) by its kernels (at any number of channels and any padding),
    then by col2im(w^T g) (forced by the size limit), and the first run's launches."""
    device = tg.default_device()
    args = [tg.AnyTensor.from_numpy(g), tg.AnyTensor.from_numpy(w)]
    names: list[str] = []
    with monkeypatch.context() as patch:
        patch.setattr(conv, "DGRAD_MIN_CHANNELS", 1)
        patch.setattr(conv, "DGRAD_MAX_EXTRA", 100.0)
        on_launch(patch, names.append)
        fast = EagerEmitter(device).apply(conv.CONV_DGRAD, args, window).numpy()
    with monkeypatch.context() as patch:
        patch.setattr(conv, "_INT_MAX", 0)
        by_cols = EagerEmitter(device).apply(conv.CONV_DGRAD, args, window).numpy()
    return fast, by_cols, names


@pytest.mark.parametrize(("x_shape", "w_shape", "pad"), [
    ((2, 3, 8, 8), (5, 3, 3, 3), (1, 1)),      # same padding, rows of whole halves
    ((2, 2, 7, 11), (3, 2, 3, 2), (0, 1)),     # no padding on rows (g padded by kh - 1)
    ((1, 4, 5, 9), (40, 4, 3, 3), (1, 1)),     # k = 360: two chunks
    ((2, 6, 6, 5), (4, 6, 1, 1), (0, 0)),      # 1x1
    ((2, 3, 9, 10), (2, 3, 5, 5), (2, 2)),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv2d_input_grad_at_stride_1_is_the_flipped_convolution(
        monkeypatch: pytest.MonkeyPatch, x_shape: tuple[int, ...], w_shape: tuple[int, ...],
        pad: tuple[int, int], dtype: type) -> None:
    # The convolution of g with the flipped weight (three launches) against col2im(w^T g),
    # and both against the definition: x's gradient sums w * g over the windows that exist.
    rng = np.random.default_rng(sum(x_shape) + sum(w_shape))
    window = conv.Window(x_shape[2], x_shape[3], w_shape[2], w_shape[3], 1, 1, *pad)
    g: Array = rng.standard_normal((x_shape[0], w_shape[0], window.oh, window.ow)).astype(dtype)
    w: Array = rng.standard_normal(w_shape).astype(dtype)
    fast, by_cols, names = _input_grad_both_ways(monkeypatch, g, w, window)
    # the flipped convolution's output rows are x's: read in place where they are whole
    # groups of 8 (`conv._direct`), g padded by (kh - 1 - ph, kw - 1 - pw) first
    pads_g = (w_shape[2] - 1 - pad[0], w_shape[3] - 1 - pad[1]) != (0, 0)
    panel = (["pad_planes"] * pads_g + ["conv_direct"] if x_shape[3] % 8 == 0
             else ["conv_panel"])
    assert names == ["conv_flip", *panel, "conv_dgrad_fix"]
    want = np.zeros(x_shape)
    for i, j in itertools.product(range(w_shape[2]), range(w_shape[3])):
        # output (oh, ow) reads x at (oh - pad + i, ow - pad + j)
        contrib = np.einsum("nohw,oc->nchw", g.astype(np.float64), w[:, :, i, j])
        padded = np.zeros((x_shape[0], x_shape[1], x_shape[2] + 2 * pad[0],
                           x_shape[3] + 2 * pad[1]))
        padded[:, :, i:i + window.oh, j:j + window.ow] += contrib
        want += padded[:, :, pad[0]:pad[0] + x_shape[2], pad[1]:pad[1] + x_shape[3]]
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(fast, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(by_cols, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(("x_shape", "w_shape", "pad", "flipped"), [
    ((2, 8, 6, 6), (4, 8, 3, 3), 1, True),
    ((2, 7, 6, 6), (4, 7, 3, 3), 1, False),    # few channels: most of a tile's rows wasted
    ((2, 8, 6, 6), (4, 8, 3, 3), 0, False),    # no padding: 36 / 16 of the product's work
    ((2, 8, 13, 13), (4, 8, 3, 3), 0, True),   # 169 / 121
])
def test_conv2d_input_grad_takes_the_flipped_convolution_where_it_pays(
        monkeypatch: pytest.MonkeyPatch, x_shape: tuple[int, ...], w_shape: tuple[int, ...],
        pad: int, flipped: bool) -> None:
    rng = np.random.default_rng(1)
    tape, x = _leaf(tg.Tape(), rng.standard_normal(x_shape), grad=True)
    tape, w = _leaf(tape, rng.standard_normal(w_shape))
    tape, y = tg.conv2d(tape, x, w, padding=pad)
    tape, s = tg.sum(tape, y)
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    tg.backward(tape, s, wrt=[x])
    assert ("conv_flip" in names) == flipped and ("col2im" in names) != flipped


def test_conv2d_input_grad_with_nan_and_inf_weights_matches_col2im(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # conv_flip writes 0 for a NaN or inf weight and conv_dgrad_fix computes its channel's
    # planes again as col2im's sums: NaN and inf exactly where col2im has them, random masks.
    rng = np.random.default_rng(11)
    window = conv.Window(6, 9, 3, 3, 1, 1, 1, 1)
    for trial in range(12):
        g: Array = rng.standard_normal((2, 3, window.oh, window.ow))
        w: Array = rng.standard_normal((3, 2, 3, 3))
        w.flat[rng.choice(w.size, 1 + trial % 3, replace=False)] = (
            [np.nan, np.inf, -np.inf][trial % 3])
        if trial % 4 == 3:
            g[0, 1, 2, 4] = np.nan
        fast, by_cols, _ = _input_grad_both_ways(monkeypatch, g, w, window)
        np.testing.assert_array_equal(np.isnan(fast), np.isnan(by_cols))
        np.testing.assert_array_equal(np.isinf(fast), np.isinf(by_cols))
        assert np.isfinite(fast).any() and not np.isfinite(fast).all()
        finite = np.isfinite(by_cols)
        np.testing.assert_allclose(fast[finite], by_cols[finite], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(fast[~finite], by_cols[~finite])
    # The reviewer's case: an inf weight meeting an inf in g is inf, as in col2im and PyTorch
    # (with the weight zeroed in the flipped product, 0 * inf had made it NaN).
    g = np.zeros((1, 1, 3, 3))
    w = np.zeros((1, 2, 3, 3))
    g[0, 0, 1, 1] = w[0, 0, 1, 1] = np.inf
    fast, by_cols, _ = _input_grad_both_ways(monkeypatch, g, w, conv.Window(3, 3, 3, 3, 1, 1, 1,
                                                                             1))
    assert fast[0, 0, 1, 1] == np.inf
    np.testing.assert_array_equal(fast, by_cols)


@pytest.mark.parametrize(("x_shape", "w_shape"), [((4, 1, 4, 4), (2, 1, 3, 3)),
                                              ((8, 1, 3, 3), (3, 1, 2, 2))])
def test_a_small_split_product_writes_blocks_that_are_not_whole_halves(
        monkeypatch: pytest.MonkeyPatch, x_shape: tuple[int, ...], w_shape: tuple[int, ...]
        ) -> None:
    """The patch product's C written batch-major in blocks of S = 4 outputs (n = 16: whole
    panels in place): a tiny product goes to the panel kernel only where each 8-column half
    stays in one block, else to mm_small, which writes any S (a review found the panel
    kernel given S = 4: cells never written)."""
    rng = np.random.default_rng(12)
    x: Array = rng.standard_normal(x_shape)
    w: Array = rng.standard_normal(w_shape)
    monkeypatch.setattr(tg.default_device(), "is_gpu", True)
    tape, ids = _ids(x, w)
    tape, y = tg.conv2d(tape, ids[0], ids[1])
    np.testing.assert_allclose(tg.value(tape, y).numpy(), conv2d_ref(x, w, None, 1, 0),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stride", [1, 2])
def test_conv2d_on_a_gpu_runs_as_im2col_and_the_product(
        monkeypatch: pytest.MonkeyPatch, stride: int) -> None:
    # conv_panel and conv_wgrad are CPU kernels: a GPU device takes the patch matrix and the
    # product's kernels for the forward and the weight's gradient, with the same values.
    rng = np.random.default_rng(6)
    x: Array = rng.standard_normal((2, 3, 9, 8))
    w: Array = rng.standard_normal((4, 3, 3, 3))
    r: Array = rng.standard_normal((2, 4, 9 // stride + (stride == 2), 8 // stride))

    def run() -> tuple[Array, Array, Array]:
        tape, xi = _leaf(tg.Tape(), x, grad=True)
        tape, wi = _leaf(tape, w, grad=True)
        tape, ri = _leaf(tape, r)
        tape, y = tg.conv2d(tape, xi, wi, stride=stride, padding=1)
        tape, yr = tg.mul(tape, y, ri)
        tape, s = tg.sum(tape, yr)
        grads = tg.backward(tape, s)
        return tg.value(tape, y).numpy(), grads[xi].numpy(), grads[wi].numpy()

    names: list[str] = []
    on_launch(monkeypatch, names.append)
    cpu = run()
    # four output channels at stride 1: the weight's gradient by conv_wgrad_few4
    wgrad = "conv_wgrad_few4" if stride == 1 else "conv_wgrad"
    # rows of 8 outputs at stride 1: the patches read in place
    assert ("conv_direct" if stride == 1 else "conv_panel") in names and wgrad in names
    names.clear()
    monkeypatch.setattr(tg.default_device(), "is_gpu", True)
    gpu = run()
    assert not any(name.startswith(("conv_panel", "conv_direct", "conv_wgrad"))
                   for name in names)
    assert "im2col_each" in names and "col2im_each" in names
    for a, b in zip(cpu, gpu, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cpu[0], conv2d_ref(x, w, None, stride, 1), rtol=1e-12)


@pytest.mark.parametrize(("x_shape", "kernel", "stride", "padding"), [
    ((2, 3, 9, 8), (3, 3), 1, 1), ((2, 3, 9, 8), (3, 3), 2, 1), ((1, 2, 7, 7), (2, 2), 2, 0),
    ((3, 1, 5, 6), (1, 1), 1, 0), ((2, 2, 6, 5), (5, 3), 3, 2), ((1, 1, 2, 2), (3, 3), 1, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_gpu_patch_kernels_give_the_per_plane_kernels_bits(
        monkeypatch: pytest.MonkeyPatch, x_shape: tuple[int, int, int, int],
        kernel: tuple[int, int], stride: int, padding: int, dtype: Any) -> None:
    """im2col_each and col2im_each (a work-item per element, a GPU's) write what im2col and
    col2im (a work-item per plane, the CPU's) write, bit for bit: col2im_each adds an
    element's entries in col2im's order."""
    rng = np.random.default_rng(3)
    n, c, h, w = x_shape
    win = conv.Window(h, w, *kernel, stride, stride, padding, padding)
    x = tg.AnyTensor.from_numpy(rng.standard_normal(x_shape).astype(dtype))
    cols = tg.AnyTensor.from_numpy(rng.standard_normal(
        (c * win.kh * win.kw, n * win.oh * win.ow)).astype(dtype))
    dev = tg.default_device()
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    plane = (conv._im2col(dev, x, win).numpy(), conv._col2im(dev, cols, n, c, win).numpy())
    monkeypatch.setattr(dev, "is_gpu", True)
    each = (conv._im2col(dev, x, win).numpy(), conv._col2im(dev, cols, n, c, win).numpy())
    assert names == ["im2col", "col2im", "im2col_each", "col2im_each"]
    patches: Array = np.zeros((n, c, win.kh, win.kw, win.oh, win.ow), dtype)
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    for ki in range(win.kh):
        for kj in range(win.kw):
            patches[:, :, ki, kj] = padded[:, :, ki:ki + stride * win.oh:stride,
                                           kj:kj + stride * win.ow:stride]
    np.testing.assert_array_equal(
        plane[0], patches.transpose(1, 2, 3, 0, 4, 5).reshape(plane[0].shape))
    for a, b in zip(plane, each, strict=True):
        np.testing.assert_array_equal(a, b)


def _wide(device: Any, dtype: Any) -> bool:
    return True


def _narrow(device: Any, dtype: Any) -> bool:
    return False


def _never(win: conv.Window) -> bool:
    return False


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize(("x_shape", "w_shape", "pad"), [
    ((2, 3, 9, 16), (5, 3, 3, 3), 1),        # rows of two groups, the first window padded
    ((16, 16, 32, 32), (16, 16, 3, 3), 1),   # the ResNet's first block
    ((2, 4, 9, 9), (9, 4, 2, 2), 0),         # no padding: x read as it is (no pad_planes)
    ((1, 30, 12, 24), (24, 30, 5, 5), 2),    # k = 750: three chunks of k
    ((3, 2, 5, 8), (3, 2, 3, 3), (2, 1)),    # more padding than the window needs across
])
def test_conv_read_in_place_gives_the_gathered_patches_bits(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], pad: Any, wide: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At stride 1 with output rows of whole groups of 8, `conv_direct` (x zero-padded first
    by `pad_planes`) reads each group's patch entries where they lie in x: the products of the
    gathered chunks in their order, so the same bits, forward and x's gradient (the flipped
    convolution over g), at either panel width, forced here on any device."""
    from tapegrad._jit import sweep_replays
    from tapegrad._ops import linalg

    rng = np.random.default_rng(sum(x_shape))
    x: Array = rng.standard_normal(x_shape).astype(np.float32)
    w: Array = rng.standard_normal(w_shape).astype(np.float32)
    b: Array = rng.standard_normal(w_shape[0]).astype(np.float32)
    outs: list[list[Array]] = []
    names: list[str] = []
    for direct in (False, True):
        with monkeypatch.context() as patch:
            on_launch(patch, names.append)
            patch.setattr(linalg, "wide_panels", _wide if wide else _narrow)
            patch.setattr(sweep_replays, "enabled", False)
            if not direct:
                patch.setattr(conv, "_direct", _never)
            names.clear()
            tape, ids = _ids(x, w, b)
            tape, y = tg.conv2d(tape, ids[0], ids[1], ids[2], padding=pad)
            tape, total = tg.sum(tape, y)
            grads = tg.backward(tape, total, wrt=list(ids))
            outs.append([tg.value(tape, y).numpy(), *(grads[i].numpy() for i in ids)])
    # the forward, and x's gradient where it is the flipped convolution (8 channels or more)
    assert names.count("conv_direct32" if wide else "conv_direct") == 1 + ("conv_flip" in names)
    assert "conv_flip" in names or x_shape[1] < 8
    for gathered, direct_out in zip(*outs, strict=True):
        assert gathered.tobytes() == direct_out.tobytes()
    np.testing.assert_allclose(outs[1][0], conv2d_ref(x, w, b, 1, pad), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("x_shape", "w_shape", "stride", "pad"), [
    ((2, 3, 9, 11), (5, 3, 3, 3), 1, 1), ((16, 16, 32, 32), (32, 16, 3, 3), 1, 1),
    ((3, 8, 7, 13), (20, 8, 3, 3), 2, 1), ((2, 4, 5, 5), (9, 4, 2, 2), 1, 0),
    ((1, 16, 30, 31), (24, 16, 5, 5), 1, 2)])
def test_conv_panels_of_32_give_the_bits_of_panels_of_16(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: int, pad: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device's vectors hold 16 floats, float32 convolutions take `conv_panel32`
    (four groups of 8 columns a panel, rows of two 16-wide registers): the same sums in the
    same order as conv_panel, so the same bits, forward and x's gradient (the flipped
    convolution), forced here either way on any device; ragged rows, strides, padding."""
    from tapegrad._jit import sweep_replays
    from tapegrad._ops import linalg

    rng = np.random.default_rng(sum(x_shape))
    x: Array = rng.standard_normal(x_shape).astype(np.float32)
    w: Array = rng.standard_normal(w_shape).astype(np.float32)
    b: Array = rng.standard_normal(w_shape[0]).astype(np.float32)
    outs: list[list[Array]] = []
    names: list[str] = []
    for wide in (False, True):
        with monkeypatch.context() as patch:
            on_launch(patch, names.append)
            patch.setattr(linalg, "wide_panels", _wide if wide else _narrow)
            patch.setattr(sweep_replays, "enabled", False)
            patch.setattr(conv, "_direct", _never)  # the gathering kernels (conv_direct: below)
            tape, ids = _ids(x, w, b)
            tape, y = tg.conv2d(tape, ids[0], ids[1], ids[2], stride=stride, padding=pad)
            tape, total = tg.sum(tape, y)
            grads = tg.backward(tape, total, wrt=list(ids))
            outs.append([tg.value(tape, y).numpy(), *(grads[i].numpy() for i in ids)])
    assert "conv_panel32" in names
    for narrow_out, wide_out in zip(*outs, strict=True):
        assert narrow_out.tobytes() == wide_out.tobytes()
    np.testing.assert_allclose(outs[1][0], conv2d_ref(x, w, b, stride, pad), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv_panel_loads_across_a_row_end_and_keeps_what_lies_beside_it_out(
        dtype: type) -> None:
    # 13 columns: each output row's second half of 8 reads past the input row's end (into the
    # next row, or the next plane), its lanes there selected to 0. A NaN or inf at a row's
    # start or end must reach exactly the outputs whose windows hold it.
    rng = np.random.default_rng(5)
    x: Array = rng.standard_normal((2, 2, 4, 13)).astype(dtype)
    x[0, 0, 1, 0] = np.nan
    x[0, 1, 2, 12] = np.inf
    x[1, 0, 0, 0] = -np.inf
    w: Array = rng.standard_normal((3, 2, 3, 3)).astype(dtype)
    tape, ids = _ids(x, w)
    tape, y = tg.conv2d(tape, ids[0], ids[1], padding=1)
    got = tg.value(tape, y).numpy()
    want = conv2d_ref(x, w, None, 1, 1)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isfinite(got).sum() == np.isfinite(want).sum() > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_pool_2x2_fast_path_matches_the_general_kernel(
        monkeypatch: pytest.MonkeyPatch, dtype: type) -> None:
    # Ties (values from a small set), NaNs and odd plane sizes (the last row and column belong
    # to no window): the fast kernel picks the same positions and values, to the bit.
    rng = np.random.default_rng(7)
    x: Array = rng.integers(0, 3, (3, 2, 7, 5)).astype(dtype)
    x[0, 0, 1, 1] = x[1, 1, 4, 2] = x[2, 0, 0, 0] = x[2, 0, 0, 1] = np.nan
    r: Array = rng.standard_normal((3, 2, 3, 2)).astype(dtype)

    def run() -> tuple[Array, Array, Array]:
        tape, xi = _leaf(tg.Tape(), x, grad=True)
        tape, ri = _leaf(tape, r)
        tape, y = tg.max_pool2d(tape, xi, 2)
        tape, yr = tg.mul(tape, y, ri)
        tape, loss = tg.sum(tape, yr)
        at = tg.value(tape, tape[y].parents[1]).numpy()
        return at, tg.value(tape, y).numpy(), tg.backward(tape, loss)[xi].numpy()

    names: list[str] = []
    on_launch(monkeypatch, names.append)
    fast = run()
    monkeypatch.setattr(conv, "FAST_2X2", False)
    general = run()
    assert "max_pool2x2_argmax" in names and "max_pool2d_argmax" in names
    np.testing.assert_array_equal(fast[0], general[0])
    np.testing.assert_array_equal(fast[1], general[1])  # NaN where both have NaN
    np.testing.assert_array_equal(fast[2], general[2])
    assert np.isnan(fast[1][0, 0, 0, 0]) and fast[0][0, 0, 0, 0] == 1 * 5 + 1


def test_avg_pool_counts_the_padding() -> None:
    y, g = _pool_grad(tg.avg_pool2d, np.ones((1, 1, 3, 3)), 3, stride=1, padding=1)
    np.testing.assert_allclose(y[0, 0], np.array([[4, 6, 4], [6, 9, 6], [4, 6, 4]]) / 9)
    # each element lies in the windows of its 3x3 neighbourhood, clipped to the output
    np.testing.assert_allclose(g[0, 0], np.array([[4, 6, 4], [6, 9, 6], [4, 6, 4]]) / 9)


# --- second order -----------------------------------------------------------------------------


def _squared_grads(op: Callable[..., tuple[tg.Tape, tg.Id]]
                   ) -> Callable[..., tuple[tg.Tape, tg.Id]]:
    """f(ids) = sum of squares of the recorded gradients of sum(tanh(op(ids)))."""
    def f(tape: tg.Tape, *ids: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, y = op(tape, *ids)
        tape, y = tg.tanh(tape, y)
        tape, loss = tg.sum(tape, y)
        tape, grads = tg.backward_on_tape(tape, loss, list(ids))
        total: tg.Id | None = None
        for i in ids:
            tape, sq = tg.mul(tape, grads[i], grads[i])
            tape, s = tg.sum(tape, sq)
            tape, total = (tape, s) if total is None else tg.add(tape, total, s)
        assert total is not None
        return tape, total
    return f


@pytest.mark.parametrize(("x_shape", "stride"), [((2, 2, 5, 4), (2, 1)), ((2, 2, 3, 9), 1)])
def test_conv2d_second_order_gradcheck(x_shape: tuple[int, ...], stride: int | tuple[int, int],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # conv_panel's rows of 10 outputs at stride 1 (8 in vector lanes and a tail) and of
    # strided loads at stride 2; x's cotangent is conv_panel over g with the weight flipped at
    # stride 1 (allowed here at 2 channels), col2im(w^T g) at stride 2: both to second order.
    monkeypatch.setattr(conv, "DGRAD_MIN_CHANNELS", 1)
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    rng = np.random.default_rng(2)
    x, w, b = rng.standard_normal(x_shape), rng.standard_normal((2, 2, 3, 2)), \
        rng.standard_normal(2)

    def conv_op(t: tg.Tape, xi: tg.Id, wi: tg.Id, bi: tg.Id) -> tuple[tg.Tape, tg.Id]:
        return tg.conv2d(t, xi, wi, bi, stride=stride, padding=1)

    f = _squared_grads(conv_op)
    assert tg.gradcheck(f, x, w, b)
    tape = tg.Tape()
    ids: list[tg.Id] = []
    for a in (x, w, b):
        tape, i = _leaf(tape, a, grad=True)
        ids.append(i)
    tape, out = f(tape, *ids)
    ops = [node.op for node in tape]
    # the first-order sweep: the weight's and x's gradients, one primitive each, no patch
    # matrix node
    assert "conv2d_weight_grad" in ops and "conv2d_input_grad" in ops
    assert "im2col" not in ops and "col2im" not in ops and ops.count("conv2d") == 1
    grads = tg.backward(tape, out)  # the VJPs of those run in this sweep
    assert set(grads) == set(ids)
    assert ("conv_flip" in names) == (stride == 1)


@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("norm", ["layer_norm", "batch_norm", "batch_norm_2d"])
def test_norm_second_order_gradcheck(norm: str, affine: tuple[bool, bool]) -> None:
    """The norms and their VJPs (layer_norm_grad, batch_norm_grad, batch_norm_weight_grad) are
    one kernel each; the VJPs' own VJPs are made of primitives and those kernels: checked on
    groups of 8 and more (the kernels' vector part) and a tail; batch norm of (N, C) too (the
    column kernels: 8 channels and a tail of 3, over a block of rows and a tail)."""
    rng = np.random.default_rng(4)
    shape, size = {"layer_norm": ((3, 11), 11), "batch_norm": ((3, 2, 9), 2),
                   "batch_norm_2d": ((18, 11), 11)}[norm]
    arrays = [rng.standard_normal(shape) * 2.0 + 1.0]
    arrays += [rng.standard_normal(size) for flag in affine if flag]
    fn = tg.layer_norm if norm == "layer_norm" else tg.batch_norm

    def op(t: tg.Tape, xi: tg.Id, *wb: tg.Id) -> tuple[tg.Tape, tg.Id]:
        given = iter(wb)
        weight = next(given) if affine[0] else None
        bias = next(given) if affine[1] else None
        return fn(t, xi, weight, bias, eps=0.01)

    assert tg.gradcheck(_squared_grads(op), *arrays)


@pytest.mark.parametrize(("norm", "shape"), [("layer_norm", (3, 0)), ("batch_norm", (0, 3)),
                                           ("batch_norm", (2, 3, 0))])
def test_norms_of_empty_tensors_have_empty_or_zero_gradients(norm: str, shape: tuple[int, ...]
                                                               ) -> None:
    fn = tg.layer_norm if norm == "layer_norm" else tg.batch_norm
    size = shape[-1] if norm == "layer_norm" else shape[1]

    def op(t: tg.Tape, xi: tg.Id, wi: tg.Id) -> tuple[tg.Tape, tg.Id]:
        return fn(t, xi, wi)

    f = _squared_grads(op)
    tape, xi = _leaf(tg.Tape(), np.zeros(shape), True)
    tape, wi = _leaf(tape, np.ones(size), True)
    tape, out = f(tape, xi, wi)
    grads = tg.backward(tape, out)  # second order through the norms' VJPs
    assert grads[xi].numpy().shape == shape
    np.testing.assert_array_equal(grads[wi].numpy(), np.zeros(size))


@pytest.mark.parametrize("items", [None, 4, 64])
@pytest.mark.parametrize("shape", [(300, 5), (16, 4, 8, 8), (3, 2, 130), (1, 3, 1, 1),
                                   (40, 19), (33, 8, 1)])
def test_batch_norm_kernel_against_numpy(shape: tuple[int, ...], items: int | None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A channel's elements shared among the work-group's items in runs along the spatial
    axes: one element per sample (2-D), runs within a sample, runs longer than a share, a
    single element; float32 from a mean far from 0. Gradients in float64 against numpy's.
    With this device's items per channel (one on a CPU with enough channels), and with 4 and
    a GPU's 64, which take (N, C) too. One element per channel and sample ((N, C), or size-1
    spatial axes) on a CPU is the column kernels': groups of 8 channels, the rest one by one,
    blocks of 16 rows."""
    if items is not None:
        def fixed(dev: object, channels: int, spatial: int) -> int:
            return items
        monkeypatch.setattr(nn_ops, "_bn_items", fixed)
    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape) * 3.0 + 100.0
    w, b = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    g = rng.standard_normal(shape)
    axes = (0, *range(2, len(shape)))
    along = (1, shape[1], *([1] * (len(shape) - 2)))
    mu = x.mean(axes, keepdims=True)
    r = 1.0 / np.sqrt(((x - mu) ** 2).mean(axes, keepdims=True) + 1e-5)
    xh = (x - mu) * r
    want = xh * w.reshape(along) + b.reshape(along)
    for dtype, tol in ((np.float32, 3e-5), (np.float64, 1e-12)):
        tape, xi = _leaf(tg.Tape(), x.astype(dtype), True)
        tape, wi = _leaf(tape, w.astype(dtype), True)
        tape, bi = _leaf(tape, b.astype(dtype), True)
        tape, y = tg.batch_norm(tape, xi, wi, bi)
        assert [node.op for node in tape][-1] == "batch_norm"
        np.testing.assert_allclose(tg.value(tape, y).numpy(), want, rtol=tol, atol=tol)
        if dtype == np.float64:
            tape, gi = _leaf(tape, g)
            tape, yg = tg.mul(tape, y, gi)
            tape, loss = tg.sum(tape, yg)
            grads = tg.backward(tape, loss, wrt=[xi, wi, bi])
            gw = g * w.reshape(along)
            dx = r * (gw - gw.mean(axes, keepdims=True)
                      - xh * (gw * xh).mean(axes, keepdims=True))
            np.testing.assert_allclose(grads[xi].numpy(), dx, rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose(grads[wi].numpy(), (g * xh).sum(axes), rtol=1e-10)
            np.testing.assert_allclose(grads[bi].numpy(), g.sum(axes), rtol=1e-12)


@pytest.mark.parametrize("shape", [(4, 300), (2, 3, 8), (5,)])
def test_layer_norm_kernel_against_numpy(shape: tuple[int, ...]) -> None:
    """Long rows (blocks of the compensated sums), whole groups of 8 and a 1-D x, in float32,
    from a mean far from 0 (the two-pass variance)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(shape) + 100.0).astype(np.float32)
    w, b = rng.standard_normal(shape[-1]), rng.standard_normal(shape[-1])
    tape, xi = _leaf(tg.Tape(), x)
    tape, wi = _leaf(tape, w.astype(np.float32))
    tape, bi = _leaf(tape, b.astype(np.float32))
    tape, y = tg.layer_norm(tape, xi, wi, bi)
    assert [node.op for node in tape][-1] == "layer_norm"
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    want = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(tg.value(tape, y).numpy(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("pool", [tg.max_pool2d, tg.avg_pool2d])
def test_pool_second_order_gradcheck(pool: Callable[..., tuple[tg.Tape, tg.Id]]) -> None:
    def op(t: tg.Tape, xi: tg.Id) -> tuple[tg.Tape, tg.Id]:
        return pool(t, xi, 3, stride=(1, 2), padding=1)

    assert tg.gradcheck(_squared_grads(op), np.random.default_rng(3).standard_normal((1, 2, 5, 4)))


# --- determinism and the kernel cache ----------------------------------------------------------


def _conv_step(n: int, h: int, seed: int) -> list[Array]:
    rng = np.random.default_rng(seed)
    tape, x = _leaf(tg.Tape(), rng.standard_normal((n, 3, h, h + 2)).astype(np.float32), True)
    tape, w = _leaf(tape, rng.standard_normal((4, 3, 3, 2)).astype(np.float32), True)
    tape, b = _leaf(tape, rng.standard_normal(4).astype(np.float32), True)
    tape, y = tg.conv2d(tape, x, w, b, stride=2, padding=1)
    tape, y = tg.max_pool2d(tape, y, 2, padding=1)
    tape, y = tg.avg_pool2d(tape, y, (1, 2))
    tape, y = tg.dropout(tape, y, 0.25, seed)
    tape, y = tg.batch_norm(tape, y)
    tape, loss = tg.sum(tape, y)
    grads = tg.backward(tape, loss)
    return [grads[i].numpy() for i in (x, w, b)]


def test_conv_and_pool_gradients_are_bitwise_deterministic() -> None:
    first, second = _conv_step(3, 9, 0), _conv_step(3, 9, 0)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_nn_ops_build_no_programs_for_new_sizes() -> None:
    # Batches of at least 2: at 1 some broadcasts are no-ops, a different structure, whose
    # fused kernel may then be built on its third sighting (counted across earlier tests).
    device = tg.default_device()
    warm_up(device, lambda: _conv_step(2, 7, 0))
    before = device.builds
    for n, h in ((3, 5), (4, 11), (2, 30)):
        _conv_step(n, h, n)
    assert device.builds == before


# --- errors -----------------------------------------------------------------------------------


def _ids(*arrays: Array) -> tuple[tg.Tape, list[tg.Id]]:
    tape = tg.Tape()
    ids: list[tg.Id] = []
    for a in arrays:
        tape, i = _leaf(tape, a)
        ids.append(i)
    return tape, ids


def test_conv2d_errors_name_the_argument_and_record_nothing() -> None:
    f32 = np.float32
    tape, (x, w, w5, b, b64, x2) = _ids(
        np.ones((2, 3, 7, 5), f32), np.ones((4, 4, 3, 2), f32), np.ones((4, 3, 9, 2), f32),
        np.ones(5, f32), np.ones(4), np.ones((7, 5), f32))
    size = len(tape)
    cases: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (tg.ShapeError, r"conv2d: x has 3 channels \(x.shape\[1\]\) but w expects 4 "
         r"\(w.shape\[1\]\)", lambda: tg.conv2d(tape, x, w)),
        (tg.ShapeError, r"conv2d: x must be \(N, C, H, W\) or unbatched \(C, H, W\), got shape "
         r"\(7, 5\)", lambda: tg.conv2d(tape, x2, w)),
        (tg.ShapeError, r"conv2d: the kernel \(9, 2\) is larger than the padded input \(7, 5\)",
         lambda: tg.conv2d(tape, x, w5)),
        (tg.ShapeError, r"conv2d: b must have shape \(4,\)", lambda: tg.conv2d(
            tape, x, w5, b, padding=2)),
        (tg.DTypeError, "conv2d: x is float32 but b is float64", lambda: tg.conv2d(
            tape, x, w5, b64, padding=2)),
        (tg.ShapeError, "conv2d: stride must be at least 1, got 0",
         lambda: tg.conv2d(tape, x, w5, stride=0, padding=2)),
        (tg.ShapeError, r"conv2d: padding must be an int or a pair of ints, got \(1, 2, 3\)",
         lambda: tg.conv2d(tape, x, w5, padding=(1, 2, 3))),
        (tg.ShapeError, r"conv2d: w must be 4-D \(out, in, kh, kw\), got shape \(7, 5\)",
         lambda: tg.conv2d(tape, x, x2)),
    ]
    for kind, pattern, call in cases:
        with pytest.raises(kind, match=pattern) as info:
            call()
        assert "test_ops_nn.py" in str(info.value)
    assert len(tape) == size


def test_pool_errors() -> None:
    tape, (x, x2) = _ids(np.ones((1, 2, 5, 5), np.float32), np.ones((5, 5), np.float32))
    with pytest.raises(tg.ShapeError, match=r"max_pool2d: padding \(2, 2\) must be at most half "
                       r"the kernel size \(3, 3\)"):
        tg.max_pool2d(tape, x, 3, padding=2)
    with pytest.raises(tg.ShapeError, match=r"avg_pool2d: x must be \(N, C, H, W\)"):
        tg.avg_pool2d(tape, x2, 2)
    with pytest.raises(tg.ShapeError, match=r"avg_pool2d: the kernel \(6, 1\) is larger"):
        tg.avg_pool2d(tape, x, (6, 1))
    with pytest.raises(tg.ShapeError, match="max_pool2d: kernel_size must be at least 1"):
        tg.max_pool2d(tape, x, (2, 0))
    assert len(tape) == 2


def test_linear_and_norm_errors() -> None:
    f32 = np.float32
    tape, (x, w, b, c) = _ids(np.ones((2, 3, 4), f32), np.ones((3, 5), f32), np.ones(4, f32),
                              np.ones(3, f32))
    with pytest.raises(tg.ShapeError, match=r"linear: x has 4 features \(x.shape\[-1\]\) but w "
                       r"expects 3 \(w.shape\[0\]\)"):
        tg.linear(tape, x, w)
    with pytest.raises(tg.ShapeError, match=r"linear: b must have shape \(5,\) \(out\), got "
                       r"\(4,\)"):
        tg.linear(tape, c, w, b)
    with pytest.raises(tg.ShapeError, match=r"layer_norm: weight must have shape \(4,\) \(the "
                       r"last axis of x\), got \(3,\)"):
        tg.layer_norm(tape, x, c)
    with pytest.raises(tg.ShapeError, match=r"batch_norm: bias must have shape \(3,\) \(the "
                       r"channels, x.shape\[1\]\), got \(4,\)"):
        tg.batch_norm(tape, x, c, b)
    with pytest.raises(tg.ShapeError, match=r"batch_norm: x must be .* at least 2 axes"):
        tg.batch_norm(tape, c)
    with pytest.raises(tg.TapegradError, match="layer_norm: eps must be a number >= 0"):
        tg.layer_norm(tape, x, eps=-1.0)
    assert len(tape) == 4


@pytest.mark.skipif(tg.default_device().is_gpu,
                    reason="conv_wgrad and conv_wgrad16 serve CPU devices; a GPU's weight "
                           "gradient is a product (mm_tiled)")
@pytest.mark.parametrize(("x_shape", "out_channels", "padding", "stride"), [
    ((16, 16, 32, 32), 16, 1, 1),  # the ResNet's first block
    ((4, 32, 16, 16), 32, 1, 1),   # two panels of channels
    ((3, 3, 17, 19), 24, 1, 1),    # a stem's few rows (27), a last panel of 8 channels
    ((5, 13, 12, 12), 40, 0, 2),   # stride 2, no padding; rows past the last group of 8
])
def test_the_sixteen_lane_weight_gradient_gives_the_eight_lane_ones_bits(
        monkeypatch: pytest.MonkeyPatch, x_shape: tuple[int, int, int, int], out_channels: int,
        padding: int, stride: int) -> None:
    """conv_wgrad16 (float32 where vectors hold 16 floats) sums each channel's lane in
    conv_wgrad's order, chunks of KC positions included: the same bits, on any device (its
    16-lane vectors are the compiler's to split where they are wider than the machine's);
    and both are the float64 sums' to float32's rounding."""
    rng = np.random.default_rng(12)
    n, c, h, w = x_shape
    oh, ow = (h + 2 * padding - 3) // stride + 1, (w + 2 * padding - 3) // stride + 1
    x = rng.standard_normal(x_shape).astype(np.float32)
    g = rng.standard_normal((n, out_channels, oh, ow)).astype(np.float32)

    def loss(tape: tg.Tape, xi: tg.Id, wi: tg.Id, gi: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, y = tg.conv2d(tape, xi, wi, stride=stride, padding=padding)
        tape, z = tg.mul(tape, y, gi)
        return tg.sum(tape, z)

    weights = np.zeros((out_channels, c, 3, 3), np.float32)
    launched: list[str] = []
    on_launch(monkeypatch, launched.append)
    by_kernel: dict[str, np.ndarray[Any, Any]] = {}
    for name in ("conv_wgrad16", "conv_wgrad"):
        def named(dev: tg.Device, dtype: Any, name: str = name) -> str:
            return name

        monkeypatch.setattr(conv, "_wgrad_name", named)
        launched.clear()
        by_kernel[name] = tg.grad(loss, argnums=1)(x, weights, g).numpy()
        assert name in launched
    np.testing.assert_array_equal(by_kernel["conv_wgrad16"], by_kernel["conv_wgrad"])
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (padding,) * 2, (padding,) * 2))
    patches = np.stack([padded[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
                        for i in range(3) for j in range(3)], axis=2)
    exact = np.einsum("nohw,nckhw->ock", g.astype(np.float64), patches)
    np.testing.assert_allclose(by_kernel["conv_wgrad16"], exact.reshape(weights.shape),
                               rtol=1e-4, atol=1e-4 * np.sqrt(n * oh * ow))


@pytest.mark.skipif(tg.default_device().is_gpu,
                    reason="conv_wgrad_few serves CPU devices; a GPU's weight gradient is a "
                           "product (mm_tiled), whose blocks of k are added in order")
@pytest.mark.parametrize("width", [7, 15])  # all positions past the last group of 8; some
def test_the_weight_gradient_of_few_channels_sums_in_chunks(width: int) -> None:
    """conv_wgrad_few's float32 sums over 229k positions (a 1x1 window, one output channel)
    stay within float32's chunked sums of the float64 ones: a row's last positions go into
    the chunks with the lanes' (summed apart over every row, they drifted to 2.5e-5)."""
    rng = np.random.default_rng(8)
    # float32's values, summed exactly (nearly) in float64
    x = rng.uniform(0.5, 1.5, (32, 1, 1024, width)).astype(np.float32).astype(np.float64)
    g = rng.uniform(0.5, 1.5, (32, 1, 1024, width)).astype(np.float32).astype(np.float64)

    def loss(tape: tg.Tape, xi: tg.Id, wi: tg.Id, gi: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, y = tg.conv2d(tape, xi, wi)
        tape, z = tg.mul(tape, y, gi)
        return tg.sum(tape, z)

    w = np.zeros((1, 1, 1, 1))
    grad = tg.grad(loss, argnums=1)
    exact = float(grad(x, w, g).numpy().item())
    approx = float(grad(*(a.astype(np.float32) for a in (x, w, g))).numpy().item())
    assert abs(approx - exact) / exact < 2e-7, (approx, exact)
