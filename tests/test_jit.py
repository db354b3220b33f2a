"""tg.jit's contract as far as it is built (issue 19's front end): signatures and retracing,
static and donated arguments, results bitwise those of calling the step directly, no host
reads inside, a pytree of tensors out, a bounded cache that says when it evicts."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import _jit


def _loss(tape: tg.Tape, params: dict[str, tg.Id], x: tg.Id, y: tg.Id) -> tuple[tg.Tape, tg.Id]:
    tape, h = tg.linear(tape, x, params["w"], params["b"])
    tape, h = tg.tanh(tape, h)
    return tg.mse(tape, h, y)


def _step(params: Any, state: Any, x: Any, y: Any, lr: float) -> Any:
    loss, grads = tg.value_and_grad(_loss)(params, x, y)
    params, state = tg.optim.adam(params, grads, state, lr=lr)
    return params, state, loss


def _data(dtype: Any = np.float64) -> tuple[dict[str, tg.AnyTensor], np.ndarray[Any, Any],
                                             np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    params = {"w": tg.AnyTensor(rng.standard_normal((3, 2)).astype(dtype)),
              "b": tg.AnyTensor(np.zeros(2, dtype))}
    x = rng.standard_normal((8, 3)).astype(dtype)
    return params, x, np.tanh(x[:, :2])


def test_jitted_training_equals_eager_bitwise() -> None:
    params, x, y = _data()
    eager_params, eager_state = params, None
    jit_params, jit_state = params, None
    step = tg.jit(_step)
    for k in range(5):
        lr = 0.1 / (k + 1)  # a schedule: numbers are values, not the signature
        eager_params, eager_state, eager_loss = _step(eager_params, eager_state, x, y, lr)
        jit_params, jit_state, jit_loss = step(jit_params, jit_state, x, y, lr)
        assert jit_loss.numpy().tobytes() == eager_loss.numpy().tobytes()
        for name in ("w", "b"):
            assert jit_params[name].numpy().tobytes() == eager_params[name].numpy().tobytes()
    # the first state (None) and the later ones (a dict of moments) are two signatures
    assert step.traces == 2 and step.signatures == 2


def test_new_shapes_dtypes_and_static_values_retrace_numbers_do_not() -> None:
    calls: list[str] = []

    def f(x: Any, scale: float, mode: str) -> tg.AnyTensor:
        calls.append(mode)
        tape, i = tg.leaf(tg.Tape(), x)
        tape, out = tg.mul(tape, i, scale)
        return tg.value(tape, out)

    g = tg.jit(f, static_argnums=2)
    g(np.ones(3), 1.0, "a")
    g(np.ones(3), 2.0, "a")  # another number: the same signature
    assert g.traces == 1
    g(np.ones(4), 2.0, "a")  # another shape
    g(np.ones(4, np.float32), 2.0, "a")  # another dtype
    g(np.ones(4, np.float32), 2.0, "b")  # another static value
    assert g.traces == 4 and calls == ["a", "a", "a", "a", "b"]
    np.testing.assert_array_equal(g(np.ones(2), 3.0, "a").numpy(), [3.0, 3.0])


def test_dataclass_and_namedtuple_trees_are_signatures_too() -> None:
    @dataclass(frozen=True)
    class Pair:
        a: Any
        b: Any

    def f(p: Pair) -> Pair:
        tape, a = tg.leaf(tg.Tape(), p.a)
        tape, b = tg.leaf(tape, p.b)
        tape, s = tg.add(tape, a, b)
        return Pair(tg.value(tape, s), tg.value(tape, b))

    g = tg.jit(f)
    out = g(Pair(np.ones(2), np.full(2, 2.0)))
    assert isinstance(out, Pair)
    np.testing.assert_array_equal(out.a.numpy(), [3.0, 3.0])
    g(Pair(np.zeros(2), np.zeros(2)))
    assert g.traces == 1


def test_a_host_read_inside_is_an_error_naming_jit() -> None:
    def reads(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, s = tg.sum(tape, i)
        if float(tg.value(tape, s)) > 0:  # a host read
            return tg.value(tape, s)
        return tg.value(tape, i)

    with pytest.raises(tg.TapegradError, match=r"jit\(reads\): a value was read to the host "
                       r"inside the jitted function") as info:
        tg.jit(reads)(np.ones(3))
    assert "test_jit.py" in str(info.value)
    # outside, reads work again
    assert float(tg.AnyTensor(np.float32(2.0))) == 2.0


def test_the_result_must_be_a_pytree_of_tensors() -> None:
    def returns_an_id(x: Any) -> Any:
        return tg.leaf(tg.Tape(), x)[1]

    with pytest.raises(tg.DTypeError, match=r"jit\(returns_an_id\): the result must be a pytree "
                       r"of AnyTensors, but result is a Id \(return tg.value\(tape, id\)"):
        tg.jit(returns_an_id)(np.ones(2))


def test_bad_arguments_are_named() -> None:
    def f(x: Any, y: Any = None) -> tg.AnyTensor:
        return tg.AnyTensor(x)

    with pytest.raises(tg.ArgumentTypeError, match="static_argnums must be an int or a tuple"):
        tg.jit(f, static_argnums="1")  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.ShapeError, match="both static and donated"):
        tg.jit(f, static_argnums=0, donate_argnums=(0,))
    with pytest.raises(tg.ShapeError, match="argnum 3 is beyond the 1 arguments given"):
        tg.jit(f, static_argnums=3)(np.ones(1))
    with pytest.raises(tg.ArgumentTypeError, match="pass arguments by position"):
        tg.jit(f)(np.ones(1), y=2)
    with pytest.raises(tg.DTypeError, match=r"args\[0\]\['k'\] is a _Unhashable, neither an "
                       r"array, a tensor nor a number; mark the argument static"):
        tg.jit(f)({"k": _Unhashable()})
    with pytest.raises(tg.DTypeError, match="static argument 0 must be hashable"):
        tg.jit(f, static_argnums=0)({"a": 1})
    with pytest.raises(tg.DTypeError, match="jit: f must be a function"):
        tg.jit(3)  # pyright: ignore[reportArgumentType]


class _Unhashable:
    """A leaf that is neither an array nor a number, and cannot be hashed."""

    __hash__ = None  # type: ignore[assignment]


def test_the_cache_is_bounded_and_warns_when_it_evicts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_jit, "CACHE_SIZE", 2)

    def f(x: Any) -> tg.AnyTensor:
        return tg.AnyTensor(x)

    g = tg.jit(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g(np.ones(1))
        g(np.ones(2))
    with pytest.warns(tg.JitCacheWarning, match=r"jit\(f\): 2 signatures are kept; the oldest"):
        g(np.ones(3))
    assert g.signatures == 2
    with pytest.warns(tg.JitCacheWarning):
        g(np.ones(1))  # evicted: traced again
    assert g.traces == 4
