"""Every op of the table: forward against numpy, gradients against finite differences."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from all_cases import ALL_CASES as CASES
from cases import Case
from tapegrad._primitive import primitives

IDS = [c.name for c in CASES]


def _forward(case: Case, dtype: Any) -> tuple[np.ndarray[Any, Any], Any]:
    arrays = [a.astype(dtype) for a in case.inputs()]
    tape = tg.Tape()
    ids: list[tg.Id] = []
    for a in arrays:
        tape, i = tg.leaf(tape, a)
        ids.append(i)
    tape, out = case.fn(tape, *ids)
    return tg.value(tape, out).numpy(), case.ref(*arrays)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_matches_numpy(case: Case, dtype: Any) -> None:
    got, want = _forward(case, dtype)
    assert got.dtype == dtype
    assert got.shape == np.shape(want)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_vjp_matches_finite_differences(case: Case) -> None:
    assert tg.gradcheck(case.fn, *case.inputs())


def test_every_primitive_is_exercised() -> None:
    """Each registered primitive appears on some tape the table builds, first or second order."""
    seen: set[str] = set()
    for case in CASES:
        tape = tg.Tape()
        ids: list[tg.Id] = []
        for a in case.inputs():
            tape, i = tg.leaf(tape, a, requires_grad=True)
            ids.append(i)
        tape, out = case.fn(tape, *ids)
        tape, loss = tg.sum(tape, out)
        tape, _ = tg.backward_on_tape(tape, loss, ids)
        seen.update(node.op for node in tape)
    missing = {name for name, prim in primitives().items() if prim.builtin} - seen
    assert not missing, f"primitives without a row in tests/cases.py: {sorted(missing)}"


def test_a_wrong_vjp_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """gradcheck is not vacuous: break exp's VJP (drop the factor out) and it must fail."""
    import dataclasses

    from tapegrad._ops import elementwise as ew

    def wrong(e: Any, g: Any, out: Any, args: Any, p: Any, needs: Any) -> list[Any]:
        return [g]

    monkeypatch.setattr(ew, "EXP", dataclasses.replace(ew.EXP, vjp=wrong))
    with pytest.raises(tg.GradcheckError, match="worst: argument 0"):
        tg.gradcheck(tg.exp, np.array([0.5, 1.0, 2.0]))
