"""Bad input: a TapegradError naming op, argument, expected and actual, before any kernel."""

from __future__ import annotations

import numpy as np
import pytest

import tapegrad as tg


def _tape() -> tuple[tg.Tape, tg.Id, tg.Id]:
    tape, a = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
    tape, b = tg.leaf(tape, np.ones((4, 3), np.float32))
    return tape, a, b


def test_broadcast_error_names_op_axis_and_call_site() -> None:
    tape, a, b = _tape()
    with pytest.raises(tg.ShapeError) as info:
        tg.add(tape, a, b)
    msg = str(info.value)
    assert "add" in msg and "a (2, 3)" in msg and "b (4, 3)" in msg
    assert "axis -2" in msg and "a: 2, b: 4" in msg
    assert "test_errors.py" in msg
    assert len(tape) == 2


def test_float32_with_float64_raises_dtype_error_pointing_at_astype() -> None:
    tape, a = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    tape, b = tg.leaf(tape, np.ones(3, np.float64))
    with pytest.raises(tg.DTypeError, match=r"a is float32, b is float64.*astype"):
        tg.mul(tape, a, b)


def test_scalars_keep_the_dtype() -> None:
    tape, a = tg.leaf(tg.Tape(), np.ones(3, np.float64))
    tape, y = tg.mul(tape, a, 2)
    assert y.dtype == np.float64
    tape, c = tg.leaf(tape, np.ones(3, np.float32))
    tape, z = tg.add(tape, 1.5, c)
    assert z.dtype == np.float32


def test_matmul_inner_mismatch_message() -> None:
    tape, a, b = _tape()
    with pytest.raises(tg.ShapeError, match=r"a's last axis \(3\) must equal b's second-to-last"):
        tg.matmul(tape, a, b)


def test_reduction_axis_out_of_range() -> None:
    tape, a, _ = _tape()
    with pytest.raises(tg.ShapeError, match=r"sum: axis 2 is out of range .*rank 2"):
        tg.sum(tape, a, axis=2)
    with pytest.raises(tg.ShapeError, match="repeats an axis"):
        tg.sum(tape, a, axis=(0, -2))


def test_reshape_and_transpose_errors() -> None:
    tape, a, _ = _tape()
    with pytest.raises(tg.ShapeError, match=r"cannot reshape 6 elements to \(4, -1\)"):
        tg.reshape(tape, a, (4, -1))
    with pytest.raises(tg.ShapeError, match="not a permutation"):
        tg.transpose(tape, a, (0, 0))
    with pytest.raises(tg.ShapeError, match=r"cannot broadcast x of shape \(2, 3\)"):
        tg.broadcast_to(tape, a, (3, 3))


def test_require_checks_shape_and_dtype() -> None:
    tape, a, _ = _tape()
    assert tg.require(tape, a, (2, 3), np.float32).shape == (2, 3)
    with pytest.raises(tg.ShapeError, match=r"has shape \(2, 3\), expected \(3, 2\)"):
        tg.require(tape, a, (3, 2))
    with pytest.raises(tg.DTypeError, match="expected float64"):
        tg.require(tape, a, (2, 3), np.float64)


def test_bad_leaf_data() -> None:
    with pytest.raises(tg.DTypeError, match="Python list"):
        tg.leaf(tg.Tape(), [1.0, 2.0])
    with pytest.raises(tg.DTypeError, match="complex128"):
        tg.leaf(tg.Tape(), np.ones(2, np.complex128))


def test_leaf_flags_must_have_their_types() -> None:
    # A truthy string is not True (it would make an input a variable), nor is 5 a name.
    tape = tg.Tape()
    with pytest.raises(tg.DTypeError, match="leaf: requires_grad must be True or False, got 'yes'"):
        tg.leaf(tape, np.ones(3), requires_grad="yes")  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.DTypeError, match="leaf: name must be a str or None, got 5"):
        tg.leaf(tape, np.ones(3), name=5)  # pyright: ignore[reportArgumentType]
    assert len(tape) == 0
    flag: object = np.True_  # a numpy bool is a bool
    tape, x = tg.leaf(tape, np.ones(3), requires_grad=flag)  # pyright: ignore[reportArgumentType]
    assert tape[x].requires_grad is True


def test_non_contiguous_and_big_endian_inputs_are_copied() -> None:
    data = np.arange(12.0).reshape(3, 4)
    tape, x = tg.leaf(tg.Tape(), data.T)
    np.testing.assert_array_equal(tg.value(tape, x).numpy(), data.T)
    tape, y = tg.leaf(tape, data.astype(">f8"))
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), data)


def test_unknown_device() -> None:
    with pytest.raises(tg.DeviceError, match=r"^Tape: unknown device 'tpu'.*\n  \(called at .*"
                       r"test_errors"):
        tg.Tape("tpu")
    with pytest.raises(tg.DeviceError, match=r"^from_numpy: unknown device 'tpu'"):
        tg.AnyTensor.from_numpy(np.ones(2), "tpu")
    def total(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        return tg.sum(tape, x)

    with pytest.raises(tg.DeviceError, match=r"^gradcheck: device must be a Device, a string"):
        tg.gradcheck(total, np.ones(2), device=0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.DeviceError, match="no OpenCL device '9:9'"):
        tg.Tape("9:9")
    if any(dev.kind == "cpu" for dev in tg.devices()):  # a GPU machine may have no CPU driver
        assert tg.Tape("cpu").device.kind == "cpu"
    assert tg.Tape("0:0").device is tg.devices()[0]


def test_anomaly_mode_names_op_and_line() -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([-1.0, 1.0]), requires_grad=True)
    with tg.detect_anomaly(), pytest.raises(tg.AnomalyError, match=r"log.*test_errors.py"):
        tg.log(tape, x)
    tape, y = tg.sqrt(tape, x)  # NaN allowed outside anomaly mode
    assert np.isnan(tg.value(tape, y).numpy()[0])


def test_device_errors_name_the_users_line() -> None:
    for spec in ("no-such", "9:9"):
        with pytest.raises(tg.DeviceError, match=r"\n  \(called at .*test_errors.py"):
            tg.Tape(device=spec)
