"""tg.jit's contract as far as it is built (issue 19's front end): signatures and retracing,
static and donated arguments, results bitwise those of calling the step directly, no host
reads inside, a pytree of tensors out, a bounded cache that says when it evicts."""

from __future__ import annotations

import warnings
from collections.abc import Callable
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


def _same_bits_quietly(jitted: Callable[..., tg.AnyTensor], f: Callable[..., tg.AnyTensor],
                       calls: list[tuple[Any, ...]]) -> None:
    """Each call of `jitted` gives f's bits, with no JitWarning (a fallback to eager)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        for args in calls:
            assert jitted(*args).numpy().tobytes() == f(*args).numpy().tobytes(), args[1:]


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
    # f runs for each survey (runs that look for the fused kernels a new program needs, built
    # together, the last of which is the recording, and the probe's run on other arrays) and
    # each check
    assert g.traces == 4 and calls[-1] == "b" and len(calls) == g.surveys + g.checks
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


def test_a_tensor_where_a_number_goes_is_named_without_reading_it() -> None:
    """A message naming a bad argument shows a tensor by its type, shape and dtype: its repr
    would read it, which inside a step would have raised the host-read error instead."""
    lr = tg.AnyTensor(np.float32(0.1))

    def step(w: Any, g: Any, lr: Any) -> Any:
        return tg.optim.sgd(w, g, None, lr=lr)[0]

    want = r"sgd: lr must be a number, got AnyTensor of shape \(\) and dtype float32"
    with pytest.raises(tg.DTypeError, match=want):
        step(np.ones(2, np.float32), np.ones(2, np.float32), lr)
    with pytest.raises(tg.DTypeError, match=want):
        tg.jit(step)(np.ones(2, np.float32), np.ones(2, np.float32), lr)

    def drop(x: Any, seed: Any) -> Any:
        tape, i = tg.leaf(tg.Tape(), x)
        return tg.value(*tg.dropout(tape, i, 0.5, seed))

    with pytest.raises(tg.DTypeError, match=r"dropout: seed must be an int, got AnyTensor of "
                       r"shape \(\) and dtype int64"):
        tg.jit(drop)(np.ones(4, np.float32), tg.AnyTensor(np.int64(3)))

    def reshape(x: Any, t: Any) -> Any:
        tape, i = tg.leaf(tg.Tape(), x)
        return tg.value(*tg.reshape(tape, i, [t, -1]))

    with pytest.raises(tg.ArgumentTypeError, match=r"got \[AnyTensor of shape \(\) and dtype "
                       r"int64, -1\]"):  # inside a list too
        tg.jit(reshape)(np.ones(4, np.float32), tg.AnyTensor(np.int64(2)))

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
    with pytest.raises(tg.ArgumentTypeError, match=r"the arguments do not fit f's parameters "
                       r"\(got an unexpected keyword argument 'z'\)"):
        tg.jit(f)(np.ones(1), z=2)  # pyright: ignore[reportCallIssue]
    with pytest.raises(tg.DTypeError, match=r"args\[0\]\['k'\] is a _Unhashable, neither an "
                       r"array, a tensor nor a number; mark the argument static"):
        tg.jit(f)({"k": _Unhashable()})
    with pytest.raises(tg.DTypeError, match="static argument 0 must be hashable"):
        tg.jit(f, static_argnums=0)({"a": 1})
    with pytest.raises(tg.DTypeError, match="jit: f must be a function"):
        tg.jit(3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.ArgumentTypeError, match=r"jit\(f\): f does not take the 3 "
                       r"positional arguments given \(.*f\(\) takes from 1 to 2") as caught:
        tg.jit(f)(np.ones(1), 2, 3)  # pyright: ignore[reportCallIssue]
    assert "test_jit.py:" in str(caught.value)  # the call above


def test_a_type_error_inside_f_passes_through_jit() -> None:
    def f(x: Any) -> tg.AnyTensor:
        raise TypeError("f's own")

    with pytest.raises(TypeError, match="f's own") as caught:
        tg.jit(f)(np.ones(1))
    assert not isinstance(caught.value, tg.TapegradError)


def test_keyword_arguments_take_their_parameters_positions() -> None:
    """As JAX's jit: keywords are bound to f's parameters, so static_argnums and
    donate_argnums (positions) see them; a skipped parameter takes its default, trailing ones
    stay f's own; keyword-only parameters have no position and are refused by name."""
    def step(w: tg.AnyTensor, x: Any, scale: float = 2.0, shift: float = 0.0,
             mode: str = "sum") -> tg.AnyTensor:
        tape, wi = tg.leaf(tg.Tape(), w)
        tape, y = tg.mul(tape, wi, scale)
        tape, y = tg.add(tape, y, shift)
        tape, xi = tg.leaf(tape, x)
        tape, y = tg.add(tape, y, xi)
        return tg.value(tape, y)

    jitted = tg.jit(step, static_argnums=4)
    w = tg.AnyTensor.from_numpy(np.array([1.0, 2.0], np.float32))
    x = np.array([0.5, 0.25], np.float32)
    for shift in (1.0, 3.0, 5.0):  # past the recording and its checks: replayed
        got = jitted(w, x=x, shift=shift).numpy()
        np.testing.assert_array_equal(got, step(w, x, shift=shift).numpy())
    np.testing.assert_array_equal(jitted(w, x, 3.0, mode="sum").numpy(),
                                  step(w, x, 3.0).numpy())

    def keyword_only(w: tg.AnyTensor, *, lr: float) -> tg.AnyTensor:
        return w

    with pytest.raises(tg.ArgumentTypeError, match=r"jit\(keyword_only\): lr has no position in "
                       r"f's parameters \(keyword-only or \*\*kwargs\)"):
        tg.jit(keyword_only)(w, lr=0.1)


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
    with pytest.warns(tg.JitCacheWarning, match=r"jit\(f\): 2 signatures are kept; the oldest "
                      r"\(float64\[1\]\) was evicted"):
        g(np.ones(3))
    assert g.signatures == 2
    with pytest.warns(tg.JitCacheWarning):
        g(np.ones(1))  # evicted: traced again
    assert g.traces == 4


# --- the compiled step: replay, and the checks that keep it equal to eager ---------------------

def _out(recorded: tuple[tg.Tape, tg.Id]) -> tg.AnyTensor:
    tape, out = recorded
    return tg.value(tape, out)


def _exp_sum_grad(x: Any) -> tg.AnyTensor:
    """The gradient of sum(exp(x)): a step whose backward seeds with a kept constant."""
    tape, i = tg.leaf(tg.Tape(), x, requires_grad=True)
    tape, e = tg.exp(tape, i)
    tape, s = tg.sum(tape, e)
    return tg.backward(tape, s, wrt=[i])[i]


def _bytes(tree: Any) -> list[bytes]:
    out: list[bytes] = []
    tg.tree_map(lambda t: out.append(np.asarray(t).tobytes()), tree)
    return out


def test_later_calls_replay_without_running_f_and_equal_eager_bitwise() -> None:
    runs: list[int] = []

    def step(params: Any, state: Any, x: Any, y: Any, lr: float) -> Any:
        runs.append(1)
        return _step(params, state, x, y, lr)

    params, x, y = _data(np.float32)
    e_params, e_state, j_params, j_state = params, None, params, None
    g = tg.jit(step)
    for k in range(8):
        lr = 0.05 * 0.9 ** k  # a schedule: new numbers each call, one program
        e_params, e_state, e_loss = _step(e_params, e_state, x, y, lr)
        j_params, j_state, j_loss = g(j_params, j_state, x, y, lr)
        assert _bytes((j_params, j_state, j_loss)) == _bytes((e_params, e_state, e_loss))
        assert j_state["step"] == e_state["step"] == k + 1
        assert type(j_state["step"]) is int  # a plain number, not the recording's
    # calls 1 and 2 record (state None, then a dict); the second program's calls 2 and 3
    # (calls 3 and 4 here) check it by running f again; the others replay
    assert (g.traces, g.checks, g.replays) == (2, 2, 4)
    # f ran for the surveys (the probe's runs on other arrays among them) and the checks
    assert 2 <= g.surveys <= 2 * (_jit.SURVEYS + 1) and len(runs) == g.surveys + g.checks


def test_checks_come_at_calls_2_and_3_then_at_powers_of_two_from_128() -> None:
    # A check runs f again (2-5 eager steps): none between call 3 and call 128, so that a loop's
    # early steps are replays; then one per doubling of the calls, for as long as it runs.
    checked = [n for n in range(1, 1100) if _jit._checked_at(n, _jit.CHECK_CALLS)]
    assert checked == [2, 3, 128, 256, 512, 1024]
    assert sorted(_jit.CHECK_CHANGED) == [1, 2]  # the first two calls with other numbers


def test_numbers_that_change_every_call_add_no_late_checks() -> None:
    """A step count or a schedule changes the numbers on every call: the first two such calls
    check (calls 2 and 3 here, as CHECK_CALLS would), and later checks come at the calls'
    powers of two only, not also at the next call, when the count of changed ones gets there."""
    def f(x: Any, k: int) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        return _out(tg.mul(tape, i, k))

    g = tg.jit(f)
    x = np.ones(2, np.float32)
    for k in range(300):
        assert g(x, k).numpy().tolist() == [float(k)] * 2
    assert (g.traces, g.checks, g.replays) == (1, 4, 295)  # calls 2, 3, 128 and 256


def test_replays_take_new_arrays_and_give_fresh_results() -> None:
    def f(x: Any, w: Any) -> Any:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, j = tg.leaf(tape, w)
        tape, s = tg.matmul(tape, i, j)
        tape, s = tg.tanh(tape, s)
        return tg.value(tape, s), tg.value(tape, j)

    g = tg.jit(f)
    rng = np.random.default_rng(1)
    given = [(rng.standard_normal((4, 3)), tg.AnyTensor(rng.standard_normal((3, 2))))
             for _ in range(6)]
    results = [g(x, w) for x, w in given]
    assert (g.traces, g.checks, g.replays) == (1, 2, 3)
    for (x, w), (s, w_out) in zip(given, results, strict=True):  # earlier results kept
        assert s.numpy().tobytes() == f(x, w)[0].numpy().tobytes()
        np.testing.assert_allclose(s.numpy(), np.tanh(x @ w.numpy()), rtol=1e-14)
        assert w_out.numpy().tobytes() == w.numpy().tobytes()


def test_dropout_seeds_and_python_arithmetic_on_numbers_replay() -> None:
    def f(x: Any, seed: int, scale: float) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, d = tg.dropout(tape, i, 0.5, seed * 7 + 1)
        tape, d = tg.mul(tape, d, scale * 2 - 1)
        return tg.value(tape, d)

    g = tg.jit(f)
    x = np.arange(1.0, 65.0, dtype=np.float32)
    for k in range(6):
        got, want = g(x, k, 1.5 + k), f(x, k, 1.5 + k)
        assert got.numpy().tobytes() == want.numpy().tobytes()
    assert (g.traces, g.checks, g.replays) == (1, 2, 3)


def test_a_branch_on_a_number_records_a_variant_per_outcome() -> None:
    def f(x: Any, t: float) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, out = tg.exp(tape, i) if t > 0 else tg.neg(tape, i)
        return tg.value(tape, out)

    g = tg.jit(f)
    x = np.linspace(-1, 1, 5)
    for t in (1.0, 2.0, -1.0, 3.0, -2.0, -3.0, 4.0):
        got = g(x, t).numpy()
        assert got.tobytes() == f(x, t).numpy().tobytes()
        np.testing.assert_allclose(got, np.exp(x) if t > 0 else -x, rtol=1e-14)
    # t > 0: recorded at 1.0, checked at 2.0 and 3.0, replayed at 4.0; t <= 0 likewise
    assert (g.traces, g.checks, g.replays) == (2, 4, 1)


def test_host_work_on_the_inputs_is_found_and_runs_eagerly() -> None:
    def f(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x * 2)  # numpy on the input: invisible to a recording
        return _out(tg.relu(tape, i))

    g = tg.jit(f)
    # Found at the first call, by its run on other data (`_jit.Jitted._probe`).
    with pytest.warns(tg.JitWarning, match=r"jit\(f\) runs this signature eagerly: the step "
                      r"uploads host data that changed with its input arrays"):
        np.testing.assert_array_equal(g(np.ones(3)).numpy(), [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(g(np.full(3, 3.0)).numpy(), [6.0, 6.0, 6.0])
    np.testing.assert_array_equal(g(np.full(3, 4.0)).numpy(), [8.0, 8.0, 8.0])
    assert g.replays == 0


def test_the_probe_computes_a_closure_tensor_only_its_branch_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs the step on other arrays, kernels and all: a tensor from outside the
    step that only the probe's branch reads (a pending product, a deferred product) gets its
    true values there, and the step's stand-ins for its tensor arguments are copies made by
    the driver, no kernel (a gather compiled for them on a cold first call)."""
    import pyopencl as cl

    tape, a = tg.leaf(tg.Tape(), np.arange(1.0, 5.0))
    tape, pending = tg.mul(tape, a, 5.0)
    tape, row = tg.reshape(tape, a, (1, 4))
    tape, column = tg.reshape(tape, a, (4, 1))
    tape, deferred = tg.matmul(tape, row, column)
    outside = {"pending": tg.value(tape, pending), "deferred": tg.value(tape, deferred)}

    def f(x: Any, w: Any) -> Any:
        t, i = tg.leaf(tg.Tape(), x)
        t, v = tg.leaf(t, w)
        if float(np.sum(x)) > 0:  # host work on the input: the probe takes the other branch
            return _out(tg.mul(t, i, v))
        t, c = tg.leaf(t, outside["pending"])
        t, d = tg.leaf(t, outside["deferred"])
        t, c = tg.mul(t, c, d)
        return _out(tg.mul(t, i, c))

    copies: Any = _jit._tensor_copies  # pyright: ignore[reportPrivateUsage]
    kernels: list[str] = []
    enqueue = cl.enqueue_nd_range_kernel

    def counting(queue: Any, kernel: Any, *args: Any, **kwargs: Any) -> Any:
        kernels.append(str(kernel.function_name))
        return enqueue(queue, kernel, *args, **kwargs)

    def copying(arrays: Any) -> Any:
        tg.default_device().finish()  # launches held until now are the recording's
        monkeypatch.setattr(cl, "enqueue_nd_range_kernel", counting)
        try:
            return copies(arrays)
        finally:
            monkeypatch.setattr(cl, "enqueue_nd_range_kernel", enqueue)

    monkeypatch.setattr(_jit, "_tensor_copies", copying)
    g = tg.jit(f)
    w = tg.AnyTensor(np.full(4, 2.0))
    with pytest.warns(tg.JitWarning, match="runs this signature eagerly"):
        np.testing.assert_array_equal(g(np.ones(4), w).numpy(), np.full(4, 2.0))
    assert kernels == []
    np.testing.assert_array_equal(outside["pending"].numpy(), [5.0, 10.0, 15.0, 20.0])
    np.testing.assert_array_equal(outside["deferred"].numpy(), [[30.0]])
    np.testing.assert_array_equal(g(-np.ones(4), w).numpy(), [[-150.0, -300.0, -450.0, -600.0]])


def test_a_tensor_kept_from_a_check_holds_the_calls_values() -> None:
    """A check (calls 2 and 3) runs the step, kernels and all: a tensor the step appends to a
    list there holds that call's value, as its result does."""
    kept: list[tg.AnyTensor] = []

    def f(x: Any) -> Any:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, y = tg.mul(tape, i, 3.0)
        kept.append(tg.value(tape, y))
        return tg.value(tape, y)

    g = tg.jit(f)
    for k in range(1, 4):
        kept.clear()
        out = g(np.full(2, float(k)))
        np.testing.assert_array_equal(out.numpy(), [3.0 * k, 3.0 * k])
        if k > 1:  # a check: one run
            assert g.checks == k - 1 and len(kept) == 1
            np.testing.assert_array_equal(kept[0].numpy(), [3.0 * k, 3.0 * k])


def test_an_input_reshaped_or_sliced_with_numpy_is_never_replayed_stale() -> None:
    """A reshape of an input (its contents, uploaded) is followed: it replays with each call's
    data. A slice or a conversion (other contents) runs eagerly from the first call, before
    a batch that repeats over the first calls could hide it until a check."""
    def flat(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x.reshape(x.shape[0], -1))
        return _out(tg.sum(tape, i, axis=1))

    def shifted(tokens: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), tokens[:, :-1])
        return _out(tg.sum(tape, i, axis=1))

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    g = tg.jit(flat)
    for x in (a, a, a, b, a, b):  # call 4 is a replay, with new data
        assert g(x).numpy().tobytes() == flat(x).numpy().tobytes()
    assert g.replays >= 2 and g.traces == 1
    h = tg.jit(shifted)
    ta, tb = np.arange(12.0).reshape(3, 4), np.arange(12.0).reshape(3, 4) * 10
    with pytest.warns(tg.JitWarning, match="changed with its input arrays"):
        assert h(ta).numpy().tolist() == shifted(ta).numpy().tolist()
    for t in (ta, ta, tb, tb):
        assert h(t).numpy().tolist() == shifted(t).numpy().tolist()
    assert h.replays == 0


def test_a_constant_that_equals_an_input_is_not_taken_for_it() -> None:
    def f(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, z = tg.leaf(tape, np.zeros(3))  # equal to the first call's x
        return _out(tg.add(tape, i, z))

    g = tg.jit(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)  # a constant, not host work
        for x in (np.zeros(3), np.zeros(3), np.zeros(3), np.arange(3.0), np.ones(3)):
            np.testing.assert_array_equal(g(x).numpy(), x)
    assert g.replays == 2 and g.traces == 1  # calls 4 and 5 (calls 2 and 3 are checks)


def test_equal_inputs_reshaped_with_numpy_are_told_apart() -> None:
    def f(x: Any, y: Any) -> tg.AnyTensor:  # y reshaped on the host: read as y on replay
        tape, i = tg.leaf(tg.Tape(), x)
        tape, j = tg.leaf(tape, y.reshape(2, 2))
        return _out(tg.sub(tape, i, j))

    g = tg.jit(f)
    zeros = np.zeros((2, 2))
    for x, y in ((zeros, zeros.ravel()), (zeros, zeros.ravel()), (zeros, zeros.ravel()),
                 (np.arange(4.0).reshape(2, 2), np.ones(4)), (np.ones((2, 2)), np.arange(4.0))):
        assert g(x, y).numpy().tobytes() == f(x, y).numpy().tobytes()
    assert g.replays >= 1 and g.traces == 1


def test_a_number_through_math_is_found_at_the_first_check() -> None:
    import math

    def f(x: Any, t: float) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        return _out(tg.mul(tape, i, math.exp(t)))  # math reads the float's C value

    g = tg.jit(f)
    x = np.ones(2)
    assert g(x, 0.0).numpy().tolist() == [1.0, 1.0]
    # the check gives t a decoy value for C code: exp(decoy) differs from the program's
    with pytest.warns(tg.JitWarning, match="by a path Python arithmetic on it does not show"):
        assert g(x, 0.0).numpy().tolist() == [1.0, 1.0]  # and the call's result is eager's
    assert g(x, 2.0).numpy().tolist() == [math.exp(2.0)] * 2


def test_an_int_step_on_the_right_of_a_plain_number_stays_traced() -> None:
    """A plain float on the left of an int argument (0.5 ** (step // 40), base * step / warmup)
    finds no int there and asks the traced int, so a schedule written either way round is one
    program: replayed, bitwise eager's, no warning."""
    def f(x: Any, step: int) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, i = tg.mul(tape, i, 0.5 ** (step // 40))
        return _out(tg.mul(tape, i, 1e-3 * step / 100 + 2 * step))

    g = tg.jit(f)
    x = np.ones(2)
    _same_bits_quietly(g, f, [(x, step) for step in range(100)])
    assert g.traces == 1 and g.replays > 80


def test_a_schedule_through_numpy_functions_stays_traced() -> None:
    """numpy's functions of numbers (np.cos, np.minimum, np.sqrt) follow a traced number as
    its arithmetic does: a cosine schedule with warmup is one program; a comparison through
    numpy is a decision, noted as a guard."""
    def f(x: Any, step: int) -> tg.AnyTensor:
        warm = np.minimum(1.0, (step + 1) / 10)
        lr = 0.1 * warm * 0.5 * (1 + np.cos(np.pi * step / 50)) / np.sqrt(step + 1)
        tape, i = tg.leaf(tg.Tape(), x)
        tape, i = tg.mul(tape, i, lr)
        if np.greater(step, 30):  # a decision: a guard, recorded again past it
            tape, i = tg.add(tape, i, 1.0)
        return _out(tg.sum(tape, i))

    g = tg.jit(f)
    x = np.ones(3, np.float32)
    _same_bits_quietly(g, f, [(x, step) for step in range(50)])
    assert g.traces == 2 and g.replays > 40


def test_an_int_argument_reaches_transforms_and_leaves_as_an_int() -> None:
    """A traced int passes through value_and_grad to the loss as a number (a dropout seed,
    traced: one program), and made a leaf it is its value (a guard: a program per value)."""
    def loss(tape: tg.Tape, w: tg.Id, x: tg.Id, seed: int) -> tuple[tg.Tape, tg.Id]:
        tape, h = tg.mul(tape, w, x)
        tape, h = tg.dropout(tape, h, 0.5, seed)
        return tg.sum(tape, h)

    value_and_grad = tg.value_and_grad(loss)

    def step(w: Any, x: Any, seed: int) -> Any:
        return value_and_grad(w, x, seed)

    def as_leaf(x: Any, k: int) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, n = tg.leaf(tape, k)
        tape, n = tg.astype(tape, n, np.float32)
        return _out(tg.mul(tape, i, n))

    w, x = np.ones(8, np.float32), np.arange(8, dtype=np.float32)
    g, h = tg.jit(step), tg.jit(as_leaf)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        for seed in range(6):
            (lj, gj), (le, ge) = g(w, x, seed), step(w, x, seed)
            assert lj.numpy().tobytes() == le.numpy().tobytes()
            assert gj.numpy().tobytes() == ge.numpy().tobytes()
        for k in (2, 2, 3, 3, 2):
            assert h(x, k).numpy().tobytes() == as_leaf(x, k).numpy().tobytes()
    assert g.traces == 1 and h.traces == 2


def test_an_int_argument_has_an_ints_surface_and_code_needing_a_real_int_runs_eagerly() -> None:
    """A traced int answers int's methods and numpy (np.array([k, 1]), bit_length: its
    value, a guard), compares with int64 ids as an int, and code that needs a real int (a
    host random seed) makes that signature run eagerly with a warning saying why."""
    import numbers

    def f(x: Any, k: int) -> tuple[tg.AnyTensor, tg.AnyTensor]:
        assert isinstance(k, numbers.Integral)
        tape, i = tg.leaf(tg.Tape(), x)
        tape, n = tg.leaf(tape, np.array([k, k.bit_length()]))
        tape, big = tg.greater(tape, i, k)  # int64 against an int past 2^53: as ints
        return tg.value(tape, big), tg.value(tape, n)

    x = np.array([2**53 + 1, 2**53], np.int64)
    g = tg.jit(f)
    for k in (2**53, 2**53, 2**53 - 1):
        assert [t.numpy().tolist() for t in g(x, k)] == [t.numpy().tolist() for t in f(x, k)]
    assert g(x, 2**53)[0].numpy().tolist() == [True, False]

    def seeded(x: Any, k: int) -> tg.AnyTensor:
        noise = np.random.default_rng(k).standard_normal(2).astype(np.float32)
        tape, i = tg.leaf(tg.Tape(), x + noise)
        return _out(tg.mul(tape, i, 2.0))

    h = tg.jit(seeded)
    x2 = np.ones(2, np.float32)
    with pytest.warns(tg.JitWarning, match="needs a real int"):
        assert h(x2, 3).numpy().tobytes() == seeded(x2, 3).numpy().tobytes()
    assert h(x2, 4).numpy().tobytes() == seeded(x2, 4).numpy().tobytes()


def test_labels_outside_the_recorded_range_replay_where_the_loss_accepts_them() -> None:
    """The recording notes the classes cross_entropy accepts its labels in: label tensors
    outside the recorded range but inside those replay with no checking run, bitwise the
    eager call's; labels past them run f, whose op raises as eagerly."""
    def f(logits: Any, labels: Any) -> tg.AnyTensor:
        tape, z = tg.leaf(tg.Tape(), logits)
        tape, y = tg.leaf(tape, labels)
        return _out(tg.cross_entropy(tape, z, y))

    def labels(values: list[int]) -> tg.AnyTensor:
        return tg.AnyTensor.from_numpy(np.array(values))

    g = tg.jit(f)
    logits = np.random.default_rng(2).standard_normal((4, 5))
    for values in ([0, 1, 1, 0], [1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]):
        g(logits, labels(values))
    assert (g.replays, g.checks) == (1, 2)
    want = f(logits, labels([4, 0, 2, 3]))
    assert g(logits, labels([4, 0, 2, 3])).numpy().tobytes() == want.numpy().tobytes()
    assert (g.replays, g.checks) == (2, 2)
    for bad in ([5, 0, 0, 0], [-1, 0, 0, 0]):
        with pytest.raises(tg.IndexRangeError, match="out of bounds for 5 classes"):
            g(logits, labels(bad))
    assert g.checks == 4
    for _ in range(2):
        g(logits, labels([3, 4, 0, 2]))
    assert g.replays == 4


def _class_count(labels: np.ndarray[Any, Any]) -> float:
    return 1.0 / (int(labels.max()) + 1)


def _top_class(labels: np.ndarray[Any, Any]) -> float:
    return 2.0 if int(labels.max()) >= 4 else 1.0


def _has_a_two(labels: np.ndarray[Any, Any]) -> float:
    return 2.0 if bool(np.any(labels == 2)) else 1.0


def _first_label(labels: np.ndarray[Any, Any]) -> float:
    return float(labels[0] + 1)


@pytest.mark.parametrize("host_scale", [_class_count, _top_class, _has_a_two, _first_label])
def test_numpy_labels_outside_the_recorded_range_are_checked_again(
        host_scale: Callable[[np.ndarray[Any, Any]], float]) -> None:
    """f may compute from numpy labels on the host (a class count, a threshold, a value's
    presence, an element), which the probe's other data need not show: numpy labels past the
    recorded range run a check, which finds that work and gives the signature to eager (no
    bounds are taken for numpy inputs). Every call's result is the eager call's."""
    def f(logits: Any, labels: Any) -> tg.AnyTensor:
        scale = host_scale(labels)
        tape, z = tg.leaf(tg.Tape(), logits)
        tape, y = tg.leaf(tape, labels)
        tape, loss = tg.cross_entropy(tape, z, y)
        return _out(tg.mul(tape, loss, scale))

    g = tg.jit(f)
    logits = np.random.default_rng(2).standard_normal((4, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.JitWarning)
        for values in ([0, 1, 1, 0], [1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1],
                       [4, 0, 2, 3], [2, 2, 1, 0], [0, 3, 3, 1]):
            want = f(logits, np.array(values)).numpy().tobytes()
            assert g(logits, np.array(values)).numpy().tobytes() == want, values


def test_ids_replay_in_every_range_checks_bounds_and_are_checked_past_them() -> None:
    """Token ids read by an embedding (rows 0..5) and by a take from a 3-row table: a replay
    takes ids in the narrower bounds, negative ones too (take wraps them), with no checking
    run; ids in the embedding's bounds only run f, whose take raises."""
    rng = np.random.default_rng(4)
    table = rng.standard_normal((6, 3)).astype(np.float32)
    small = rng.standard_normal((3, 2)).astype(np.float32)

    def f(ids: Any) -> tg.AnyTensor:
        tape, t = tg.leaf(tg.Tape(), table)
        tape, s = tg.leaf(tape, small)
        tape, i = tg.leaf(tape, ids)
        tape, e = tg.embedding(tape, t, i)
        tape, w = tg.take(tape, s, i, axis=0)
        tape, e = tg.sum(tape, e)
        tape, w = tg.sum(tape, w)
        return _out(tg.add(tape, e, w))

    def tensor(values: list[int]) -> tg.AnyTensor:
        return tg.AnyTensor.from_numpy(np.array(values))

    g = tg.jit(f)
    for ids in ([0, 1, 1], [1, 0, 1], [0, 0, 1], [1, 1, 0]):
        g(tensor(ids))
    checks = g.checks
    for ids in ([2, 0, 1], [-3, 2, -1]):
        want = f(tensor(ids)).numpy().tobytes()
        assert g(tensor(ids)).numpy().tobytes() == want
    assert g.checks == checks
    with pytest.raises(tg.IndexRangeError, match="take: index 4 is out of bounds"):
        g(tensor([4, 0, 1]))
    assert g.checks == checks + 1


def test_a_range_check_of_a_tensor_made_from_inputs_keeps_the_checking_run() -> None:
    """Labels concatenated from two inputs are checked as one tensor, which is neither: the
    recording cannot say which input the check bounds, and a wider range of either runs f
    and compares, as before."""
    def f(logits: Any, a: Any, b: Any) -> tg.AnyTensor:
        tape, z = tg.leaf(tg.Tape(), logits)
        tape, ya = tg.leaf(tape, a)
        tape, yb = tg.leaf(tape, b)
        tape, y = tg.concat(tape, [ya, yb], axis=0)
        return _out(tg.cross_entropy(tape, z, y))

    def tensor(values: list[int]) -> tg.AnyTensor:
        return tg.AnyTensor.from_numpy(np.array(values))

    g = tg.jit(f)
    logits = np.random.default_rng(5).standard_normal((4, 5))
    for _ in range(4):
        g(logits, tensor([0, 1]), tensor([1, 0]))
    checks = g.checks
    want = f(logits, tensor([3, 1]), tensor([1, 0])).numpy().tobytes()
    assert g(logits, tensor([3, 1]), tensor([1, 0])).numpy().tobytes() == want
    assert g.checks == checks + 1


def test_a_jitted_step_inside_another_is_part_of_its_recording() -> None:
    def inner(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        return _out(tg.sin(tape, i))

    inner_jit = tg.jit(inner)

    def outer(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), inner_jit(x))
        return _out(tg.cos(tape, i))

    g = tg.jit(outer)
    for k in range(4):
        x = np.full(3, float(k))
        got = g(x).numpy()
        assert got.tobytes() == outer(x).numpy().tobytes()
        np.testing.assert_allclose(got, np.cos(np.sin(x)), rtol=1e-14)
    assert g.replays == 1


def test_the_program_can_be_printed() -> None:
    def f(x: Any, lr: float) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, e = tg.exp(tape, i)
        tape, s = tg.sum(tape, e)
        return _out(tg.mul(tape, s, lr))

    g = tg.jit(f)
    g(np.ones(4), 0.5)
    text = g.describe()
    assert text.startswith("program f: ")
    assert "1 scalars from numbers" in text and "launches" in text


def test_traced_numbers_follow_arithmetic_and_guard_decisions() -> None:
    from tapegrad._traced import Guards, as_float, as_index, fn_of, plain, traced

    guards = Guards()
    step = traced(3, lambda n: n[0], guards)
    lr = traced(0.5, lambda n: n[1], guards)
    c = 1.0 - 0.9 ** as_float(as_index(step) + 1)
    y = lr * 2 / c - (step % 2)
    assert plain(y) == 0.5 * 2 / (1.0 - 0.9 ** 4.0) - 1
    assert fn_of(y)([5, 1.0]) == 1.0 * 2 / (1.0 - 0.9 ** 6.0) - 1
    assert not guards.facts  # arithmetic decides nothing
    assert plain(min(step, 1 << 30)) == 3 and int(lr * 3) == 1  # decisions: guards
    assert guards.hold([4, 0.5]) and not guards.hold([2 ** 31, 0.5])
    assert not guards.hold([4, 0.9])  # int(0.9 * 3) is 2, not 1


def test_constants_kept_by_tapegrad_between_recordings_are_constants(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tapegrad import _kernels

    # The backward's seed of ones is uploaded by the first recording and kept by tapegrad, so
    # the checking recording finds it made: the two must still compare equal.
    monkeypatch.setattr(_kernels, "_CONSTANTS", {})
    # with its id -> value table: the test's constants die with it, and an id kept in the
    # shared table would make a later tensor at the same address look like a constant
    monkeypatch.setattr(_kernels, "_VALUES", {})

    g = tg.jit(_exp_sum_grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(4):
            x = np.full(3, float(k), np.float32)
            assert g(x).numpy().tobytes() == _exp_sum_grad(x).numpy().tobytes()
    assert (g.checks, g.replays) == (2, 1)


def test_numpy_numbers_are_values_and_numpy_flags_part_of_the_signature() -> None:
    """A numpy float or int (a schedule's np.cos(...), a seed from rng.integers) is a value of
    the program, as a Python number (JAX traces them too), its type part of the signature; a
    numpy bool is a flag, by value."""
    def f(x: Any, lr: Any, seed: Any, train: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, out = tg.mul(tape, i, lr * np.float32(3.0))  # float32 arithmetic, as eagerly
        if train:
            tape, out = tg.dropout(tape, out, 0.5, seed)
        return tg.value(tape, out)

    g = tg.jit(f)
    x = np.arange(1.0, 9.0, dtype=np.float32)
    rng = np.random.default_rng(0)
    calls = [(np.float32(0.1 * k), rng.integers(0, 2**40), np.True_) for k in range(1, 7)]
    calls += [(np.float32(0.05), np.int64(5), np.False_), (np.float64(0.05), np.int64(5),
                                                           np.False_)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for lr, seed, train in calls:
            assert g(x, lr, seed, train).numpy().tobytes() == (
                f(x, lr, seed, train).numpy().tobytes())
    assert g.signatures == 3  # the flag's two values, then a float64 lr
    assert g.replays >= 2


def test_numpy_numbers_made_host_data_keep_their_dtypes() -> None:
    """`tg.leaf` of a numpy number argument gives the dtype it gives eagerly (float64 stays
    float64, int32 int32), not a Python number's."""
    def f(x: Any, c: Any, k: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, cc = tg.leaf(tape, c)
        tape, kk = tg.leaf(tape, k)
        assert (cc.dtype, kk.dtype) == (np.float64, np.int32)
        tape, kk = tg.astype(tape, kk, np.float64)
        tape, out = tg.mul(tape, i, cc)
        return _out(tg.add(tape, out, kk))

    g = tg.jit(f)
    x = np.ones(3)
    for n in range(5):
        got = g(x, np.float64(0.5 + n), np.int32(n)).numpy()
        assert got.tobytes() == f(x, np.float64(0.5 + n), np.int32(n)).numpy().tobytes()


def test_a_numpy_scalar_kept_by_value_that_changes_says_once_to_pass_a_python_number(
        ) -> None:
    """float16 stays a value of the signature (kernels hold no float16): each new value a
    program, said once."""
    def f(x: Any, lr: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        return _out(tg.mul(tape, i, lr))

    g = tg.jit(f)
    x = np.ones((2, 3), np.float32)
    g(x, np.float16(0.5))
    with pytest.warns(tg.JitCacheWarning, match=r"a numpy scalar argument changed value "
                      r"\(args\[1\]: np.float16\(0.5\) -> np.float16\(0.25\)\).*Pass a "
                      r"Python number"):
        g(x, np.float16(0.25))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g(x, np.float16(0.125))  # said once
        g(x, 0.5)  # a Python number: one more signature, a value of its program
        g(x, 0.25)
    assert g.signatures == 4


def test_numpy_flags_and_strings_give_no_hint_and_read_well(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_jit, "CACHE_SIZE", 2)

    def f(x: Any, flag: Any, label: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        return _out(tg.mul(tape, i, 2.0 if flag else 1.0))

    g = tg.jit(f)
    x = np.ones(2, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g(x, np.True_, np.str_(""))
        g(x, np.False_, np.str_(""))  # a flag changed: no hint to pass a Python number
    with pytest.warns(tg.JitCacheWarning, match=r"the oldest \(float32\[2\], np.bool\(True\), "
                      r"np.str_\(''\)\) was evicted"):
        g(x, np.True_, np.str_("a"))


def test_an_int_used_as_a_python_index_is_found_by_the_checks() -> None:
    def f(x: Any, k: int) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, outs = tg.split(tape, i, 4)
        return tg.value(tape, outs[k // 2])  # a decision no recording sees

    g = tg.jit(f)
    x = np.arange(8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.JitWarning)
        for k in (0, 0, 1, 2, 4, 6, 5):
            assert g(x, k).numpy().tolist() == f(x, k).numpy().tolist()


def test_host_work_on_inputs_is_found_when_the_data_first_repeats() -> None:
    def f(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x.astype(np.float32))
        return _out(tg.sum(tape, i))

    g = tg.jit(f)
    a, b = np.ones(4), np.full(4, 5.0)
    with pytest.warns(tg.JitWarning):
        for x in (a, a, b, b):
            assert g(x).numpy() == f(x).numpy()


def test_a_tensor_read_from_outside_the_arguments_is_found_when_it_changes() -> None:
    weights = {"w": tg.AnyTensor(np.ones(3))}

    def f(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, w = tg.leaf(tape, weights["w"])  # a global: a constant of the recording
        return _out(tg.mul(tape, i, w))

    g = tg.jit(f)
    x = np.arange(3.0)
    with pytest.warns(tg.JitWarning, match="did not make the same device work"):
        for k in range(4):
            weights["w"] = tg.AnyTensor(np.full(3, float(k)))
            assert g(x).numpy().tolist() == (x * k).tolist()


def test_the_program_can_be_drawn() -> None:
    g = tg.jit(_exp_sum_grad)
    with pytest.raises(tg.TapegradError, match="no program recorded yet"):
        g.to_dot()
    g(np.ones(5))
    dot = g.to_dot()
    assert dot.startswith("digraph program {") and dot.rstrip().endswith("}")
    assert 'in0 [shape=ellipse, label="input 0"];' in dot
    assert 'out0 [shape=ellipse, style=filled, label="output 0"];' in dot
    assert "in0 -> l0;" in dot and " -> out0;" in dot


def test_a_numpy_float64_argument_does_not_shift_the_numbers_after_it() -> None:
    # np.float64 is a float and a number of its own slot: the numbers after it keep theirs
    def f(x: Any, c: Any, a: float, b: float) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, o = tg.mul(tape, i, a)
        return _out(tg.add(tape, o, c))

    g = tg.jit(f)
    x = np.ones(2)
    for k in range(8):
        a, b = float(k), 10.0 * k
        assert g(x, np.float64(0.5), a, b).numpy().tolist() == [k + 0.5] * 2
    assert g.replays > 0


def test_replayed_labels_keep_their_range_for_later_checks() -> None:
    def f(labels: Any) -> tg.AnyTensor:
        tape, y = tg.leaf(tg.Tape(), labels)
        return _out(tg.reshape(tape, y, (2, 2)))  # the input's own data, reshaped

    g = tg.jit(f)
    outs = [g(np.array([0, 1, 2, k % 3])) for k in range(6)]
    out = outs[-1]
    assert g.replays > 0
    from tapegrad._tensor import host_range

    assert host_range(out) == (0, 2)  # as an eager call's result has it
    tape, table = tg.leaf(tg.Tape(), np.zeros((2, 3)))
    tape, bad = tg.leaf(tape, g(np.array([0, 1, 2, 5])))  # out of range: an eager run, checked
    with pytest.raises(tg.IndexRangeError):
        tg.take(tape, table, bad, axis=1)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_replayed_integer_results_made_from_inputs_keep_their_range(as_tensor: bool) -> None:
    """A result made by moving integer inputs (a concatenation, a cast) has the range an
    eager call gives it, from this call's inputs, so a later take checks it as eagerly."""
    from tapegrad._tensor import host_range

    def f(a: Any, b: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), a)
        tape, j = tg.leaf(tape, b)
        tape, c = tg.concat(tape, [i, j], axis=0)
        return _out(tg.astype(tape, c, np.int32))

    def given(values: list[int]) -> Any:
        array = np.array(values, np.int64)
        return tg.AnyTensor.from_numpy(array) if as_tensor else array

    g = tg.jit(f)
    for k in range(5):
        g(given([0, 1]), given([2, k % 2]))
    replays = g.replays
    out = g(given([1, 0]), given([2, 1]))
    assert g.replays == replays + 1
    want = f(given([1, 0]), given([2, 1]))
    assert host_range(out) == host_range(want) == (0, 2)
    tape, table = tg.leaf(tg.Tape(), np.zeros((2, 2)))
    for made in (out, want):  # index 2 of an axis of 2
        tape, bad = tg.leaf(tape, made)
        with pytest.raises(tg.IndexRangeError):
            tg.take(tape, table, bad, axis=1)


def test_arithmetic_with_numpy_scalars_keeps_a_number_traced() -> None:
    """`lr * np.float64(c)`, `np.float32(c) * lr` and `np.int64(k) * n` stay functions of the
    call's numbers, rounded as numpy rounds them eagerly: a number that changes later is
    replayed with its new value (it was a constant of the recording: a stale replay)."""
    scale = np.float64(0.75)

    def f(x: Any, a: float, b: float, n: int) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, y = tg.mul(tape, i, a)
        tape, y = tg.mul(tape, y, b * scale)
        tape, y = tg.mul(tape, y, np.float32(0.3) * b)
        return _out(tg.add(tape, y, np.int64(2) * n))

    g = tg.jit(f)
    x = np.ones(2, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        for k in range(8):
            b = 1.0 if k < 3 else 2.0 + k  # b changes first on a call that is not checked
            got, want = g(x, float(k + 2), b, k), f(x, float(k + 2), b, k)
            assert got.numpy().tobytes() == want.numpy().tobytes(), k
    assert g.traces == 1 and g.replays >= 4


def test_a_number_equal_to_a_constant_of_the_same_kernel_is_no_mismatch() -> None:
    """Equal scalars of a fused kernel share an argument; a traced number never joins a
    constant (or another number) it equals on one call, so that call's check records the
    program's kernel and the signature keeps replaying."""
    def f(x: Any, a: float, b: float) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, h = tg.mul(tape, i, a)
        tape, h = tg.add(tape, h, 2.0)
        return _out(tg.sub(tape, h, b))

    g = tg.jit(f)
    x = np.ones(4, np.float32)
    _same_bits_quietly(g, f, [(x, a, b) for a, b in [(1.5, 0.5), (2.0, 2.0), (2.5, 2.0),
                                                    (3.0, 1.0), (2.0, 3.0), (7.0, 7.0)]])
    assert g.traces == 1 and g.replays >= 2


def test_a_numpy_comparison_on_a_number_is_a_guard() -> None:
    """`np.float32(0.1) < lr` decides Python work: a guard, so each outcome is a variant of
    its own, and numpy scalar results combine with numbers without errors."""
    def f(x: Any, lr: float) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        scale = (1.0 if np.float32(0.1) < lr else 5.0) * (lr * np.bool_(True))
        return _out(tg.mul(tape, i, scale))

    g = tg.jit(f)
    x = np.ones(2, np.float32)
    _same_bits_quietly(g, f, [(x, lr) for lr in [0.3] * 4 + [2.0] * 4 + [0.05] * 4])
    assert g.traces <= 3


def test_an_int_argument_used_as_a_loop_count_is_a_guard() -> None:
    """range(n) asks the traced int for its value: a guard, so the program replays for that n
    and records again for another, without a warning."""
    def f(x: Any, n: int) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        for _ in range(n):
            tape, i = tg.mul(tape, i, 2.0)
        return _out(tg.sum(tape, i))

    g = tg.jit(f)
    x = np.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        assert [g(x, n).numpy() for n in (3, 3, 3, 4, 4, 3)] == [16.0] * 3 + [32.0] * 2 + [16.0]
    assert g.traces == 2


def test_an_error_of_f_on_a_checked_call_is_raised_and_the_program_stands() -> None:
    calls: list[int] = []

    def f(x: Any) -> tg.AnyTensor:
        calls.append(1)
        if len(calls) in (3, 4):  # the check of call 2 and its eager run
            raise ValueError("bad batch")
        tape, i = tg.leaf(tg.Tape(), x)
        return _out(tg.exp(tape, i))

    g = tg.jit(f)
    x = np.arange(3.0)
    g(x)  # a survey and the recording
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        with pytest.raises(ValueError, match="bad batch"):
            g(x)
        for _ in range(4):
            np.testing.assert_allclose(g(x).numpy(), np.exp(x), rtol=1e-15)
    assert g.replays >= 2 and g.traces == 1


def test_anomaly_mode_runs_a_jitted_step_eagerly_with_its_checks() -> None:
    def f(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x, requires_grad=True)
        tape, y = tg.log(tape, i)
        tape, s = tg.sum(tape, y)
        return tg.backward(tape, s)[i]

    g = tg.jit(f)
    for _ in range(4):
        g(np.ones(3))
    with tg.detect_anomaly(), pytest.raises(tg.AnomalyError, match=r"^log: .*NaN in 1 of 3"):
        g(np.array([1.0, -1.0, 2.0]))
    assert g.traces == 1

    def checked(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x, requires_grad=True)
        tape, s = tg.sum(tape, i)
        return tg.backward(tape, s, check_finite=True)[i]

    h = tg.jit(checked)
    with pytest.warns(tg.JitWarning, match=r"check_finite=True\) inside it"):
        np.testing.assert_array_equal(h(np.ones(2)).numpy(), [1.0, 1.0])
    with pytest.raises(tg.AnomalyError, match=r"holds Inf"):
        h(np.array([1.0, np.inf]))


@pytest.mark.parametrize(("first", "second"), [(0.0, -0.0), (1, True), ((1, "a"), (1.0, "a"))])
def test_static_values_equal_but_not_alike_are_signatures_of_their_own(
        first: Any, second: Any) -> None:
    def f(x: Any, c: float | tuple[float, str]) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        return _out(tg.mul(tape, i, float(c[0] if isinstance(c, tuple) else c)))

    g = tg.jit(f, static_argnums=1)
    x = np.array([1.0, -1.0])
    for _ in range(3):
        g(x, first)
    assert g(x, second).numpy().tobytes() == f(x, second).numpy().tobytes()
    assert g.signatures == 2


def test_threads_making_their_first_tensors_at_once_share_one_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from tapegrad import _device

    monkeypatch.setattr(_device, "_devices", None)
    monkeypatch.setattr(_device, "_default", None)
    found: list[Any] = []
    start = threading.Barrier(4)

    def first() -> None:
        start.wait()
        found.append(_device.default_device())

    threads = [threading.Thread(target=first) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 4 and all(d is found[0] for d in found)


@pytest.mark.parametrize("labels", [
    np.array([0, 1, 1, 2]),  # at slot 3 a rotation by k + 1 = 4 places leaves it as it was
    np.tile([0, 2, 1], 4),   # period 3: so does a rotation by 3 places
])
def test_labels_that_a_rotation_leaves_alike_still_replay(labels: np.ndarray[Any, Any]) -> None:
    # The probe's other data for int arrays must stay valid labels: a step of every label by
    # one put 2 out of range of 3 classes, the probe raised and the signature ran eagerly.
    def f(x: Any, w: Any, b: Any, y: Any) -> tg.AnyTensor:
        tape, xi = tg.leaf(tg.Tape(), x)
        tape, wi = tg.leaf(tape, w)
        tape, bi = tg.leaf(tape, b)
        tape, yi = tg.leaf(tape, y)
        tape, logits = tg.linear(tape, xi, wi, bi)
        return _out(tg.cross_entropy(tape, logits, yi))

    g = tg.jit(f)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    b = np.zeros(3, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        for _ in range(6):
            x = rng.standard_normal((labels.size, 5)).astype(np.float32)
            y = rng.permutation(labels) if labels.size > 4 else labels
            got = g(x, w, b, y if labels.size > 4 else labels)
            assert got.numpy().tobytes() == f(x, w, b, y).numpy().tobytes()
    assert g.traces == 1 and g.replays >= 2


def test_a_closure_tensor_that_was_also_an_argument_runs_eagerly_and_says_why() -> None:
    # An anchor penalty (FedProx, L2-SP): w0 read from the closure, and the first call's
    # parameters are w0 itself, one buffer, so the recording read both as the argument.
    w0 = tg.AnyTensor(np.linspace(-1.0, 1.0, 6).astype(np.float32))

    def step(w: Any, x: Any) -> tuple[tg.AnyTensor, tg.AnyTensor]:
        tape, wi = tg.leaf(tg.Tape(), w, requires_grad=True)
        tape, a = tg.leaf(tape, w0)
        tape, xi = tg.leaf(tape, x)
        tape, d = tg.sub(tape, wi, a)
        tape, d = tg.mul(tape, d, d)
        tape, fit = tg.mul(tape, wi, xi)
        tape, loss = tg.add(tape, fit, d)
        tape, loss = tg.sum(tape, loss)
        (g,) = tg.backward(tape, loss, wrt=[wi]).values()
        return tg.value(tape, loss), tg.optim.sgd(tg.value(tape, wi), g, None, lr=0.1)[0]

    g = tg.jit(step)
    we = wj = w0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tg.JitWarning)
        for k in range(4):  # the probe's copies of tensor arguments show it at the first call
            x = np.full(6, 0.5 * k, np.float32)
            le, we = step(we, x)
            lj, wj = g(wj, x)
            assert (lj.numpy().tobytes(), wj.numpy().tobytes()) == (
                le.numpy().tobytes(), we.numpy().tobytes())
    assert [str(w.message) for w in caught] == [
        f"jit(step) runs this signature eagerly: {_jit._ALIASED}"]
    assert g.checks == 0 and g.replays == 0  # a replay read the argument for the closure


def test_a_tape_or_an_id_as_an_argument_is_refused() -> None:
    # Hashable by identity, each call's tape was a new signature: a trace per call.
    def f(tape: tg.Tape, x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tape, x)
        return _out(tg.mul(tape, i, 2.0))

    g = tg.jit(f)
    with pytest.raises(tg.ArgumentTypeError, match=r"jit\(f\): args\[0\] is a Tape; .*builds "
                       r"its tape inside"):
        g(tg.Tape(), np.ones(2))
    _, i = tg.leaf(tg.Tape(), np.ones(2))

    def by_ids(ids: dict[str, tg.Id], x: Any) -> tg.AnyTensor:
        return tg.AnyTensor(x)

    h = tg.jit(by_ids)
    with pytest.raises(tg.ArgumentTypeError, match=r"args\[0\]\['a'\] is an Id"):
        h({"a": i}, np.ones(2))


def test_a_number_given_to_value_and_grad_stays_a_value_of_the_program() -> None:
    def loss(tape: tg.Tape, w: tg.Id, lam: float) -> tuple[tg.Tape, tg.Id]:
        tape, sq = tg.mul(tape, w, w)
        tape, sq = tg.mul(tape, sq, lam)
        return tg.sum(tape, sq)

    vg = tg.value_and_grad(loss)

    def step(w: Any, lam: float) -> tuple[tg.AnyTensor, tg.AnyTensor]:
        return vg(w, lam)

    g = tg.jit(step)
    w = np.linspace(-1.0, 1.0, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        for k in range(10):
            lam = 0.1 * (k + 1)
            got, want = g(w, lam), step(w, lam)
            assert [t.numpy().tobytes() for t in got] == [t.numpy().tobytes() for t in want]
    assert g.traces == 1 and g.replays >= 5


def test_a_step_waiting_on_its_own_jitted_function_in_another_thread_does_not_hang() -> None:
    # The recording thread holds the signature's lock while the step runs; a thread meeting
    # the signature then runs eagerly instead of waiting for it (it waited for good here).
    import concurrent.futures
    import threading

    pool = concurrent.futures.ThreadPoolExecutor(1)

    def f(x: Any, lr: float) -> tg.AnyTensor:
        if threading.current_thread() is threading.main_thread():
            return pool.submit(g, x, lr).result(timeout=60)
        tape, i = tg.leaf(tg.Tape(), x)
        return _out(tg.mul(tape, i, lr))

    g = tg.jit(f)
    x = np.linspace(-1.0, 1.0, 8).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.JitWarning)
        np.testing.assert_array_equal(g(x, 0.5).numpy(), x * np.float32(0.5))
    pool.shutdown()


def test_host_work_on_periodic_labels_is_found_at_the_first_call() -> None:
    # np.bincount of labels repeating with period 2: rotated by k + 1 = 2 places they were
    # alike, rotated by one they kept their counts; element k now takes another value.
    def f(x: Any, y: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, counts = tg.leaf(tape, np.bincount(y, minlength=3).astype(np.float32))
        return _out(tg.mul(tape, i, counts))

    g = tg.jit(f)
    x = np.ones(3, np.float32)
    with pytest.warns(tg.JitWarning, match="uploads host data"):
        g(x, np.array([0, 1, 0, 1, 0, 1]))
    y = np.array([0, 0, 0, 0, 0, 1])
    assert g(x, y).numpy().tobytes() == f(x, y).numpy().tobytes()


def test_dicts_in_another_key_order_are_another_signature() -> None:
    # optree's structures compare dicts by sorted keys; a step that walks a dict in its own
    # order (layers applied in insertion order, a checkpoint reloaded with sorted keys) makes
    # other work, and returned the first order's results on replay.
    def f(params: dict[str, Any], x: Any) -> list[tg.AnyTensor]:
        tape, h = tg.leaf(tg.Tape(), x)
        outs: list[tg.AnyTensor] = []
        for name in params:  # insertion order
            tape, w = tg.leaf(tape, params[name])
            tape, h = tg.mul(tape, h, w)
            outs.append(tg.value(tape, h))
        return outs

    g = tg.jit(f)
    x = np.full(2, 2.0, np.float32)
    first = {"w": np.full(2, 3.0, np.float32), "b": np.zeros(2, np.float32)}
    second = {"b": first["b"], "w": first["w"]}
    for params in [first, first, second, second, first, second, first, second]:
        got = [t.numpy().tobytes() for t in g(params, x)]
        assert got == [t.numpy().tobytes() for t in f(params, x)]
    assert g.signatures == 2 and g.replays >= 2


def test_threads_calling_a_new_signature_at_once_record_one_program() -> None:
    import threading

    def f(x: Any, lr: float) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, h = tg.tanh(tape, i)
        return _out(tg.mul(tape, h, lr))

    g = tg.jit(f)
    x = np.linspace(-2.0, 2.0, 37).astype(np.float32)
    got: dict[int, bytes] = {}
    start = threading.Barrier(4)

    def call(k: int) -> None:
        start.wait()
        got[k] = g(x, 0.5 + k).numpy().tobytes()

    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {k: f(x, 0.5 + k).numpy().tobytes() for k in range(4)}
    # One recording; the threads that waited for it replayed it or checked it.
    assert g.traces == 1 and g.signatures == 1


def test_a_number_as_a_comparison_threshold_replays_without_variants() -> None:
    def f(x: Any, threshold: float) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, above = tg.greater(tape, i, threshold)
        return _out(tg.where(tape, above, i, 0.0))

    g = tg.jit(f)
    x = np.linspace(-1.0, 1.0, 9, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        for threshold in (0.0, 0.1, 0.25, 1e-8, -0.5, 0.3, 0.7, 0.05, 0.9, 1e39):
            assert g(x, threshold).numpy().tobytes() == f(x, threshold).numpy().tobytes()
    assert g.traces == 1 and g.replays >= 4


def test_a_dropout_probability_that_changes_every_call_replays() -> None:
    def f(x: Any, p: float, seed: int) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x)
        return _out(tg.dropout(tape, i, p, seed))

    g = tg.jit(f)
    x = np.arange(1.0, 65.0, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        for k, p in enumerate((0.1, 0.1, 0.2, 0.35, 0.5, 0.05, 0.9, 0.25, 0.6, 0.3)):
            assert g(x, p, k).numpy().tobytes() == f(x, p, k).numpy().tobytes()
    assert g.traces == 1 and g.replays >= 4


@pytest.mark.parametrize("host_work", ["scalar", "abs", "sort"])
def test_host_work_that_the_first_data_hides_is_found_at_the_first_call(host_work: str) -> None:
    """A number computed on the host from an input and given to an op, or host work that
    leaves the first call's data as it was (np.abs of positive data, np.sort of sorted data):
    the first call's run on other arrays differs, and the signature runs eagerly at once."""
    def f(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x if host_work == "scalar" else
                          np.abs(x) if host_work == "abs" else np.sort(x))
        if host_work == "scalar":
            tape, i = tg.mul(tape, i, float(np.abs(x).max()))
        return _out(tg.sum(tape, i))

    g = tg.jit(f)
    calm = np.arange(1.0, 5.0)
    with pytest.warns(tg.JitWarning, match="changed with its input arrays"):
        g(calm)
    for x in (calm, calm, np.array([3.0, -7.0, 1.0, 2.0])):
        assert g(x).numpy().tobytes() == f(x).numpy().tobytes()
    assert g.replays == 0


def test_one_valued_masks_and_floats_and_own_constants_replay_with_new_data() -> None:
    """Inputs that the first call gives as one repeated value (an all-True mask, zeros equal
    to the step's own np.zeros, NaN) are still told from constants: their numpy reshapes
    replay with each call's data."""
    def f(mask: Any, state: Any) -> tg.AnyTensor:
        tape, m = tg.leaf(tg.Tape(), mask.reshape(-1))
        tape, s = tg.leaf(tape, state.reshape(-1))
        tape, z = tg.leaf(tape, np.zeros(4))
        tape, s = tg.add(tape, s, z)
        tape, picked = tg.where(tape, m, s, 0.0)
        return _out(tg.sum(tape, picked))

    g = tg.jit(f)
    calls = [(np.ones((2, 2), bool), np.zeros((2, 2)))] * 3
    calls += [(np.array([[True, False], [False, True]]), np.arange(4.0).reshape(2, 2)),
              (np.ones((2, 2), bool), np.full((2, 2), np.nan))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        for mask, state in calls:
            assert g(mask, state).numpy().tobytes() == f(mask, state).numpy().tobytes()
    assert g.replays >= 1 and g.traces == 1


def test_a_step_that_raises_on_other_arrays_runs_eagerly() -> None:
    def f(tokens: Any) -> tg.AnyTensor:
        if tokens[0] != 0:  # a host check of the data
            raise ValueError("sequences start with token 0")
        tape, t = tg.leaf(tg.Tape(), tokens.astype(np.float32))
        return _out(tg.sum(tape, t))

    g = tg.jit(f)
    with pytest.warns(tg.JitWarning, match="raised on other arrays"):
        assert float(g(np.array([0, 1, 2])).numpy()) == 3.0
    assert float(g(np.array([0, 5, 2])).numpy()) == 7.0
    with pytest.raises(ValueError, match="start with token 0"):
        g(np.array([1, 5, 2]))


def test_arrays_given_twice_and_masks_a_change_could_miss_replay_with_new_data() -> None:
    """An array in two argument slots (an autoencoder's step(x, x)), an alternating mask
    (rotated and flipped, it is itself) and two equal all-True masks: their numpy reshapes
    are still told apart and replay."""
    def f(a: Any, b: Any, m1: Any, m2: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), a.reshape(-1))
        tape, j = tg.leaf(tape, b.reshape(-1))
        tape, k1 = tg.leaf(tape, m1.reshape(-1))
        tape, k2 = tg.leaf(tape, m2.reshape(-1))
        tape, s = tg.sub(tape, i, j)
        tape, s = tg.where(tape, k1, s, i)
        return _out(tg.where(tape, k2, s, 0.0))

    g = tg.jit(f)
    x = np.arange(8.0).reshape(2, 4)
    alternating = np.array([[True, False, True, False]] * 2)
    full = np.ones((2, 4), bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.JitWarning)
        y = x + 1.0
        for args in [(x, x, alternating, full)] * 3 + [(y, y, full, ~alternating)]:
            assert g(*args).numpy().tobytes() == f(*args).numpy().tobytes()
    assert g.replays == 1 and g.traces == 1


def test_launches_whose_values_no_result_reads_are_not_replayed() -> None:
    """The loss a backward realises, and a value computed and dropped, cost no launch on
    replay: the program keeps only the launches its results depend on, with eager's bits."""
    def grad_only(x: Any) -> tg.AnyTensor:
        tape, i = tg.leaf(tg.Tape(), x, requires_grad=True)
        tape, h = tg.mul(tape, i, 1.5)
        tape, h = tg.add(tape, h, 0.25)
        tape, h = tg.relu(tape, h)
        tape, unused = tg.exp(tape, i)
        assert tg.value(tape, unused).buffer is not None  # realised, then dropped
        tape, s = tg.sum(tape, h)
        return tg.backward(tape, s, wrt=[i])[i]

    g = tg.jit(grad_only)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(64).astype(np.float32)
    g(x)
    recorded = g.last_launches
    for _ in range(4):
        x = rng.standard_normal(64).astype(np.float32)
        assert np.asarray(g(x)).tobytes() == np.asarray(grad_only(x)).tobytes()
    assert g.replays >= 1 and g.last_launches < recorded
    # the gradient alone: one fused kernel (the sum and the dropped exp were dead)
    assert g.last_launches == 1, g.describe()


def test_donated_parameters_and_state_take_the_updates_in_place() -> None:
    """A replay writes the new parameters and Adam's moments into the donated ones' buffers
    (no new buffers for them), with the bits of a step that donates nothing; the donated
    tensors then refuse every read, as jax.jit's do."""
    params, x, y = _data(np.float32)
    plain = tg.jit(_step)
    donating = tg.jit(_step, donate_argnums=(0, 1))
    kept_params, kept_state = params, None
    given_params, given_state = params, None
    for k in range(8):
        lr = 0.05 / (k + 1)
        kept_params, kept_state, kept_loss = plain(kept_params, kept_state, x, y, lr)
        before = {name: t.buffer.int_ptr for name, t in given_params.items()}
        if given_state is not None:
            before.update({f"m.{name}": t.buffer.int_ptr
                           for name, t in given_state["m"].items()})
        old_params = given_params
        replays = donating.replays
        given_params, given_state, loss = donating(given_params, given_state, x, y, lr)
        assert loss.numpy().tobytes() == kept_loss.numpy().tobytes()
        for name in ("w", "b"):
            assert given_params[name].numpy().tobytes() == kept_params[name].numpy().tobytes()
            assert (given_state["m"][name].numpy().tobytes()
                    == kept_state["m"][name].numpy().tobytes())
        if donating.replays > replays:  # a replay: in place, the old tensors gone
            after = {name: t.buffer.int_ptr for name, t in given_params.items()}
            after.update({f"m.{name}": t.buffer.int_ptr for name, t in given_state["m"].items()})
            assert after == before
            with pytest.raises(tg.TapegradError, match=r"donated to jit\(_step\)"):
                old_params["w"].numpy()
            assert old_params["w"].shape == (3, 2)
        else:  # a recording (or a check): f ran, nothing donated
            assert old_params["w"].numpy().shape == (3, 2)
    assert donating.replays >= 3
    programs = [p for e in donating._entries.values() for p in e.programs]  # pyright: ignore[reportPrivateUsage]
    assert any(len(p.donations) == 6 for p in programs)  # w, b and their two moments each


def test_an_argument_read_after_its_output_is_written_is_not_donated() -> None:
    """Outputs written by kernels that are not an optimizer's update (or while the donated
    input is still to be read) get fresh buffers, and the argument stays readable."""
    def f(x: tg.AnyTensor) -> tuple[tg.AnyTensor, tg.AnyTensor]:
        tape, i = tg.leaf(tg.Tape(), x)
        tape, a = tg.mul(tape, i, 2.0)
        tape, b = tg.exp(tape, i)
        return tg.value(tape, a), tg.value(tape, b)

    step = tg.jit(f, donate_argnums=0)
    x = tg.AnyTensor(np.arange(4, dtype=np.float32))
    for _ in range(5):
        a, b = step(x)
        np.testing.assert_array_equal(a.numpy(), np.arange(4, dtype=np.float32) * 2)
        np.testing.assert_allclose(b.numpy(), np.exp(np.arange(4, dtype=np.float32)), rtol=1e-6)
    assert step.replays >= 2 and x.numpy()[3] == 3.0


def test_a_donated_buffer_that_another_tensor_shares_is_not_taken() -> None:
    """A reshape's value shares its source's buffer: a parameter so shared is not written in
    place (the reshape would change), and it stays readable."""
    def loss(tape: tg.Tape, p: dict[str, tg.Id]) -> tuple[tg.Tape, tg.Id]:
        tape, sq = tg.mul(tape, p["w"], p["w"])
        return tg.sum(tape, sq)

    def step(params: Any, state: Any) -> Any:
        value, grads = tg.value_and_grad(loss)(params)
        params, state = tg.optim.sgd(params, grads, state, lr=0.1, momentum=0.5)
        return params, state, value

    donating = tg.jit(step, donate_argnums=(0, 1))
    params: Any = {"w": tg.AnyTensor(np.arange(6, dtype=np.float32).reshape(2, 3))}
    state: Any = None
    for _ in range(7):
        tape, w = tg.leaf(tg.Tape(), params["w"])
        tape, flat = tg.reshape(tape, w, (6,))
        view = tg.value(tape, flat)
        before = view.numpy().copy()
        shared = params["w"]
        params, state, _ = donating(params, state)
        np.testing.assert_array_equal(view.numpy(), before)
        np.testing.assert_array_equal(shared.numpy().reshape(6), before)
    assert donating.replays >= 3
