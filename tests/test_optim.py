"""Optimizers on the device against PyTorch's update rules written in numpy."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import numpy as np
import pytest

import tapegrad as tg
from cases import on_launch
from tapegrad import _kernels, _optim


def test_sgd_momentum_weight_decay_matches_reference() -> None:
    rng = np.random.default_rng(0)
    p = rng.standard_normal((3, 2))
    params = {"w": tg.AnyTensor.from_numpy(p)}
    state = None
    ref_p, buf = p.copy(), np.zeros_like(p)
    for _ in range(4):
        g = rng.standard_normal((3, 2))
        params, state = tg.optim.sgd(params, {"w": g}, state, lr=0.1, momentum=0.9,
                                     weight_decay=0.01)
        d = g + 0.01 * ref_p
        buf = 0.9 * buf + d
        ref_p = ref_p - 0.1 * buf
    np.testing.assert_allclose(params["w"].numpy(), ref_p, rtol=1e-12)


def test_adam_matches_reference_and_is_pure() -> None:
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(5).astype(np.float32)
    start = tg.AnyTensor.from_numpy(p0)
    params: list[tg.AnyTensor] = [start]
    state = None
    ref, m, v = p0.astype(np.float64), np.zeros(5), np.zeros(5)
    for t in range(1, 6):
        g = rng.standard_normal(5).astype(np.float32)
        params, state = tg.optim.adam(params, [g], state, lr=0.01)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g.astype(np.float64) ** 2
        ref = ref - 0.01 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    assert state is not None and state["step"] == 5
    np.testing.assert_allclose(params[0].numpy(), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(start.numpy(), p0)  # the old parameter is unchanged



def test_twenty_sgd_steps_match_float64_numpy_trajectory() -> None:
    """An end-to-end training run: forward, backward and update all on the device."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 4))
    y = rng.standard_normal((16, 1))
    w1, b1 = rng.standard_normal((4, 8)) * 0.5, np.zeros(8)
    w2, b2 = rng.standard_normal((8, 1)) * 0.5, np.zeros(1)
    params = [tg.AnyTensor.from_numpy(a) for a in (w1, b1, w2, b2)]
    state = None
    losses: list[float] = []
    ref_losses: list[float] = []
    ref = [w1, b1, w2, b2]
    buf = [np.zeros_like(a) for a in ref]
    for _ in range(20):
        tape, xi = tg.leaf(tg.Tape(), x)
        tape, yi = tg.leaf(tape, y)
        ids: list[tg.Id] = []
        for p in params:
            tape, i = tg.leaf(tape, p, requires_grad=True)
            ids.append(i)
        tape, h = tg.matmul(tape, xi, ids[0])
        tape, h = tg.add(tape, h, ids[1])
        tape, h = tg.tanh(tape, h)
        tape, o = tg.matmul(tape, h, ids[2])
        tape, o = tg.add(tape, o, ids[3])
        tape, e = tg.sub(tape, o, yi)
        tape, sq = tg.mul(tape, e, e)
        tape, loss = tg.mean(tape, sq)
        grads = tg.backward(tape, loss)
        losses.append(float(tg.value(tape, loss).item()))
        params, state = tg.optim.sgd(params, [grads[i] for i in ids], state, lr=0.1,
                                     momentum=0.5)
        # float64 numpy reference of the same step
        rw1, rb1, rw2, rb2 = ref
        hh = np.tanh(x @ rw1 + rb1)
        oo = hh @ rw2 + rb2
        ref_losses.append(float(np.mean((oo - y) ** 2)))
        d_o = 2 * (oo - y) / oo.size
        d_h = (d_o @ rw2.T) * (1 - hh**2)
        rg = [x.T @ d_h, d_h.sum(0), hh.T @ d_o, d_o.sum(0)]
        buf = [0.5 * b + g for b, g in zip(buf, rg, strict=True)]
        ref = [r - 0.1 * b for r, b in zip(ref, buf, strict=True)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    for p, r in zip(params, ref, strict=True):
        np.testing.assert_allclose(p.numpy(), r, rtol=1e-10, atol=1e-12)
    assert losses[-1] < 0.5 * losses[0]


def test_init_shapes_seeds_and_scale() -> None:
    a = tg.nn.init.he_normal((256, 128), seed=3).numpy()
    b = tg.nn.init.he_normal((256, 128), seed=3).numpy()
    c = tg.nn.init.he_normal((256, 128), seed=4).numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert abs(a.std() - np.sqrt(2 / 256)) < 0.01 * np.sqrt(2 / 256) * 10
    u = tg.nn.init.glorot_uniform((8, 3, 3, 3), seed=0).numpy()
    bound = np.sqrt(6 / (3 * 9 + 8 * 9))
    assert u.shape == (8, 3, 3, 3) and np.abs(u).max() <= bound


@pytest.mark.parametrize(("make", "error", "words"), [
    (lambda: tg.nn.init.glorot_uniform((3, 3), seed=cast(Any, 1.5)), tg.ArgumentTypeError,
     "glorot_uniform: seed must be an int >= 0"),
    (lambda: tg.nn.init.he_uniform((3, 3), seed=-1), tg.ArgumentTypeError,
     "he_uniform: seed must be an int >= 0"),
    (lambda: tg.nn.init.glorot_normal((3, 3), seed=cast(Any, None)), tg.ArgumentTypeError,
     "glorot_normal: seed must be an int >= 0"),
    (lambda: tg.nn.init.he_normal((0, 3), seed=0), tg.ShapeError, "has a fan of 0"),
    (lambda: tg.nn.init.glorot_uniform((-3, 3), seed=0), tg.ShapeError, "negative size"),
    (lambda: tg.nn.init.glorot_uniform(cast(Any, 3), seed=0), tg.ShapeError,
     "must be a tuple of ints"),
    (lambda: tg.nn.init.glorot_uniform((3,), seed=0), tg.ShapeError,
     "glorot_uniform: a weight needs at least 2 dims"),
    (lambda: tg.nn.init.glorot_uniform((3, 3), seed=0, dtype=np.int32), tg.DTypeError,
     "dtype must be float32 or float64"),
    (lambda: tg.nn.init.glorot_uniform((3, 3), seed=0, dtype="fp32"), tg.DTypeError,
     "'fp32' is not a dtype"),
    (lambda: tg.nn.init.glorot_uniform((3, 3), seed=0, gain=cast(Any, "1")), tg.DTypeError,
     "gain must be a number"),
    (lambda: tg.nn.init.zeros(cast(Any, (3.0,))), tg.ShapeError,
     "zeros: shape must be a tuple of ints"),
    (lambda: tg.nn.init.zeros((3,), dtype=np.float16), tg.DTypeError,
     "zeros: dtype must be float32 or float64"),
])
def test_init_refuses_bad_arguments_naming_the_initialiser_and_the_call(
        make: Callable[[], object], error: type[Exception], words: str) -> None:
    """Each initialiser checks its shape, seed (an int >= 0, never None: the same seed gives
    the same tensor), gain and dtype before drawing, and says which and where."""
    with pytest.raises(error, match=re.escape(words)) as caught:
        make()
    assert "test_optim.py:" in str(caught.value)  # the lambda above: the user's call


def test_dict_grads_are_matched_by_key_not_order() -> None:
    w, b = np.ones(2), np.full(3, 2.0)
    params = {"w": tg.AnyTensor.from_numpy(w), "b": tg.AnyTensor.from_numpy(b)}
    grads = {"b": np.full(3, 1.0), "w": np.full(2, 10.0)}
    new, _ = tg.optim.sgd(params, grads, lr=0.1)
    np.testing.assert_allclose(new["w"].numpy(), w - 1.0, atol=1e-15)
    np.testing.assert_allclose(new["b"].numpy(), b - 0.1)
    import pytest

    with pytest.raises(tg.TapegradError, match="must be a dict with the keys of params"):
        tg.optim.adam(params, {"w": np.ones(2)})


def test_a_grads_tree_unlike_params_is_refused_saying_where() -> None:
    params = {"w": tg.AnyTensor.from_numpy(np.ones(2)), "b": [tg.AnyTensor.from_numpy(np.ones(3))]}
    with pytest.raises(tg.TapegradError) as info:
        tg.optim.sgd(params, {"w": np.ones(2), "b": []}, lr=0.1)
    assert str(info.value).startswith(
        "sgd: grads['b'] must be a list or tuple of 1 like params['b'], got a list of 0")
    assert "test_optim.py" in str(info.value)  # the caller's line
    with pytest.raises(tg.DTypeError, match=r"sgd: grads\['b'\]\[0\] must be an AnyTensor or a "
                       r"numpy array, got NoneType"):
        tg.optim.sgd(params, {"w": np.ones(2), "b": [None]}, lr=0.1)
    with pytest.raises(tg.TapegradError, match=r"grads\['w'\] must be a tensor like "
                       r"params\['w'\], got a dict with keys 'x'"):
        tg.optim.sgd(params, {"w": {"x": 1}, "b": [np.ones(3)]}, lr=0.1)


def test_none_leaves_of_params_pass_through_the_optimizers() -> None:
    # JAX's None, an empty subtree (a layer without a bias), in params, grads and the state.
    params = {"w": tg.AnyTensor(np.ones(2)), "b": None}
    new, state = tg.optim.sgd(params, {"w": np.full(2, 2.0), "b": None}, lr=0.5, momentum=0.9)
    assert new["b"] is None and state["momentum"]["b"] is None
    np.testing.assert_array_equal(new["w"].numpy(), [0.0, 0.0])
    new, state = tg.optim.adam(new, {"w": np.ones(2), "b": None}, lr=0.1)
    assert new["b"] is None and state["m"]["b"] is None
    np.testing.assert_allclose(new["w"].numpy(), [-0.1, -0.1])
    with pytest.raises(tg.TapegradError, match=r"sgd: grads\['b'\] must be None like "
                       r"params\['b'\], got an AnyTensor"):
        tg.optim.sgd(params, {"w": np.ones(2), "b": tg.AnyTensor(np.ones(2))}, lr=0.1)


class Layer(NamedTuple):
    w: Any
    b: Any


def test_namedtuples_keep_their_class_through_grad_and_the_optimizers() -> None:
    params = Layer(np.array([1.0, 2.0]), np.array([3.0, 4.0]))

    def loss(tape: tg.Tape, p: Layer) -> tuple[tg.Tape, tg.Id]:
        tape, y = tg.mul(tape, p.w, p.b)
        return tg.sum(tape, y)

    grads: Any = tg.grad(loss)(params)
    assert isinstance(grads, Layer)
    np.testing.assert_array_equal(grads.w.numpy(), [3.0, 4.0])
    new, state = tg.optim.sgd(params, grads, lr=0.5, momentum=0.9)
    assert isinstance(new, Layer) and isinstance(state["momentum"], Layer)
    np.testing.assert_array_equal(new.b.numpy(), [2.5, 3.0])


# Sizes across chunk edges (DENSE_CHUNK is 256) and an empty one: the slots of a launch and
# their offsets all matter. Twice over, they are more parameters than one launch takes (GROUP).
# Sizes with vectors (8 floats, 4 doubles), a few elements one by one, and both, in both
# dtypes (float64 where k % 3 == 0), across work-items' chunks of 256.
_MANY = [(300,), (1,), (0,), (256, 2), (7, 5), (513,), (3,), (2, 2), (1000,), (9,), (255,)]


def test_adam_over_many_parameters_of_two_dtypes_matches_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    p0 = [rng.standard_normal(s).astype(np.float32 if k % 3 else np.float64)
          for k, s in enumerate(_MANY)]
    launches: list[str] = []
    on_launch(monkeypatch, launches.append)
    params: list[tg.AnyTensor] = [tg.AnyTensor.from_numpy(p) for p in p0]
    state = None
    ref = [p.astype(np.float64) for p in p0]
    m = [np.zeros(p.shape) for p in p0]
    v = [np.zeros(p.shape) for p in p0]
    for t in range(1, 4):
        gs = [rng.standard_normal(p.shape).astype(p.dtype) for p in p0]
        launches.clear()
        params, state = tg.optim.adam(params, gs, state, lr=0.01)
        # 4 float64 parameters (the first dtype met), 6 float32 with elements: a launch for each
        # dtype, each of the smallest kernel that takes them
        assert launches == ["adam4", "adam8"]
        for k, g in enumerate(gs):
            m[k] = 0.9 * m[k] + 0.1 * g
            v[k] = 0.999 * v[k] + 0.001 * g.astype(np.float64) ** 2
            ref[k] = ref[k] - 0.01 * (m[k] / (1 - 0.9**t)) / (np.sqrt(v[k] / (1 - 0.999**t))
                                                                + 1e-8)
    for k, p in enumerate(params):
        tol = 1e-5 if p0[k].dtype == np.float32 else 1e-12
        assert p.shape == p0[k].shape and p.dtype == p0[k].dtype
        np.testing.assert_allclose(p.numpy(), ref[k], rtol=tol, atol=tol)


def test_sgd_over_more_parameters_than_one_launch_takes() -> None:
    rng = np.random.default_rng(8)
    p0 = [rng.standard_normal(s) for s in _MANY + _MANY]
    params = [tg.AnyTensor.from_numpy(p) for p in p0]
    state = None
    ref = [p.copy() for p in p0]
    buf = [np.zeros_like(p) for p in p0]
    for _ in range(3):
        gs = [rng.standard_normal(p.shape) for p in p0]
        params, state = tg.optim.sgd(params, gs, state, lr=0.1, momentum=0.9, weight_decay=0.01)
        for k, g in enumerate(gs):
            buf[k] = 0.9 * buf[k] + g + 0.01 * ref[k]
            ref[k] = ref[k] - 0.1 * buf[k]
    for k, p in enumerate(params):
        np.testing.assert_allclose(p.numpy(), ref[k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 9])
def test_a_launch_takes_the_smallest_kernel_that_holds_its_parameters(
        count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels over 1, 2, 4 and 8 parameters (`_optim.GROUPS`): a launch takes the smallest
    that holds its group, the unused slots updating nothing; the values are the reference's."""
    rng = np.random.default_rng(count)
    p0 = [rng.standard_normal((k % 3 + 1, 300 + k)) for k in range(count)]
    launches: list[str] = []
    on_launch(monkeypatch, launches.append)
    params: list[tg.AnyTensor] = [tg.AnyTensor.from_numpy(p) for p in p0]
    gs = [rng.standard_normal(p.shape) for p in p0]
    new, _ = tg.optim.sgd(params, gs, lr=0.1, momentum=0.9)
    want = {1: ["sgd1"], 2: ["sgd2"], 3: ["sgd4"], 5: ["sgd8"], 9: ["sgd8", "sgd1"]}[count]
    assert launches == want
    for p, g, got in zip(p0, gs, new, strict=True):
        np.testing.assert_allclose(got.numpy(), p - 0.1 * g, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_gpus_vector_per_work_item_updates_alike(monkeypatch: pytest.MonkeyPatch,
                                                   dtype: Any) -> None:
    """On a GPU a work-item updates one vector of elements (`_optim._chunk`), not a CPU
    core's chunk: run on this device's kernels, the same bits, over sizes around a vector's
    and a chunk's ends."""
    if dtype == np.float64 and not tg.default_device().has_fp64:
        pytest.skip("the device has no doubles")
    rng = np.random.default_rng(9)
    p0 = [rng.standard_normal(n).astype(dtype) for n in (1, 7, 8, 9, 255, 257, 300, 5000)]
    grads = [[rng.standard_normal(p.shape).astype(dtype) for p in p0] for _ in range(2)]

    def train(chunk: int) -> list[np.ndarray[Any, Any]]:
        def fixed(device: tg.Device) -> int:
            return chunk

        monkeypatch.setattr(_optim, "_chunk", fixed)
        params: list[tg.AnyTensor] = [tg.AnyTensor.from_numpy(p) for p in p0]
        adam_state: Any = None
        sgd_state: Any = None
        for gs in grads:
            params, adam_state = tg.optim.adam(params, gs, adam_state, lr=0.01)
            params, sgd_state = tg.optim.sgd(params, gs, sgd_state, lr=0.1, momentum=0.9,
                                             weight_decay=0.01)
        return [p.numpy() for p in params]

    by_vector, by_chunk = train(8), train(_kernels.DENSE_CHUNK)
    for a, b in zip(by_vector, by_chunk, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(by_chunk[-1], p0[-1])  # updated


def test_updates_build_their_program_once() -> None:
    device = tg.default_device()
    tg.optim.adam([tg.AnyTensor.from_numpy(np.ones(3, np.float32))],
                  [np.ones(3, np.float32)], None)
    tg.optim.sgd([tg.AnyTensor.from_numpy(np.ones(3, np.float32))],
                 [np.ones(3, np.float32)], None, lr=0.1)
    before = device.builds
    for n in (1, 300, 5000):
        ps = [tg.AnyTensor.from_numpy(np.ones(n, np.float32)) for _ in range(n % 11 + 1)]
        gs = [np.ones(n, np.float32) for _ in ps]
        tg.optim.adam(ps, gs, None)
        tg.optim.sgd(ps, gs, None, lr=0.1, momentum=0.9)
    assert device.builds == before


def test_hyperparameters_out_of_pytorchs_ranges_are_refused() -> None:
    # PyTorch refuses these too (lr, momentum, weight_decay, eps >= 0; 0 <= betas < 1).
    p = {"w": np.ones(3, np.float32)}
    bad: list[tuple[str, Any]] = [
        ("sgd: lr must be in \\[0, inf\\], got -0.1", lambda: tg.optim.sgd(p, p, lr=-0.1)),
        ("sgd: momentum must be in", lambda: tg.optim.sgd(p, p, lr=0.1, momentum=-0.9)),
        ("sgd: weight_decay must be in", lambda: tg.optim.sgd(p, p, lr=0.1, weight_decay=-1.0)),
        ("adam: lr must be in \\[0, inf\\], got nan", lambda: tg.optim.adam(p, p, lr=np.nan)),
        ("adam: b1 must be in \\[0, 1\\), got 1.0", lambda: tg.optim.adam(p, p, b1=1.0)),
        ("adam: b2 must be in \\[0, 1\\), got -0.5", lambda: tg.optim.adam(p, p, b2=-0.5)),
        ("adam: eps must be in", lambda: tg.optim.adam(p, p, eps=-1e-8)),
    ]
    for message, call in bad:
        with pytest.raises(tg.ShapeError, match=message):
            call()
    new, _ = tg.optim.sgd(p, p, lr=0.0)  # the edges are allowed
    np.testing.assert_array_equal(new["w"].numpy(), p["w"])
