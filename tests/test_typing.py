"""Typed ids at run time: jaxtyping annotations over tg.Id, checked by tg.typed (beartype)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beartype.door import is_bearable
from jaxtyping import Bool, Float, Float32, Float64, Int, Shaped, TypeCheckError

import tapegrad as tg

Array = np.ndarray[tuple[int, ...], np.dtype[np.float32]]


def _leaf(tape: tg.Tape, shape: tuple[int, ...], dtype: type = np.float32
          ) -> tuple[tg.Tape, tg.Id]:
    return tg.leaf(tape, np.ones(shape, dtype))


# --- the annotations themselves -------------------------------------------------------------

def test_ids_carry_what_jaxtyping_reads() -> None:
    _, x = _leaf(tg.Tape(), (4, 3))
    assert x.shape == (4, 3) and x.dtype == np.dtype(np.float32)
    assert is_bearable(x, Float[tg.Id, "batch dim"])
    assert is_bearable(x, Float32[tg.Id, "4 3"])
    assert is_bearable(x, Float[tg.Id, "*batch 3"])
    assert is_bearable(x, Float[tg.Id, "#b d"])
    assert is_bearable(x, Shaped[tg.Id, "b d"])
    assert not is_bearable(x, Float[tg.Id, " d"])        # wrong rank
    assert not is_bearable(x, Float[tg.Id, "4 2"])       # wrong size
    assert not is_bearable(x, Float64[tg.Id, "b d"])     # wrong dtype
    assert not is_bearable(x, Int[tg.Id, "b d"])


def test_dtype_families_on_integer_bool_and_scalar_ids() -> None:
    tape, i = _leaf(tg.Tape(), (5,), np.int64)
    tape, b = _leaf(tape, (5,), np.bool_)
    tape, s = tg.leaf(tape, 3.0)
    tape, d = _leaf(tape, (2,), np.float64)
    assert is_bearable(i, Int[tg.Id, " n"]) and not is_bearable(i, Float[tg.Id, " n"])
    assert is_bearable(b, Bool[tg.Id, " n"]) and not is_bearable(b, Int[tg.Id, " n"])
    assert is_bearable(s, Float[tg.Id, ""]) and not is_bearable(s, Float[tg.Id, " n"])
    assert is_bearable(d, Float64[tg.Id, " n"]) and is_bearable(d, Float[tg.Id, " n"])


# --- tg.typed -------------------------------------------------------------------------------

@tg.typed
def linear(
    tape: tg.Tape, x: Float[tg.Id, "batch d_in"], w: Float[tg.Id, "d_in d_out"]
) -> tuple[tg.Tape, Float[tg.Id, "batch d_out"]]:
    return tg.matmul(tape, x, w)


@tg.typed
def wrong_result(
    tape: tg.Tape, x: Float[tg.Id, "batch d"]
) -> tuple[tg.Tape, Float[tg.Id, "batch d"]]:
    return tg.transpose(tape, x)  # (d, batch): binds wrongly unless batch == d


@tg.typed
def row_sums(tape: tg.Tape, x: Float[tg.Id, "batch d"]) -> tuple[tg.Tape, Float[tg.Id, " batch"]]:
    return tg.sum(tape, x, axis=1)


def test_typed_accepts_right_shapes() -> None:
    tape, x = _leaf(tg.Tape(), (4, 3))
    tape, w = _leaf(tape, (3, 2))
    tape, y = linear(tape, x, w)
    assert y.shape == (4, 2)
    np.testing.assert_allclose(tg.value(tape, y).numpy(), np.full((4, 2), 3.0))
    tape, r = row_sums(tape, y)
    assert r.shape == (4,)


def test_typed_rejects_an_argument_whose_dim_disagrees() -> None:
    tape, x = _leaf(tg.Tape(), (4, 3))
    tape, w = _leaf(tape, (5, 2))     # d_in is 3 from x, 5 here
    with pytest.raises(TypeCheckError) as info:
        linear(tape, x, w)
    msg = str(info.value)
    assert "parameter 'w'" in msg
    assert "Float[Id, 'd_in d_out']" in msg
    assert "shape=(5, 2)" in msg                         # the Id's repr: what came
    assert "d_in=3" in msg and "batch=4" in msg         # what was bound
    assert isinstance(info.value, TypeError)  # jaxtyping's TypeCheckError


def test_typed_rejects_a_wrong_dtype() -> None:
    tape, x = _leaf(tg.Tape(), (4, 3), np.int32)
    tape, w = _leaf(tape, (3, 2))
    with pytest.raises(TypeCheckError, match="parameter 'x'"):
        linear(tape, x, w)


def test_dimension_names_bind_through_the_tuple_result() -> None:
    tape, square = _leaf(tg.Tape(), (3, 3))
    tape, t = wrong_result(tape, square)       # batch == d: the transpose fits the annotation
    assert t.shape == (3, 3)
    tape, x = _leaf(tape, (4, 3))
    with pytest.raises(TypeCheckError) as info:
        wrong_result(tape, x)
    msg = str(info.value)
    assert "return value" in msg
    assert "tuple[tapegrad._tape.Tape, Float[Id, 'batch d']]" in msg
    assert "shape=(3, 4)" in msg and "batch=4" in msg and "d=3" in msg


def test_bindings_are_per_call() -> None:
    tape, x = _leaf(tg.Tape(), (4, 3))
    tape, w = _leaf(tape, (3, 2))
    linear(tape, x, w)
    tape, x2 = _leaf(tape, (7, 5))
    tape, w2 = _leaf(tape, (5, 1))
    tape, y = linear(tape, x2, w2)     # new sizes in a new call are fine
    assert y.shape == (7, 1)


def test_typed_checks_plain_arguments_too() -> None:
    tape, x = _leaf(tg.Tape(), (4, 3))
    with pytest.raises(TypeCheckError, match="parameter 'tape'"):
        row_sums(None, x)  # pyright: ignore[reportArgumentType]
    arr: Array = np.ones((4, 3), np.float32)
    with pytest.raises(TypeCheckError, match="parameter 'x'"):
        row_sums(tape, arr)  # pyright: ignore[reportArgumentType]


def test_typed_keeps_name_and_doc() -> None:
    @tg.typed
    def f(tape: tg.Tape, x: Float[tg.Id, " n"]) -> tuple[tg.Tape, Float[tg.Id, ""]]:
        """Sum of x."""
        return tg.sum(tape, x)

    assert f.__name__ == "f" and f.__doc__ == "Sum of x."
    tape, x = _leaf(tg.Tape(), (3,))
    assert f(tape, x)[1].shape == ()


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The full checks that functions decorated from now on run, by function name."""
    from tapegrad import _typing

    done: list[str] = []
    real = _typing._jaxtyped_beartype()

    def counting(fn: Any) -> Any:
        checked = real(fn)

        def run(*args: Any, **kwargs: Any) -> Any:
            done.append(fn.__name__)
            return checked(*args, **kwargs)
        return run

    monkeypatch.setattr(_typing, "_jaxtyped_beartype", lambda: counting)
    return done


def test_a_call_like_one_that_passed_is_not_checked_again(checks: list[str]) -> None:
    @tg.typed
    def scale(tape: tg.Tape, x: Float[tg.Id, "b d"], k: float
              ) -> tuple[tg.Tape, Float[tg.Id, "b d"]]:
        return tg.mul(tape, x, k)

    tape, x = _leaf(tg.Tape(), (4, 3))
    tape, y = scale(tape, x, 2.0)
    for _ in range(2):
        tape, y = scale(tape, y, 1.0)
    tape, y = scale(tape, x, 2.0)
    assert checks == ["scale", "scale"]        # (4, 3) with 2.0, then with 1.0: each once
    tape, x2 = _leaf(tape, (5, 3))
    tape, _ = scale(tape, x2, 2.0)
    tape, _ = scale(tape, x, 3.0)              # a number is part of what was checked
    tape, _ = scale(tape, x2, 2.0)
    assert checks == ["scale"] * 4
    np.testing.assert_allclose(tg.value(tape, y).numpy(), np.full((4, 3), 2.0))
    with pytest.raises(TypeCheckError, match="parameter 'x'"):
        scale(tape, tg.leaf(tape, np.ones(3, np.float32))[1], 2.0)   # new, wrong: checked


def test_a_result_unlike_the_checked_one_is_checked_in_full(checks: list[str]) -> None:
    # Same arguments, a result whose shape depends on something else: it must still fail.
    wide = [False]

    @tg.typed
    def f(tape: tg.Tape, x: Float[tg.Id, "b d"]) -> tuple[tg.Tape, Float[tg.Id, "b d"]]:
        return tg.concat(tape, [x, x], axis=1) if wide[0] else tg.mul(tape, x, 1.0)

    tape, x = _leaf(tg.Tape(), (2, 3))
    tape, _ = f(tape, x)
    tape, _ = f(tape, x)
    assert checks == ["f"]
    wide[0] = True
    with pytest.raises(TypeCheckError) as info:
        f(tape, x)
    assert "return value" in str(info.value) and "shape=(2, 6)" in str(info.value)
    assert checks == ["f", "f"]


def test_annotations_may_name_the_locals_of_the_decorating_scope(checks: list[str]) -> None:
    from jaxtyping import Float as LocalFloat  # a local name, in a string annotation

    @tg.typed
    def total(tape: tg.Tape, x: LocalFloat[tg.Id, " n"]) -> tuple[tg.Tape, Float[tg.Id, ""]]:
        return tg.sum(tape, x)

    tape, x = _leaf(tg.Tape(), (3,))
    for _ in range(2):
        tape, _ = total(tape, x)
    assert checks == ["total"]
    with pytest.raises(TypeCheckError, match="parameter 'x'"):
        total(tape, tg.leaf(tape, np.ones((2, 2), np.float32))[1])


def test_calls_with_other_arguments_are_checked_every_time(checks: list[str]) -> None:
    @tg.typed
    def first(tape: tg.Tape, xs: list[tg.Id], scale: Array) -> tuple[tg.Tape, tg.Id]:
        return tape, xs[0]

    tape, x = _leaf(tg.Tape(), (2,))
    arr: Array = np.ones(2, np.float32)
    for _ in range(2):
        first(tape, [x], arr)            # an array: nothing to remember it by
    assert checks == ["first", "first"]


def test_ops_are_not_wrapped_and_import_does_not_load_jaxtyping() -> None:
    """The library's own ops pay nothing: `import tapegrad` loads neither checker, and an op's
    one wrapper is the tape check (`takes_tape`), over the op itself."""
    code = ("import sys, tapegrad as tg; "
            "print('jaxtyping' in sys.modules, 'beartype' in sys.modules, "
            "tg.matmul.__code__.co_qualname, tg.matmul.__wrapped__.__code__.co_qualname)")
    src = str(Path(tg.__file__).parents[1])  # the tapegrad under test, not another install
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    assert out.stdout.split() == ["False", "False", "takes_tape.<locals>.checked", "matmul"]
