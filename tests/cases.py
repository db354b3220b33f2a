"""The op table: every public op with its numpy reference and input domain.

Each row is checked for forward values against numpy (float32 and float64) and for gradients
against float64 finite differences (test_ops.py). Broadcasting rows use shapes that differ in
rank, in size-1 axes, and scalar operands.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from tapegrad._device import Device
from tapegrad._jit import force_replays, sweep_replays
from tapegrad._ops import linalg

Array = np.ndarray[Any, Any]
Out = tuple[tg.Tape, tg.Id]
Fn1 = Callable[[tg.Tape, tg.Id], Out]
Fn2 = Callable[[tg.Tape, tg.Id, tg.Id], Out]
Ref1 = Callable[[Array], Any]
Ref2 = Callable[[Array, Array], Any]


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Out]  # (tape, *ids) -> (tape, id)
    ref: Callable[..., Any]  # numpy reference over arrays
    shapes: tuple[tuple[int, ...], ...]
    domain: str = "any"  # "any", "positive", "away0" (|x| >= 0.2, both signs)

    def inputs(self, seed: int = 0) -> list[Array]:
        return draw_inputs(self.shapes, self.domain, seed)


def draw_inputs(shapes: Sequence[tuple[int, ...]], domain: str, seed: int = 0) -> list[Array]:
    """Float64 normal draws, moved into `domain`: "positive" (>= 0.5), "away0" (|x| >= 0.2,
    both signs: away from kinks and poles at 0) or "any"."""
    rng = np.random.default_rng(seed)
    out: list[Array] = []
    for shape in shapes:
        x = rng.standard_normal(shape)
        if domain == "positive":
            x = np.abs(x) + 0.5
        elif domain == "away0":
            x = np.sign(x) * (np.abs(x) + 0.2)
        out.append(np.asarray(x, np.float64))
    return out


def case1(name: str, fn: Fn1, ref: Ref1, shape: tuple[int, ...], domain: str = "any") -> Case:
    return Case(name, fn, ref, (shape,), domain)


BROADCAST_PAIRS: list[tuple[tuple[int, ...], tuple[int, ...]]] = [
    ((3, 4), (3, 4)),
    ((3, 4), (4,)),
    ((2, 1, 4), (3, 1)),
    ((3, 1), (1, 4)),
    ((3, 4), ()),
    ((), (2, 3)),
]

BINARY: dict[str, tuple[Fn2, Ref2, str]] = {
    "add": (tg.add, np.add, "any"),
    "sub": (tg.sub, np.subtract, "any"),
    "mul": (tg.mul, np.multiply, "any"),
    "div": (tg.div, np.divide, "away0"),
    "pow": (tg.pow, np.power, "positive"),
}


def _sigmoid(x: Array) -> Array:
    return 1 / (1 + np.exp(-x))


def _relu(x: Array) -> Array:
    return np.maximum(x, 0)


UNARY: dict[str, tuple[Fn1, Ref1, str]] = {
    "neg": (tg.neg, np.negative, "any"),
    "exp": (tg.exp, np.exp, "any"),
    "log": (tg.log, np.log, "positive"),
    "sqrt": (tg.sqrt, np.sqrt, "positive"),
    "tanh": (tg.tanh, np.tanh, "any"),
    "sigmoid": (tg.sigmoid, _sigmoid, "any"),
    "relu": (tg.relu, _relu, "away0"),
}


def _with_scalar(name: str, fn: Fn2, ref: Ref2, c: float, right: bool, domain: str) -> Case:
    def f(t: tg.Tape, x: tg.Id) -> Out:
        return fn(t, x, c) if right else fn(t, c, x)  # type: ignore[arg-type]

    def r(x: Array) -> Any:
        return ref(x, np.asarray(c)) if right else ref(np.asarray(c), x)

    label = f"{name}(x, {c})" if right else f"{name}({c}, x)"
    return case1(label, f, r, (3, 2), domain)


def _scalar_cases() -> list[Case]:
    """Binary ops with a Python scalar on either side."""
    cases: list[Case] = []
    for name, (fn, ref, domain) in BINARY.items():
        cases.append(_with_scalar(name, fn, ref, 2.5 if name == "pow" else 1.7, True, domain))
        left_domain = "away0" if name == "div" else "any"
        cases.append(_with_scalar(name, fn, ref, 1.3 if name == "pow" else -0.7, False,
                                  left_domain))
    return cases


def _reduce_case(name: str, fn: Any, ref: Any, axis: Any, keep: bool) -> Case:
    def f(t: tg.Tape, x: tg.Id) -> Out:
        out: Out = fn(t, x, axis=axis, keepdims=keep)
        return out

    def r(x: Array) -> Any:
        return ref(x, axis=axis, keepdims=keep)

    return case1(f"{name}(axis={axis}, keepdims={keep})", f, r, (2, 3, 4))


def _reduce_cases() -> list[Case]:
    axes: list[Any] = [None, 0, 1, 2, -1, -3]
    axes += [c for r in (2, 3) for c in itertools.combinations(range(3), r)]
    axes += [(-1, 0)]
    ops: dict[str, tuple[Any, Any]] = {
        "sum": (tg.sum, np.sum), "mean": (tg.mean, np.mean), "max": (tg.max, np.max),
        "min": (tg.min, np.min),
    }
    cases = [_reduce_case(name, fn, ref, axis, keep)
             for (name, (fn, ref)), axis, keep in itertools.product(ops.items(), axes,
                                                                    (False, True))]
    # Long axes exercise the split-K reduction path.
    cases.append(case1("sum(long axis)", lambda t, x: tg.sum(t, x, axis=1),
                       lambda x: np.sum(x, axis=1), (2, 1500)))
    cases.append(case1("max(long)", lambda t, x: tg.max(t, x), np.max, (1200,)))
    return cases


def _shape_cases() -> list[Case]:
    return [
        case1("reshape", lambda t, x: tg.reshape(t, x, (4, -1)), lambda x: x.reshape(4, -1),
              (2, 3, 2)),
        case1("reshape(scalar)", lambda t, x: tg.reshape(t, x, (1, 1)),
              lambda x: x.reshape(1, 1), ()),
        case1("transpose", lambda t, x: tg.transpose(t, x), lambda x: x.T, (2, 3, 4)),
        case1("transpose(axes)", lambda t, x: tg.transpose(t, x, (1, 0, 2)),
              lambda x: x.transpose(1, 0, 2), (2, 3, 4)),
        case1("transpose(neg axes)", lambda t, x: tg.transpose(t, x, (-1, 0, 1)),
              lambda x: x.transpose(2, 0, 1), (2, 3, 4)),
        case1("broadcast_to", lambda t, x: tg.broadcast_to(t, x, (2, 3, 4)),
              lambda x: np.broadcast_to(x, (2, 3, 4)), (3, 1)),
        case1("broadcast_to(scalar)", lambda t, x: tg.broadcast_to(t, x, (2, 2)),
              lambda x: np.broadcast_to(x, (2, 2)), ()),
    ]


def _matmul_cases() -> list[Case]:
    pairs = [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
             ((2, 1, 3, 4), (3, 4, 2)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)),
             ((3, 4), (2, 4, 5)), ((17, 19), (19, 18)), ((2, 3, 3, 4), (2, 3, 4, 2)),
             ((2, 2, 3, 4), (4, 5))]
    return [Case(f"matmul{a}@{b}", tg.matmul, np.matmul, (a, b)) for a, b in pairs]


def _mlp(t: tg.Tape, x: tg.Id, w: tg.Id, b: tg.Id) -> Out:
    t, h = tg.matmul(t, x, w)
    t, h = tg.add(t, h, b)
    t, h = tg.tanh(t, h)
    t, h = tg.mul(t, h, h)  # a value used twice
    return tg.mean(t, h, axis=0)


def _mlp_ref(x: Array, w: Array, b: Array) -> Array:
    return np.mean(np.tanh(x @ w + b) ** 2, axis=0)


CASES: list[Case] = (
    [Case(f"{n}{a}{b}", fn, ref, (a, b), dom)
     for n, (fn, ref, dom) in BINARY.items() for a, b in BROADCAST_PAIRS]
    + [case1(f"{n}{s}", fn, ref, s, dom) for n, (fn, ref, dom) in UNARY.items()
       for s in ((3, 4), ())]
    + _scalar_cases() + _reduce_cases() + _shape_cases() + _matmul_cases()
    + [Case("mlp", _mlp, _mlp_ref, ((4, 3), (3, 2), (2,)))]
)


def warm_up(device: tg.Device, step: Callable[[], object], tries: int = 16) -> None:
    """Run `step` until `fuse_after()` runs in a row build no program.

    A structure gets its generated kernel on its `fuse_after()`-th sighting, and one kernel's
    build can make a new structure appear (a node its node-by-node run had computed aside is
    now realised on its own): that one is first seen a run later, so a single quiet run
    proves nothing. Runs with the same kernels see the same structures, so `fuse_after()`
    quiet runs in a row leave none unbuilt.
    """
    from tapegrad._fusion import fuse_after

    quiet = 0
    for _ in range(tries):
        before = device.builds
        step()
        quiet = quiet + 1 if device.builds == before else 0
        if quiet >= max(fuse_after(), 1):
            return
    raise AssertionError(f"still building programs after {tries} warm-up runs")


def _narrow(device: Device, dtype: Any) -> bool:
    return False


def on_launch(monkeypatch: pytest.MonkeyPatch, note: Callable[[str], object]) -> None:
    """Call `note` with the name of every kernel launched from now on (the launch still
    runs), for tests that count launches; sweeps run node by node (a replayed sweep's
    launches bypass `Device.launch`, as a jitted step's do), products take panels of 16
    columns on every device (`linalg.wide_panels`) and the default device takes the CPU's
    kernels (a GPU's convolutions are im2col and the product): the names the tests expect.
    Deferred forwards read outside a sweep run node by node too."""
    launch = Device.launch
    monkeypatch.setattr(tg.default_device(), "is_gpu", False)
    monkeypatch.setattr(sweep_replays, "enabled", False)
    monkeypatch.setattr(force_replays, "enabled", False)
    monkeypatch.setattr(linalg, "wide_panels", _narrow)

    def noting(self: Device, kernel: Any, *args: Any, largest: int | None = None) -> None:
        note(str(kernel.function_name))
        launch(self, kernel, *args, largest=largest)

    monkeypatch.setattr(Device, "launch", noting)


def run_threads(work: list[Callable[[], object]]) -> None:
    """Run each of `work` in a thread of its own, switching threads as often as Python can
    (races show up), and raise the first error any of them raised."""
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as err:  # re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in work]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
