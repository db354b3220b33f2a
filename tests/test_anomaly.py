"""Anomaly mode: the first NaN/Inf names the op and the user's line; off, it costs nothing."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tapegrad as tg

HERE = Path(__file__).name


def _line() -> int:
    """The caller's line number."""
    return sys._getframe(1).f_lineno


def _sqrt_at_zero() -> tuple[tg.Tape, tg.Id, tg.Id, int]:
    """sum(sqrt(x)) with x[0] == 0: finite forward, infinite gradient at x[0]."""
    tape, x = tg.leaf(tg.Tape(), np.array([0.0, 1.0, 4.0], np.float32), requires_grad=True)
    line = _line() + 1
    tape, y = tg.sqrt(tape, x)
    tape, loss = tg.sum(tape, y)
    return tape, x, loss, line


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts AnyTensor.numpy() calls: each is a read of device data to the host."""
    calls: list[int] = []
    real = tg.AnyTensor.numpy

    def counting(self: tg.AnyTensor) -> np.ndarray[Any, Any]:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(tg.AnyTensor, "numpy", counting)
    yield calls


def test_forward_nan_inside_detect_anomaly_names_op_and_line() -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([1.0, -1.0, 2.0], np.float32))
    line = _line() + 2
    with tg.detect_anomaly(), pytest.raises(tg.AnomalyError) as info:
        tg.log(tape, x)
    msg = str(info.value)
    assert msg.startswith("log: the forward value holds NaN in 1 of 3 elements")
    assert "first at index (1,)" in msg
    assert f"{HERE}:{line}" in msg
    assert isinstance(info.value, tg.TapegradError) and isinstance(info.value, FloatingPointError)
    assert len(tape) == 1  # nothing half-built


def test_forward_inf_is_caught_too_and_the_first_op_is_named() -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([100.0, 1.0], np.float32))
    with tg.detect_anomaly():
        tape, h = tg.mul(tape, x, 2.0)        # finite
        with pytest.raises(tg.AnomalyError, match=r"^exp: .*Inf in 1 of 2 elements"):
            tg.exp(tape, h)                    # e^200 overflows float32


def test_a_nan_inside_a_composite_op_names_the_public_op_too() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3)))  # constant rows and channels: variance 0
    line = _line() + 2
    with tg.detect_anomaly(), pytest.raises(tg.AnomalyError) as info:
        tg.var(tape, x, axis=0, ddof=2)  # divides by n - ddof = 0 (not trailing: the ops)
    msg = str(info.value)
    assert msg.startswith("div (a step of var): the forward value holds NaN in 3 of 3")
    assert f"{HERE}:{line}" in msg
    line = _line() + 2  # over trailing axes, var is one kernel: its primitive is named
    with tg.detect_anomaly(), pytest.raises(tg.AnomalyError) as info:
        tg.var(tape, x, axis=1, ddof=3)
    assert str(info.value).startswith("var_rows (a step of var): the forward value holds NaN "
                                      "in 2 of 2")
    assert f"{HERE}:{line}" in str(info.value)
    for norm in (tg.layer_norm, tg.batch_norm):  # one primitive each: it names itself
        line = _line() + 2
        with tg.detect_anomaly(), pytest.raises(tg.AnomalyError) as info:
            norm(tape, x, eps=0.0)
        assert str(info.value).startswith(f"{norm.__name__}: the forward value holds NaN in 6 "
                                          "of 6")
        assert f"{HERE}:{line}" in str(info.value)


def test_backward_check_finite_names_the_op_whose_vjp_made_the_inf() -> None:
    tape, x, loss, line = _sqrt_at_zero()
    with pytest.raises(tg.AnomalyError) as info:
        tg.backward(tape, loss, check_finite=True)
    msg = str(info.value)
    assert msg.startswith("backward: the VJP of node 1 (op 'sqrt', recorded at ")
    assert f"{HERE}:{line})" in msg
    assert "Inf in 1 of 3 elements (first at index (0,))" in msg
    assert f"for its operand #0 (node {x.index}, op 'leaf'" in msg


def test_backward_check_finite_names_the_first_nonfinite_forward_value() -> None:
    # log(-1) is NaN, the loss too, yet every cotangent is finite (d log / dx = -1): the
    # forward values the loss depends on are checked in recording order, so the error names
    # log, where the NaN arose, not the sum it reached. A NaN off the loss's path is no error.
    tape, x = tg.leaf(tg.Tape(), np.array([-1.0, 2.0]), requires_grad=True)
    tape, unused = tg.sqrt(tape, x)
    line = _line() + 1
    tape, lg = tg.log(tape, x)
    tape, m = tg.mul(tape, lg, 2.0)
    tape, loss = tg.sum(tape, m)
    with pytest.raises(tg.AnomalyError) as info:
        tg.backward(tape, loss, check_finite=True)
    msg = str(info.value)
    assert msg.startswith(f"backward: the forward value of node {lg.index} (op 'log', recorded ")
    assert f"{HERE}:{line}) holds NaN in 1 of 2 elements" in msg
    tape, fine = tg.sum(tape, x)
    np.testing.assert_array_equal(tg.backward(tape, fine, check_finite=True)[x].numpy(), [1, 1])
    assert unused.index < lg.index  # sqrt(-1) was NaN too, but the loss never used it


def test_detect_anomaly_checks_the_backward_too() -> None:
    tape, _, loss, line = _sqrt_at_zero()
    with tg.detect_anomaly(), pytest.raises(tg.AnomalyError, match=rf"'sqrt'.*{HERE}:{line}"):
        tg.backward(tape, loss)


def test_off_by_default_no_error_and_no_host_reads(host_reads: list[int]) -> None:
    tape, x, loss, _ = _sqrt_at_zero()
    tape, bad = tg.log(tape, loss)      # forward: fine here, but check below with a NaN
    tape, neg = tg.leaf(tape, np.array([-1.0], np.float32))
    tape, nan = tg.log(tape, neg)        # a NaN forward value, recorded without complaint
    grads = tg.backward(tape, loss)      # an Inf gradient, returned without complaint
    assert host_reads == []              # neither the ops nor the sweep read data back
    assert np.isinf(grads[x].numpy()[0])
    assert np.isnan(tg.value(tape, nan).numpy()).all()
    assert bad.index < nan.index


def test_on_it_reads_values_back(host_reads: list[int]) -> None:
    tape, _, loss, _ = _sqrt_at_zero()
    with tg.detect_anomaly():
        tape, _ = tg.exp(tape, loss)
    assert len(host_reads) == 1


def test_detect_anomaly_false_switches_it_off_inside() -> None:
    tape, _, loss, _ = _sqrt_at_zero()
    with tg.detect_anomaly(), tg.detect_anomaly(False):
        tg.backward(tape, loss)
    with tg.detect_anomaly():
        pass
    tg.backward(tape, loss)  # restored to off on exit


def test_nonfinite_seed_is_named() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(2, np.float32), requires_grad=True)
    tape, y = tg.exp(tape, x)
    seed = np.array([1.0, np.nan], np.float32)
    pattern = rf"(?s)backward: the seed holds NaN.*called at .*{HERE}"
    with pytest.raises(tg.AnomalyError, match=pattern):
        tg.backward(tape, y, seed=seed, check_finite=True)


def test_overflow_when_summing_cotangents_names_the_node() -> None:
    """Two finite contributions to x's cotangent that overflow float32 when added."""
    tape, x = tg.leaf(tg.Tape(), np.array([1e-30], np.float32), requires_grad=True, name="x")
    tape, a = tg.mul(tape, x, 2e38)
    tape, b = tg.mul(tape, x, 2e38)
    tape, s = tg.add(tape, a, b)
    tape, loss = tg.sum(tape, s)
    assert np.isinf(tg.backward(tape, loss)[x].numpy()).all()
    with pytest.raises(tg.AnomalyError, match=(
            r"cotangent of node 0 \(op 'leaf', .*\) holds Inf .* after summing the "
            r"contributions of its uses")):
        tg.backward(tape, loss, check_finite=True)


def test_recorded_backward_names_the_vjp_that_failed() -> None:
    tape, x, loss, line = _sqrt_at_zero()
    with tg.detect_anomaly(), pytest.raises(tg.AnomalyError) as info:
        tg.backward_on_tape(tape, loss, [x])
    msg = str(info.value)
    assert "the forward value holds Inf" in msg
    assert "while computing the VJP of node 1 (op 'sqrt', recorded at " in msg
    assert f"{HERE}:{line})" in msg
