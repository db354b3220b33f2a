"""Replayed sweeps (`tapegrad._jit.SweepReplays`): a first-order `backward` over a structure
seen before runs as a recorded program, with the node-by-node sweep's bits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from all_cases import ALL_CASES
from cases import Case
from tapegrad import _jit
from tapegrad._device import Device
from tapegrad._jit import sweep_replays
from tapegrad._tape import deferring

IDS = [c.name for c in ALL_CASES]
Array = np.ndarray[Any, Any]


def _grads(case: Case, seed_values: int, dtype: Any) -> list[Array]:
    arrays = [a.astype(dtype) for a in case.inputs()]
    tape = tg.Tape()
    ids: list[tg.Id] = []
    for a in arrays:
        tape, i = tg.leaf(tape, a, requires_grad=True)
        ids.append(i)
    tape, out = case.fn(tape, *ids)
    seed = np.random.default_rng(seed_values).standard_normal(out.shape).astype(dtype)
    sweeping[0] = True
    try:
        grads = tg.backward(tape, out, wrt=ids, seed=seed)
    finally:
        sweeping[0] = False
    return [grads[i].numpy() for i in ids]


sweeping = [False]  # inside _grads's backward (the launches the sweep makes are counted)


@pytest.mark.parametrize("case", ALL_CASES, ids=IDS)
def test_every_op_replays_its_sweep_bitwise(
        case: Case, fresh_replays: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each op's sweep, seen a fifth time, is a replay, and gives the node-by-node sweep's
    gradients bit for bit at every seed (the seed is an input of the program, not a constant).
    A sweep that launches nothing (an empty tensor's, stop_gradient's) is never a program."""
    launches: list[str] = []
    launch = Device.launch

    def noting(self: Device, kernel: Any, *args: Any, largest: int | None = None) -> None:
        if sweeping[0]:
            launches.append(str(kernel.function_name))
        launch(self, kernel, *args, largest=largest)

    for dtype in (np.float32, np.float64):
        sweep_replays.enabled = False
        monkeypatch.setattr(Device, "launch", noting)
        want = [_grads(case, k, dtype) for k in range(5)]
        monkeypatch.setattr(Device, "launch", launch)
        sweep_replays.enabled = True
        replays = sweep_replays.replays
        got = [_grads(case, k, dtype) for k in range(5)]
        # eager, recorded, compared, replayed twice
        assert sweep_replays.replays - replays == (2 if launches else 0)
        for w, g in zip(want, got, strict=True):
            for a, b in zip(w, g, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert a.tobytes() == b.tobytes(), (a, b)


@pytest.mark.parametrize("case", ALL_CASES, ids=IDS)
def test_every_op_with_its_number_operands_traced_replays_bitwise(
        case: Case, fresh_replays: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The op table again, with every float operand a traced number of the program from the
    first sweep (as one seen to change is): each op's replayed gradients bitwise its
    node-by-node ones at every seed. (86 of the 111 cases with a number operand replayed so
    when this was written; a VJP that decides from its number, a guard, keys it by value
    instead, and one that launches nothing, add's, is no program.)"""
    by_value = _jit._Replays._by_value  # pyright: ignore[reportPrivateUsage]

    def all_changing(self: Any, key: Any, operands: Any) -> Any:
        seen = self._operand_bits.get(key)
        if seen is None:
            self._operand_bits[key] = (tuple(range(-1, -1 - len(operands), -1)),
                                       tuple(range(len(operands))))
        return by_value(self, key, operands)

    monkeypatch.setattr(_jit._Replays, "_by_value", all_changing)
    for dtype in (np.float32, np.float64):
        sweep_replays.enabled = False
        want = [_grads(case, k, dtype) for k in range(5)]
        sweep_replays.enabled = True
        got = [_grads(case, k, dtype) for k in range(5)]
        for w, g in zip(want, got, strict=True):
            for a, b in zip(w, g, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert a.tobytes() == b.tobytes(), (a, b)


def _train(steps: int, read_hidden: Callable[[int], bool] | None = None
           ) -> tuple[list[Array], dict[str, Array]]:
    """A training loop's losses and final parameters; on the steps `read_hidden` names, an
    intermediate of the forward is read (so computed) before the sweep."""
    rng = np.random.default_rng(0)
    params = {"w1": tg.AnyTensor(rng.standard_normal((12, 16)).astype(np.float32) * 0.3),
              "b1": tg.AnyTensor(np.zeros(16, np.float32)),
              "g": tg.AnyTensor(np.ones(16, np.float32)),
              "w2": tg.AnyTensor(rng.standard_normal((16, 5)).astype(np.float32) * 0.3),
              "b2": tg.AnyTensor(np.zeros(5, np.float32))}
    state: Any = None
    losses: list[Array] = []
    for step in range(steps):
        tape = tg.Tape()
        p: dict[str, tg.Id] = {}
        for name, value in params.items():
            tape, p[name] = tg.leaf(tape, value, requires_grad=True)
        tape, x = tg.leaf(tape, rng.standard_normal((8, 12)).astype(np.float32))
        tape, y = tg.leaf(tape, rng.integers(0, 5, 8))
        tape, h = tg.linear(tape, x, p["w1"], p["b1"])
        tape, h = tg.layer_norm(tape, h, p["g"], p["b1"])
        tape, h = tg.gelu(tape, h)
        tape, h = tg.mul(tape, h, 0.5)
        tape, h = tg.add(tape, h, 1.0)
        if read_hidden is not None and read_hidden(step):
            tg.value(tape, h).numpy()
        tape, logits = tg.linear(tape, h, p["w2"], p["b2"])
        tape, loss = tg.cross_entropy(tape, logits, y)
        grads = tg.backward(tape, loss)
        params, state = tg.optim.adam(params, {k: grads[i] for k, i in p.items()}, state,
                                      lr=0.01)
        losses.append(tg.value(tape, loss).numpy())
    return losses, {k: v.numpy() for k, v in params.items()}


# Sightings: 0 node by node, 1 recorded, 2 compared, later ones replayed. A value read before
# the sweep at some steps: with forwards deferred, those steps' tapes are another structure
# (the forward up to the value computed, which that structure's program reads), seen at most
# twice here, so not replayed; the other steps' structure replays from its third sighting
# (steps 3, 5 and 7 where 4 and 6 read; 5, 6 and 7 where 1 and 2 do). With forwards run at
# once, a value read first is no different.
def _at(*steps: int) -> Callable[[int], bool]:
    return lambda step: step in steps


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "at-once"])
@pytest.mark.parametrize(("read", "deferred_replays"), [(None, 5), (_at(4, 6), 3), (_at(1, 2), 3)],
                         ids=["plain", "computed-first-at-replays", "computed-first-when-recorded"])
def test_a_training_loop_replays_with_eagers_bits(
        fresh_replays: None, read: Callable[[int], bool] | None, deferred_replays: int,
        defer: bool) -> None:
    with deferring(defer):
        sweep_replays.enabled = False
        want_losses, want_params = _train(8, read)
        sweep_replays.enabled = True
        replays = sweep_replays.replays
        got_losses, got_params = _train(8, read)
    assert sweep_replays.replays - replays == (deferred_replays if defer else 5)
    np.testing.assert_array_equal(np.array(got_losses), np.array(want_losses))
    for name, want in want_params.items():
        np.testing.assert_array_equal(got_params[name], want)


def test_a_new_structure_records_again(fresh_replays: None) -> None:
    """Another shape, dtype, constant operand or wanted id is another structure: its own
    recording, never the program of the one before."""
    x0 = np.linspace(-1, 1, 6).astype(np.float32)

    def grad(scale: float, shape: tuple[int, ...], wrt_x: bool) -> Array:
        tape, x = tg.leaf(tg.Tape(), x0.reshape(shape), requires_grad=True)
        tape, y = tg.leaf(tape, np.full(shape, 2.0, np.float32), requires_grad=True)
        tape, h = tg.mul(tape, x, y)
        tape, h = tg.mul(tape, h, scale)
        tape, loss = tg.sum(tape, h)
        w = x if wrt_x else y
        return tg.backward(tape, loss, wrt=[w])[w].numpy()

    for _ in range(5):
        np.testing.assert_array_equal(grad(3.0, (6,), True), np.full(6, 6.0, np.float32))
        np.testing.assert_array_equal(grad(-0.0, (6,), True), np.full(6, -0.0, np.float32))
        np.testing.assert_array_equal(grad(0.0, (6,), True), np.zeros(6, np.float32))
        np.testing.assert_array_equal(grad(3.0, (2, 3), True), np.full((2, 3), 6.0))
        np.testing.assert_array_equal(grad(3.0, (6,), False), 3 * x0)
    assert np.signbit(grad(-0.0, (6,), True)).all() and not np.signbit(grad(0.0, (6,), True)).any()
    assert sweep_replays.replays >= 5 * 2


def test_off_runs_every_sweep_node_by_node(fresh_replays: None) -> None:
    sweep_replays.enabled = False
    _sweep_sums(tg.exp, np.exp, np.ones(4, np.float32), 6)
    assert sweep_replays.replays == 0 and sweep_replays.recordings == 0


def _sweep_sums(op: Callable[[tg.Tape, tg.Id], tuple[tg.Tape, tg.Id]],
                derivative: Callable[[Array], Array], x0: Array, times: int) -> None:
    """`times` sweeps of sum(op(x)), each gradient checked against derivative(x0)."""
    for _ in range(times):
        tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
        tape, y = op(tape, x)
        tape, loss = tg.sum(tape, y)
        np.testing.assert_allclose(tg.backward(tape, loss)[x].numpy(), derivative(x0),
                                   rtol=1e-6)


def test_a_recording_unlike_the_last_is_compared_with_the_next(
        fresh_replays: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A check whose recording differs from the program (an eager loop's first steps still
    change what the forward leaves pending) makes its recording the program: the next sweep
    is compared with it, and once two in a row match, the structure replays."""
    matches = _jit.Program.matches
    differ = [1]

    def first_differs(self: _jit.Program, *args: Any) -> bool:
        if differ[0]:
            differ[0] -= 1
            return False
        return matches(self, *args)

    monkeypatch.setattr(_jit.Program, "matches", first_differs)
    _sweep_sums(tg.tanh, lambda x: 1 - np.tanh(x) ** 2, np.linspace(-2, 2, 8), 7)
    assert sweep_replays.recordings == 3 and sweep_replays.replays == 3


def test_a_structure_whose_recordings_keep_differing_is_swept_node_by_node(
        fresh_replays: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(self: _jit.Program, *args: Any) -> bool:
        return False

    monkeypatch.setattr(_jit.Program, "matches", never)
    _sweep_sums(tg.tanh, lambda x: 1 - np.tanh(x) ** 2, np.linspace(-2, 2, 8), 9)
    assert sweep_replays.recordings == 1 + _jit.SWEEP_RECORDINGS
    assert sweep_replays.replays == 0


def test_a_jitted_step_records_the_sweep_itself(fresh_replays: None) -> None:
    """Inside tg.jit the sweep is what its recording sees: never a replay of another program."""
    def step(x0: tg.AnyTensor) -> tg.AnyTensor:
        tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
        tape, y = tg.tanh(tape, x)
        tape, loss = tg.sum(tape, y)
        return tg.backward(tape, loss)[x]

    jitted = tg.jit(step)
    x0 = tg.AnyTensor(np.linspace(-2, 2, 8).astype(np.float32))
    for _ in range(6):
        np.testing.assert_array_equal(jitted(x0).numpy(), step(x0).numpy())
    assert sweep_replays.recordings == 2 and sweep_replays.replays == 3  # the direct calls


def test_a_loop_of_new_structures_is_swept_node_by_node_and_rests(fresh_replays: None) -> None:
    """A shape that changes every step is a new structure every step: each sweep node by node,
    right; after SWEEP_MISSES such sweeps in a row no key is made for a while."""
    for step in range(_jit.SWEEP_MISSES + 3):
        x0 = np.linspace(0.5, 1.5, step + 2).astype(np.float32)
        tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
        tape, y = tg.mul(tape, x, 2.0)
        tape, y = tg.exp(tape, y)
        tape, loss = tg.sum(tape, y)
        np.testing.assert_allclose(tg.backward(tape, loss)[x].numpy(), 2 * np.exp(2 * x0),
                                   rtol=1e-6)
    assert sweep_replays.recordings == 0 and sweep_replays.replays == 0
    assert sweep_replays._resting == _jit.SWEEP_REST - 3  # pyright: ignore[reportPrivateUsage]


def _scheduled_grads(temperatures: Sequence[float], defer: bool = True) -> list[list[Array]]:
    """Each step's gradients of sum(softplus(0.5 * (x @ w) / t)) * s: t a temperature and s a
    weight on a schedule (numbers that change every step), 0.5 a constant."""
    rng = np.random.default_rng(5)
    x0 = rng.standard_normal((8, 6)).astype(np.float32)
    w0 = rng.standard_normal((6, 4)).astype(np.float32)
    found: list[list[Array]] = []
    with deferring(defer):
        for step, t in enumerate(temperatures):
            tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
            tape, w = tg.leaf(tape, w0, requires_grad=True)
            tape, h = tg.matmul(tape, x, w)
            tape, h = tg.mul(tape, h, 0.5)
            tape, h = tg.div(tape, h, t)
            tape, h = tg.softplus(tape, h)
            tape, h = tg.mul(tape, h, 1.0 + 0.25 * step)
            tape, loss = tg.sum(tape, h)
            grads = tg.backward(tape, loss)
            found.append([grads[x].numpy(), grads[w].numpy()])
    return found


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "at-once"])
def test_number_operands_that_change_each_step_replay_with_the_bits_node_by_node(
        fresh_replays: None, defer: bool) -> None:
    """A number operand seen to change (a temperature, a loss weight on a schedule) is a number
    of the program, as a dropout seed is: sighting 1 keys it by value, 2 finds it changed (a
    new key), 3 records, 4 checks, later ones replay with each step's own numbers, bitwise the
    sweep node by node. The constant 0.5 stays part of the structure."""
    temperatures = [1.0 + 0.1 * step for step in range(9)]
    replayed = _scheduled_grads(temperatures, defer)
    assert sweep_replays.recordings == 2 and sweep_replays.replays == len(temperatures) - 4
    sweep_replays.enabled = False
    for got, want in zip(replayed, _scheduled_grads(temperatures, defer), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(replayed[6][1], replayed[7][1])


def test_a_number_operand_is_replayed_at_other_values_once_a_check_saw_it_change(
        fresh_replays: None) -> None:
    """A check at the number a program was recorded with could not see a constant made of it:
    until a check meets it at another value, the program replays only where it has the
    recorded value, and a sweep where it differs is recorded and compared instead."""
    temperatures = [1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 4.0]
    replayed = _scheduled_grads(temperatures)
    # 1: by value; 2: changed (a new key); 3: recorded at 2.0; 4: checked, the weight (which
    # changes every step) seen traced, the temperature not; 5: replayed (still 2.0); 6: at
    # 3.0, recorded and compared, which sees it traced; 7: replayed.
    assert sweep_replays.recordings == 3 and sweep_replays.replays == 2
    sweep_replays.enabled = False
    for got, want in zip(replayed, _scheduled_grads(temperatures), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "pow", "maximum", "minimum"])
def test_each_binary_op_with_a_changing_number_replays_with_the_bits_node_by_node(
        fresh_replays: None, op: str, side: str) -> None:
    """Every elementwise op with a number operand that changes each step, on either side:
    the gradients of each step bitwise the sweep's node by node (replayed where the VJP
    takes the number as it is; a VJP that decides from it keys it by value)."""
    rng = np.random.default_rng(9)
    x0 = rng.uniform(0.2, 1.5, (6, 5)).astype(np.float32)
    w0 = rng.uniform(0.5, 1.5, (6, 5)).astype(np.float32)
    fn = getattr(tg, op)

    def grads(c: float) -> list[Array]:
        tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
        tape, w = tg.leaf(tape, w0, requires_grad=True)
        tape, h = tg.mul(tape, x, w)
        tape, h = fn(tape, h, c) if side == "right" else fn(tape, c, h)
        tape, h = tg.tanh(tape, h)
        tape, loss = tg.sum(tape, h)
        found = tg.backward(tape, loss)
        return [found[x].numpy(), found[w].numpy()]

    numbers = [0.5 + 0.375 * k for k in range(8)]
    replayed = [grads(c) for c in numbers]
    replays = sweep_replays.replays
    sweep_replays.enabled = False
    for got, c in zip(replayed, numbers, strict=True):
        for a, b in zip(got, grads(c), strict=True):
            np.testing.assert_array_equal(a, b)
    # pow's VJP asks whether its exponent is 0 (a guard): that structure keys it by value
    assert replays == (0 if (op, side) == ("pow", "right") else len(numbers) - 4)


def test_a_number_operand_a_recording_keeps_as_a_constant_is_keyed_by_value(
        fresh_replays: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a recording keeps a changing number operand as a constant (as what C code reads of
    a traced number would be: here its recipe is left untraced), every check differs, so the
    structure never replays another step's numbers: after SWEEP_RECORDINGS such checks its
    operands are keyed by value again, and each step's gradients stay right."""
    traced_in = _jit._traced_in  # pyright: ignore[reportPrivateUsage]

    def untraced(params: Any, operands: Any) -> Any:  # forwards and recipes keep their own
        return traced_in(params, {})

    monkeypatch.setattr(_jit, "_traced_in", untraced)
    temperatures = [1.0 + 0.1 * step for step in range(10)]
    replayed = _scheduled_grads(temperatures)
    assert sweep_replays.replays == 0
    assert sweep_replays.recordings == 1 + _jit.SWEEP_RECORDINGS
    sweep_replays.enabled = False
    for got, want in zip(replayed, _scheduled_grads(temperatures), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_new_dropout_seed_each_step_replays_with_the_bits_node_by_node(
        fresh_replays: None) -> None:
    """Dropout's seed is a number of the program (`DropoutParams.call_numbers`), not part of
    the structure: a loop drawing new masks every step replays from the fourth step, with
    each step's own masks (two dropouts, seeds apart), bitwise the sweep node by node."""
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((8, 8)).astype(np.float32)
    w0 = rng.standard_normal((8, 16)).astype(np.float32)

    def grads(step: int) -> list[Array]:
        tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
        tape, w = tg.leaf(tape, w0, requires_grad=True)
        tape, h = tg.matmul(tape, x, w)
        tape, h = tg.tanh(tape, h)
        tape, h = tg.dropout(tape, h, 0.5, seed=step)
        tape, h = tg.dropout(tape, h, 0.25, seed=1000 + 7 * step)
        tape, loss = tg.sum(tape, h)
        found = tg.backward(tape, loss)
        return [found[x].numpy(), found[w].numpy()]

    steps = range(10)
    replayed = [grads(step) for step in steps]
    assert sweep_replays.recordings == 2 and sweep_replays.replays == len(steps) - 3
    sweep_replays.enabled = False
    for step, got in zip(steps, replayed, strict=True):
        for a, b in zip(got, grads(step), strict=True):
            np.testing.assert_array_equal(a, b)
    # and each step's masks are its own: the gradients of two steps differ
    assert not np.array_equal(replayed[5][1], replayed[6][1])


def test_programs_past_the_byte_budget_are_let_go(
        fresh_replays: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Programs hold their intermediates: past SWEEP_BYTES the least recently swept goes, and
    its structure is recorded again when next seen; gradients stay right throughout."""
    monkeypatch.setattr(_jit, "SWEEP_BYTES", 1)

    def grad(n: int) -> Array:
        x0 = np.arange(n, dtype=np.float32) / n
        tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
        tape, y = tg.mul(tape, x, x)
        tape, y = tg.exp(tape, y)
        tape, loss = tg.sum(tape, y)
        got = tg.backward(tape, loss)[x].numpy()
        np.testing.assert_allclose(got, 2 * x0 * np.exp(x0 * x0), rtol=1e-6)
        return got

    for _ in range(4):
        grad(100)
        grad(200)
    programs = [e.program for e in sweep_replays._entries.values()]  # pyright: ignore[reportPrivateUsage]
    assert sum(p is not None for p in programs) <= 1
    assert sweep_replays.held_bytes() <= max((p.kept_bytes for p in programs if p), default=0)


def test_a_sweep_that_launches_nothing_is_no_program(fresh_replays: None) -> None:
    """The gradient of a leaf by itself is the seed: nothing to record, node by node."""
    x0 = np.arange(3, dtype=np.float32)
    for k in range(5):
        tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
        seed = np.full(3, k, np.float32)
        np.testing.assert_array_equal(tg.backward(tape, x, seed=seed)[x].numpy(), seed)
    assert sweep_replays.replays == 0


def test_a_tape_past_the_recording_limit_is_swept_node_by_node(
        fresh_replays: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording keeps every buffer its sweep makes: a tape holding more than
    SWEEP_RECORD_BYTES of values is never recorded."""
    monkeypatch.setattr(_jit, "SWEEP_RECORD_BYTES", 64)
    _sweep_sums(tg.sin, np.cos, np.linspace(0, 1, 32).astype(np.float32), 5)  # 128 bytes
    assert sweep_replays.recordings == 0 and sweep_replays.replays == 0


def test_positions_sharing_a_buffer_are_part_of_the_structure(fresh_replays: None) -> None:
    """Two leaves of one tensor while a structure is recorded and compared, of two tensors
    later: the recording read both through one buffer, so the later sweeps are another
    structure (recorded again), not a replay of it."""
    rng = np.random.default_rng(3)
    shared = tg.AnyTensor(rng.standard_normal((3, 4)).astype(np.float32))
    others = [tg.AnyTensor(rng.standard_normal((3, 4)).astype(np.float32)) for _ in range(8)]
    for step in range(8):
        second = shared if step < 4 else others[step]
        tape, a = tg.leaf(tg.Tape(), shared, requires_grad=True)
        tape, b = tg.leaf(tape, second, requires_grad=True)
        tape, p = tg.mul(tape, a, b)
        tape, loss = tg.sum(tape, p)
        grads = tg.backward(tape, loss)
        assert grads[a].numpy().tobytes() == second.numpy().tobytes()
        assert grads[b].numpy().tobytes() == shared.numpy().tobytes()
    assert sweep_replays.replays == 2  # steps 3 and 7: one of each structure
