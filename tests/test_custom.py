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
    with pytest.raises(tg.ShapeError, match=r"'test_bad' has 1 operands, so vjps must be a "
                       r"list of 1 expressions \(None for no gradient\), got 2: \['g', 'g'\]"):
        tg.elementwise_op("test_bad", 1, "a", ["g", "g"])
    # A string is not a list of one expression; an arity must be an int (it raised Python's
    # TypeError comparing a str with an int); both at the user's line.
    with pytest.raises(tg.DTypeError, match="vjps must be a list of 1 C expressions"):
        tg.elementwise_op("test_bad", 1, "a", "g")
    with pytest.raises(tg.DTypeError, match=r"arity must be an int 1..3, got '1'\n  "
                       r"\(called at .*test_custom.py"):
        tg.elementwise_op("test_bad", "1", "a", ["g"])  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(("part", "bad"), [
    ("forward", None), ("helpers", 3), ("vjps", None), ("vjps", {0: "g"}), ("vjps", [3]),
    ("doc", 1.5),
], ids=["forward", "helpers", "vjps-None", "vjps-dict", "vjps-entry", "doc"])
def test_a_failed_definition_is_a_dtype_error_and_leaves_the_name_free(
        request: pytest.FixtureRequest, part: str, bad: object) -> None:
    """Every part is checked before anything is registered (a None forward raised a bare
    TypeError from the regex, after the VJP primitives were registered: the name was then
    taken for good)."""
    name = "test_free_" + request.node.callspec.id.replace("-", "_")
    spec: dict[str, object] = {"name": name, "arity": 1, "forward": "a * (T)3",
                               "vjps": ["g * (T)3"], part: bad}
    with pytest.raises(tg.DTypeError, match=r"elementwise_op: .*\n  \(called at .*test_custom"):
        tg.elementwise_op(**spec)  # pyright: ignore[reportArgumentType]
    op = tg.elementwise_op(name, 1, "a * (T)3", ["g * (T)3"])
    tape, x = tg.leaf(tg.Tape(), np.ones(2, np.float32), requires_grad=True)
    tape, y = op(tape, x)
    tape, s = tg.sum(tape, y)
    np.testing.assert_array_equal(tg.backward(tape, s)[x].numpy(), [3.0, 3.0])


def test_vjps_may_be_a_numpy_array_and_doc_none() -> None:
    op = tg.elementwise_op("test_array_vjps", 1, "a * (T)4",
                           np.array(["g * (T)4"]), doc=None)  # pyright: ignore[reportArgumentType]
    tape, x = tg.leaf(tg.Tape(), np.ones(2, np.float32), requires_grad=True)
    tape, y = op(tape, x)
    tape, s = tg.sum(tape, y)
    np.testing.assert_array_equal(tg.backward(tape, s)[x].numpy(), [4.0, 4.0])


def test_a_build_error_in_an_eight_lane_kernel_names_the_expression() -> None:
    """A heavy float32 expression (a transcendental) is built eight lanes wide, on a line the
    error report did not look for: it blamed the helpers."""
    with pytest.raises(tg.DeviceError, match=r"the forward expression 'exp\(a\) \+\* 2' fails "
                       "to compile"):
        tg.elementwise_op("test_lanes", 1, "exp(a) +* 2", ["g"])


def test_a_kernel_that_fails_to_build_is_an_error_at_the_definition_naming_the_expression(
) -> None:
    # Built when defined: the error names the expression and the compiler's complaint, with
    # the log, at the user's line; nothing stays registered, so the fixed op can be defined.
    with pytest.raises(tg.DeviceError) as info:
        tg.elementwise_op("test_broken", 2, forward="a * b", vjps=["g * b", "g +* no_such"])
    message = str(info.value)
    assert message.startswith("elementwise_op: 'test_broken': the VJP expression for operand 1 "
                              "('g +* no_such') fails to compile: ")
    assert "(at character" in message and "failed to build" in message
    assert "test_custom.py" in message  # the caller's line
    with pytest.raises(tg.DeviceError, match=r"the forward expression 'a \+' fails to compile"):
        tg.elementwise_op("test_broken", 1, forward="a +", vjps=[None])
    with pytest.raises(tg.DeviceError, match="its helpers fail to compile"):
        tg.elementwise_op("test_broken", 1, "h(a)", [None], helpers="inline T h(T v) { v +; }")
    fixed = tg.elementwise_op("test_broken", 2, forward="a * b", vjps=["g * b", "g * a"])
    tape, x = tg.leaf(tg.Tape(), np.array([2.0, 3.0], np.float32), requires_grad=True)
    tape, y = fixed(tape, x, 4.0)
    tape, s = tg.sum(tape, y)
    np.testing.assert_array_equal(tg.backward(tape, s)[x].numpy(), [4.0, 4.0])


def test_helpers_are_shared_by_the_forward_and_the_vjps() -> None:
    twice = tg.elementwise_op("test_twice", 1, "h(a)", ["g * h((T)1)"],
                              helpers="inline T h(T v) { return v * (T)2; }")
    tape, x = tg.leaf(tg.Tape(), np.array([1.0, 5.0]), requires_grad=True)
    tape, y = twice(tape, x)
    tape, s = tg.sum(tape, y)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), [2.0, 10.0])
    np.testing.assert_array_equal(tg.backward(tape, s)[x].numpy(), [2.0, 2.0])


def test_a_custom_op_refuses_a_non_tape_first_like_the_builtin_ones() -> None:
    double = tg.elementwise_op("test_double", 1, "a * (T)2", ["g * (T)2"])
    _, x = tg.leaf(tg.Tape(), np.ones(2, np.float32))
    with pytest.raises(tg.TapeError, match=r"test_double: the first argument must be the tape"):
        double(None, x)  # type: ignore[arg-type]


def test_custom_op_names_must_be_identifiers_and_not_taken() -> None:
    for bad in ("my op", "1abc", "a-b", ""):
        with pytest.raises(tg.TapegradError, match="must be a C identifier"):
            tg.elementwise_op(bad, 1, "a", [None])
    for taken in ("leaf", "layer_norm", "sum", "relu"):
        with pytest.raises(tg.TapegradError, match=f"an op named '{taken}' already exists"):
            tg.elementwise_op(taken, 1, "a", [None])


def test_transcendental_custom_ops_run_eight_lanes_where_that_means_the_same() -> None:
    """A custom expression of arithmetic and library calls runs eight lanes at a time in
    float32, as the built-in transcendentals do; one with a comparison stays lane by lane,
    where `g * (a > 0)` would read -1 for true on a vector and flip the gradient's sign."""
    from tapegrad._kernels import source_lines

    silu = tg.elementwise_op("test_lane_silu", 1, "a / (1 + exp(-a))",
                             ["g * (1 / (1 + exp(-a))) * (1 + a * (1 - 1 / (1 + exp(-a))))"])
    gated = tg.elementwise_op("test_lane_gated", 1, "exp(a) * (a > 0)", ["g * exp(a) * (a > 0)"])
    lanes = {name: "typedef T8 T" in "\n".join(source_lines(np.dtype(np.float32),
                                                              f"custom.{name}"))
             for name in ("test_lane_silu", "test_lane_gated")}
    assert lanes == {"test_lane_silu": True, "test_lane_gated": False}
    x = np.linspace(-6.0, 6.0, 1003).astype(np.float32)  # 125 groups of 8 and a tail of 3
    x64 = x.astype(np.float64)
    sig = 1 / (1 + np.exp(-x64))
    for op, want, dwant in ((silu, x64 * sig, sig * (1 + x64 * (1 - sig))),
                            (gated, np.exp(x64) * (x > 0), np.exp(x64) * (x > 0))):
        tape, xi = tg.leaf(tg.Tape(), x, requires_grad=True)
        tape, y = op(tape, xi)
        tape, s = tg.sum(tape, y)
        np.testing.assert_allclose(tg.value(tape, y).numpy(), want, rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(tg.backward(tape, s)[xi].numpy(), dwant, rtol=2e-6, atol=1e-7)
