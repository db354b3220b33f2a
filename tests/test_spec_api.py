"""The public names of SPEC.md with exactly SPEC's parameter names, defaults and kinds.

Outside code calls these by keyword; a renamed keyword or a changed default breaks it silently
(a keyword becomes a TypeError, a default a different result). Extra trailing parameters with
defaults are allowed (`backward`'s `check_finite`, `gradcheck`'s tolerances).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tapegrad as tg

REQUIRED = inspect.Parameter.empty

# name -> parameters as (name, default or REQUIRED, keyword-only), in order.
P = tuple[str, Any, bool]


def sig(text: str) -> list[P]:
    """'tape, x, axis=None, *, lr' -> parameters (defaults evaluated as Python literals)."""
    out: list[P] = []
    kwonly = False
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part == "*":
            kwonly = True
            continue
        if part.startswith("*"):
            out.append((part, REQUIRED, False))
            continue
        name, _, default = part.partition("=")
        out.append((name, eval(default) if default else REQUIRED, kwonly))
    return out


_UNARY = ["neg", "exp", "log", "sqrt", "abs", "tanh", "sigmoid", "relu", "stop_gradient"]
_BINARY = ["add", "sub", "mul", "div", "pow", "maximum", "minimum"]
_REDUCE = ["sum", "mean", "max", "min"]

SPEC: dict[str, str] = {
    "leaf": "tape, data, *, requires_grad=False, name=None",
    "value": "tape, id",
    "backward": "tape, loss, *, wrt=None, seed=None",
    "backward_on_tape": "tape, loss, wrt, seed=None",
    "gelu": "tape, x, approximate='none'",
    "where": "tape, cond, a, b",
    "clip": "tape, x, lo, hi",
    "astype": "tape, x, dtype",
    "logsumexp": "tape, x, axis=-1, keepdims=False",
    "var": "tape, x, axis=None, keepdims=False, ddof=0",
    "reshape": "tape, x, shape",
    "transpose": "tape, x, axes=None",
    "broadcast_to": "tape, x, shape",
    "expand_dims": "tape, x, axis",
    "squeeze": "tape, x, axis=None",
    "concat": "tape, xs, axis=0",
    "stack": "tape, xs, axis=0",
    "slice": "tape, x, index",
    "take": "tape, x, indices, axis=0",
    "pad": "tape, x, pad_width",
    "matmul": "tape, a, b",
    "softmax": "tape, x, axis=-1",
    "log_softmax": "tape, x, axis=-1",
    "cross_entropy": "tape, logits, labels",
    "mse": "tape, a, b",
    "linear": "tape, x, w, b=None",
    "conv2d": "tape, x, w, b=None, stride=1, padding=0",
    "max_pool2d": "tape, x, kernel_size, stride=None, padding=0",
    "avg_pool2d": "tape, x, kernel_size, stride=None, padding=0",
    "layer_norm": "tape, x, weight=None, bias=None, eps=1e-5",
    "batch_norm": "tape, x, weight=None, bias=None, eps=1e-5",
    "dropout": "tape, x, p, seed",
    "embedding": "tape, table, indices",
    "grad": "f, argnums=0",
    "value_and_grad": "f, argnums=0, has_aux=False",
    "vjp": "f, *args",
    "gradcheck": "f, *args",
    "devices": "",
    "default_device": "",
    **{name: "tape, x" for name in _UNARY},
    **{name: "tape, a, b" for name in _BINARY},
    **{name: "tape, x, axis=None, keepdims=False" for name in _REDUCE},
}
OPTIM: dict[str, str] = {
    "sgd": "params, grads, state=None, *, lr, momentum=0.0, weight_decay=0.0",
    "adam": "params, grads, state=None, *, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8",
}


def _params(fn: Callable[..., Any]) -> list[P]:
    out: list[P] = []
    for p in inspect.signature(fn).parameters.values():
        name = "*" + p.name if p.kind is p.VAR_POSITIONAL else p.name
        out.append((name, p.default, p.kind is p.KEYWORD_ONLY))
    return out


def _check(fn: Callable[..., Any], text: str) -> None:
    want = sig(text)
    got = _params(fn)
    assert got[: len(want)] == want, f"{fn.__name__}{inspect.signature(fn)} vs SPEC ({text})"
    for name, default, _ in got[len(want):]:
        assert default is not REQUIRED or name.startswith("*"), (
            f"{fn.__name__}: extra parameter {name} has no default")


@pytest.mark.parametrize("name", sorted(SPEC))
def test_signature_matches_spec(name: str) -> None:
    _check(getattr(tg, name), SPEC[name])


@pytest.mark.parametrize("name", sorted(OPTIM))
def test_optimizer_signature_matches_spec(name: str) -> None:
    _check(getattr(tg.optim, name), OPTIM[name])


def test_tape_accepts_device_objects_and_strings() -> None:
    assert [p.name for p in inspect.signature(tg.Tape).parameters.values()] == ["device"]
    assert inspect.signature(tg.Tape).parameters["device"].default is None
    devices = tg.devices()
    assert devices and all(isinstance(d, tg.Device) for d in devices)
    assert tg.Tape().device is tg.default_device()
    assert tg.Tape(device=devices[0]).device is devices[0]
    first = f"{devices[0].platform_index}:{devices[0].device_index}"
    assert tg.Tape(first).device is devices[0]
    kind = "gpu" if devices[0].is_gpu else "cpu"
    assert tg.Tape(device=kind).device.kind == kind
    for spec in ("0:1", "gpu", "cpu"):  # each either works or is a DeviceError
        try:
            tape = tg.Tape(device=spec)
        except tg.DeviceError:
            continue
        assert isinstance(tape.device, tg.Device)
    with pytest.raises(tg.DeviceError, match="tpu"):
        tg.Tape(device="tpu")


def test_node_id_and_tensor_fields() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32), requires_grad=True, name="x")
    tape, y = tg.exp(tape, x)
    node = tape[y]
    for field in ("op", "parents", "value", "requires_grad", "name", "site"):
        assert hasattr(node, field), field
    assert node.op == "exp" and node.parents == (x,) and node.requires_grad
    assert node.name is None and tape[x].name == "x" and tape[x].op == "leaf"
    assert "test_spec_api.py" in node.site
    assert isinstance(node.value, tg.AnyTensor)
    assert isinstance(y.index, int) and y.index == 1
    assert y.shape == (2, 3) and y.dtype == np.float32 and isinstance(y.dtype, np.dtype)
    assert {y: 1}[y] == 1 and hash(x) == hash(tape[y].parents[0])
    assert len({x, y, x}) == 2
    with pytest.raises(AttributeError):
        y.index = 3  # type: ignore[misc]
    value = tg.value(tape, y)
    assert value.shape == (2, 3) and value.dtype == np.float32
    assert isinstance(value.device, tg.Device)
    np.testing.assert_allclose(value.numpy(), np.exp(np.ones((2, 3))), rtol=1e-6)
    assert isinstance(tg.require(tape, y, (2, 3), np.float32), tg.AnyTensor)
    np.testing.assert_allclose(np.asarray(value), value.numpy())
    tape, total = tg.sum(tape, y)
    assert float(tg.value(tape, total)) == pytest.approx(6 * np.e, rel=1e-6)
    assert tg.value(tape, total).item() == pytest.approx(6 * np.e, rel=1e-6)
    with pytest.raises(tg.ShapeError):
        float(value)
    assert [n.op for n in tape][:2] == ["leaf", "exp"]


def test_errors_form_one_family() -> None:
    for cls in (tg.ShapeError, tg.DTypeError, tg.TapeError, tg.DeviceError, tg.AnomalyError,
                tg.GradcheckError):
        assert issubclass(cls, tg.TapegradError)
    assert issubclass(tg.ShapeError, ValueError) and issubclass(tg.DTypeError, TypeError)


def test_every_spec_name_is_exported() -> None:
    names = [
        "Tape", "Id", "Node", "AnyTensor", "Device", "leaf", "value", "require", "backward",
        "backward_on_tape", "grad", "value_and_grad", "vjp", "hvp", "jacobian", "hessian",
        "gradcheck", "detect_anomaly", "elementwise_op", "describe", "render", "to_dot", "typed",
        "devices", "default_device", "optim", "nn", "TapegradError", "ShapeError", "DTypeError",
        "TapeError", "DeviceError", "AnomalyError", "GradcheckError",
    ]
    missing = [n for n in [*names, *SPEC] if not hasattr(tg, n)]
    assert not missing
