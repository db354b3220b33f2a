"""A user's OpenCL expressions become a first-class op with a checked VJP."""

from __future__ import annotations

import numpy as np
import pytest

import tapegrad as tg

softplus = tg.elementwise_op(
    "test_softplus", 1, forward="log1p(exp(a))", vjps=["g / ((T)1 + exp(-a))"])
hypot = tg.elementwise_op(
    "test_hypot", 2, forward="sqrt(a * a + b * b)", vjps=["g * a / out", "g * b / out"])


def test_custom_unary_forward_and_gradient() -> None:
    x = np.array([-2.0, 0.0, 3.0])
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, y = softplus(tape, xi)
    np.testing.assert_allclose(tg.value(tape, y).numpy(), np.log1p(np.exp(x)), rtol=1e-12)
    assert tg.gradcheck(softplus, x)


def test_custom_binary_broadcasts_and_takes_scalars() -> None:
    a, b = np.array([[3.0], [1.0]]), np.array([4.0, 2.0, 0.5])
    tape, ai = tg.leaf(tg.Tape(), a)
    tape, bi = tg.leaf(tape, b)
    tape, h = hypot(tape, ai, bi)
    np.testing.assert_allclose(tg.value(tape, h).numpy(), np.hypot(a, b), rtol=1e-12)
    assert tg.gradcheck(hypot, a, b)

    def with_scalar(t: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        return hypot(t, x, 2.0)

    assert tg.gradcheck(with_scalar, np.array([1.0, -3.0]))


def test_custom_op_second_order_is_refused_clearly() -> None:
    def first(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, y = softplus(tape, x)
        tape, s = tg.sum(tape, y)
        tape, grads = tg.backward_on_tape(tape, s, [x])
        return tg.sum(tape, grads[x])

    with pytest.raises(tg.TapegradError, match="cannot be differentiated a second time"):
        tg.grad(first)(np.array([0.5]))


def test_custom_op_errors() -> None:
    with pytest.raises(tg.TapegradError, match="already exists"):
        tg.elementwise_op("exp", 1, "exp(a)", ["g * out"])
    with pytest.raises(tg.TapegradError, match="1 operands but 2 VJP"):
        tg.elementwise_op("test_bad", 1, "a", ["g", "g"])


def test_a_kernel_that_fails_to_build_is_a_device_error_with_the_log() -> None:
    broken = tg.elementwise_op("test_broken", 1, forward="a +* no_such_name", vjps=[None])
    tape, x = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    with pytest.raises(tg.DeviceError, match=r"(?s)failed to build.*no_such_name") as info:
        broken(tape, x)
    assert "test_broken" in str(info.value)
    assert len(tape) == 1
