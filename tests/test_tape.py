"""The tape is an immutable value: growth, branches and foreign ids."""

from __future__ import annotations

import copy
import pickle
import sys
import warnings
from typing import Any

import numpy as np
import pytest

import tapegrad as tg


def _snapshot(tape: tg.Tape) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    return [(n.op, tuple(p.index for p in n.parents), n.value.shape) for n in tape]


def test_growth_leaves_old_tape_unchanged() -> None:
    t0 = tg.Tape()
    t1, x = tg.leaf(t0, np.arange(3, dtype=np.float32))
    before = _snapshot(t1)
    t2, y = tg.exp(t1, x)
    t3, _ = tg.mul(t2, y, 2.0)
    assert (len(t0), len(t1), len(t2), len(t3)) == (0, 1, 2, 3)
    assert _snapshot(t1) == before
    assert t1[x].value is t3[x].value
    with pytest.raises(tg.TapeError, match="beyond this tape of 1 nodes"):
        t1[y]


def test_branches_do_not_disturb_each_other() -> None:
    base, x = tg.leaf(tg.Tape(), np.array([1.0, 2.0], np.float32), requires_grad=True)
    left, a = tg.exp(base, x)
    left2, a2 = tg.sum(left, a)
    right, b = tg.neg(base, x)  # a branch from the older tape
    right2, b2 = tg.sum(right, b)
    assert [n.op for n in left2] == ["leaf", "exp", "sum"]
    assert [n.op for n in right2] == ["leaf", "neg", "sum"]
    np.testing.assert_allclose(tg.value(left2, a2).numpy(), np.exp([1, 2]).sum(), rtol=1e-6)
    np.testing.assert_allclose(tg.value(right2, b2).numpy(), -3.0)
    # x is valid on both branches; each branch's own ids are not valid on the other.
    assert tg.backward(left2, a2)[x].numpy() == pytest.approx(np.exp([1, 2]))
    assert tg.backward(right2, b2)[x].numpy() == pytest.approx([-1, -1])
    with pytest.raises(tg.TapeError, match="sibling branch"):
        tg.value(right2, a)
    with pytest.raises(tg.TapeError, match="sibling branch"):
        tg.backward(left2, b2)
    # Growing the left branch further still leaves the right one alone.
    left3, _ = tg.mul(left2, a2, 3.0)
    assert [n.op for n in right2] == ["leaf", "neg", "sum"]
    assert len(left3) == 4


def test_ids_of_another_tape_are_rejected() -> None:
    t1, x = tg.leaf(tg.Tape(), np.ones(2, np.float32))
    t2, _ = tg.leaf(tg.Tape(), np.ones(2, np.float32))
    with pytest.raises(tg.TapeError, match="another tape"):
        tg.exp(t2, x)
    # t2 is unchanged by the failed op
    assert len(t2) == 1 and len(t1) == 1


def test_tape_and_ids_are_immutable() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(2, np.float32), name="x")
    with pytest.raises(AttributeError):
        tape.device = None  # type: ignore[misc]
    with pytest.raises(AttributeError):
        x.index = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        tape[x].op = "changed"  # type: ignore[misc]
    assert tape[x].name == "x" and tape[0] is tape[x]
    with pytest.raises(AttributeError):
        del x.index
    with pytest.raises(AttributeError):
        del tape._length


def test_values_are_immutable_and_a_reshape_makes_a_new_tensor() -> None:
    # numpy's in-place `a.shape = ...` would change a node's value on every tape holding it
    # (and let kernels read past its buffer): refused; with_shape gives a new tensor.
    tape, x = tg.leaf(tg.Tape(), np.arange(6, dtype=np.float32))
    value = tg.value(tape, x)
    for name, new in (("shape", (1000,)), ("dtype", np.dtype(np.float64)), ("device", None),
                      ("pending", None), ("_buffer", None), ("other", 1)):
        with pytest.raises(AttributeError, match="AnyTensor is immutable"):
            setattr(value, name, new)
        with pytest.raises(AttributeError, match="AnyTensor is immutable"):
            delattr(value, name)
    assert tape[x].value.shape == (6,) and value.dtype == np.float32
    two = value.with_shape((2, 3))
    assert two is not value and two.shape == (2, 3) and value.shape == (6,)
    np.testing.assert_array_equal(two.numpy(), np.arange(6).reshape(2, 3))
    made = tg.AnyTensor.from_numpy(np.ones(2))
    with pytest.raises(AttributeError):
        made.shape = (3,)  # type: ignore[misc]


def test_copies_of_ids_tapes_and_values_are_themselves_and_values_pickle() -> None:
    tape, x = tg.leaf(tg.Tape(), np.arange(3.0))
    value = tg.value(tape, x)
    assert copy.copy(x) is x and copy.copy(tape) is tape and copy.copy(value) is value
    tree = copy.deepcopy({"w": [x, value], "tape": tape})
    assert tree["w"][0] is x and tree["w"][1] is value and tree["tape"] is tape
    back = pickle.loads(pickle.dumps({"w": value}))["w"]
    assert isinstance(back, tg.AnyTensor) and back.dtype == np.float64
    np.testing.assert_array_equal(back.numpy(), [0.0, 1.0, 2.0])
    with pytest.raises(tg.TapeError, match="cannot be pickled"):
        pickle.dumps(x)
    with pytest.raises(tg.TapeError, match="cannot be pickled"):
        pickle.dumps(tape)


def test_anytensor_is_made_from_host_data_as_torch_tensor_is() -> None:
    # SPEC: an AnyTensor is "made from numpy arrays and Python scalars"; AnyTensor(data) is
    # the spelling a torch or JAX user tries first (it raised Python's TypeError).
    t = tg.AnyTensor(np.arange(6.0).reshape(2, 3))
    assert (t.shape, t.dtype) == ((2, 3), np.float64)
    np.testing.assert_array_equal(t.numpy(), np.arange(6.0).reshape(2, 3))
    s = tg.AnyTensor(2.5, device="0:0")
    assert (s.shape, s.dtype, s.item()) == ((), np.float32, 2.5)
    assert tg.AnyTensor(t) is t and tg.AnyTensor(t, t.device) is t  # immutable: no copy
    tape, x = tg.leaf(tg.Tape(), tg.AnyTensor(np.ones(3, np.float32)), requires_grad=True)
    tape, y = tg.sum(tape, x)
    np.testing.assert_array_equal(tg.backward(tape, y)[x].numpy(), np.ones(3))
    with pytest.raises(tg.DTypeError, match=r"AnyTensor: argument 'data' is a Python list"):
        tg.AnyTensor([1.0, 2.0])
    with pytest.raises(tg.DTypeError, match="float16"):
        tg.AnyTensor(np.ones(2, np.float16))
    with pytest.raises(tg.DeviceError):
        tg.AnyTensor(np.ones(2), device="no-such-device")


def test_smaller_integers_are_held_as_int32_every_value_kept() -> None:
    """The spec's integer inputs (labels, indices, uint8 images): int8, int16, uint8 and
    uint16 are held as int32, uint32 as int64, eagerly and as tg.jit's arguments (widened at
    the call, so the step's upload is the argument and replays); uint64 and float16 are refused
    with the conversion to make."""
    values = {np.int8: [-128, 127], np.int16: [-32768, 32767], np.uint8: [0, 255],
              np.uint16: [0, 65535], np.uint32: [0, 2**32 - 1]}
    for kind, extremes in values.items():
        tape, x = tg.leaf(tg.Tape(), np.array(extremes, kind))
        assert x.dtype == (np.int64 if kind == np.uint32 else np.int32)
        np.testing.assert_array_equal(tg.value(tape, x).numpy(), extremes)
    tape, logits = tg.leaf(tg.Tape(), np.log(np.arange(1.0, 16.0).reshape(3, 5)))
    tape, labels = tg.leaf(tape, np.array([4, 0, 2], np.uint8))
    tape, loss = tg.cross_entropy(tape, logits, labels)
    want = -np.mean(np.log(np.array([5 / 15, 6 / 40, 13 / 65])))
    np.testing.assert_allclose(tg.value(tape, loss).numpy(), want, rtol=1e-12)

    def total(a: Any) -> tg.AnyTensor:
        tape, x = tg.leaf(tg.Tape(), a)
        return tg.value(*tg.sum(tape, x))

    step = tg.jit(total)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall back to eager
        for data in ([200, 100], [255, 255], [1, 2], [7, 9], [0, 3]):
            assert step(np.array(data, np.uint8)).numpy() == sum(data)
    for kind, advice in ((np.uint64, r"np.int64 for labels and indices"),
                         (np.float16, r"\.astype\(np.float32\)")):
        with pytest.raises(tg.DTypeError, match=f"leaf: argument 'data' has dtype .*{advice}"):
            tg.leaf(tg.Tape(), np.ones(2, kind))


def test_id_fields_and_hashing() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float64))
    assert (x.index, x.shape, x.dtype) == (0, (2, 3), np.float64)
    assert {x: 1}[x] == 1
    tape2, y = tg.leaf(tape, 3.0)
    assert y.shape == () and y.dtype == np.float32 and y.index == 1 and len(tape2) == 2


def test_node_records_call_site_and_parents() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(2, np.float32))
    tape, y = tg.add(tape, x, x)
    node = tape[y]
    assert node.op == "add"
    assert [p.index for p in node.parents] == [0, 0]
    assert node.site.endswith("test_tape.py:" + str(node.location[1]))
    assert "test_tape.py" in node.site


def _line() -> int:
    """The caller's line number."""
    frame = sys._getframe(1)
    return frame.f_lineno


def test_every_path_of_an_op_records_the_users_line() -> None:
    # The elementwise recorders skip their own frames unread (call_site's `skip`); the other
    # paths walk out. Each node must name this file and the line of the call that made it,
    # also when an op is called from inside another op (linear's matmul and add).
    here = __file__
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32)); lx = _line()  # noqa: E702
    tape, row = tg.leaf(tape, np.ones(3, np.float32))
    tape, w = tg.leaf(tape, np.ones((3, 3), np.float32))
    made: list[tuple[tg.Id, int]] = [(x, lx)]
    tape, a = tg.mul(tape, x, 2.0); made.append((a, _line()))  # noqa: E702
    tape, b = tg.sub(tape, 1.0, a); made.append((b, _line()))  # noqa: E702
    tape, c = tg.tanh(tape, b); made.append((c, _line()))  # noqa: E702
    tape, d = tg.add(tape, c, c); made.append((d, _line()))  # noqa: E702
    tape, e = tg.add(tape, d, row); made.append((e, _line()))  # noqa: E702 - broadcasts
    start = len(tape)
    tape, f = tg.linear(tape, e, w, row); lf = _line()  # noqa: E702
    made += [(tape[i].id, lf) for i in range(start, len(tape))]
    assert f == tape[len(tape) - 1].id
    for id_, line in made:
        assert tape[id_].location == (here, line), (tape[id_].op, tape[id_].location, line)


def test_one_line_of_use_shares_storage() -> None:
    """Appending along one line never copies earlier nodes (the O(1) amortized path)."""
    tape, x = tg.leaf(tg.Tape(), np.ones(2, np.float32))
    store = tape._store
    for _ in range(50):
        tape, x = tg.neg(tape, x)
    assert tape._store is store and len(tape) == 51


def test_broadcast_adds_nodes_and_leaf_adds_one() -> None:
    tape, a = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
    assert len(tape) == 1
    tape, b = tg.leaf(tape, np.ones(3, np.float32))
    tape, _ = tg.add(tape, a, b)
    assert [n.op for n in tape] == ["leaf", "leaf", "broadcast_to", "add"]


@pytest.mark.parametrize("swap", [False, True])
def test_a_broadcasting_binary_op_records_the_broadcasts_and_notes_one_call(swap: bool) -> None:
    """Ids of two shapes (a bias, a scale): each one broadcast is its node, at the user's line,
    and the public call spans them (the ids' common case takes its own path)."""
    tape, a = tg.leaf(tg.Tape(), np.arange(6, dtype=np.float32).reshape(2, 3))
    tape, b = tg.leaf(tape, np.array([[1], [2]], np.float32))
    tape, c = tg.leaf(tape, np.float32(4))
    args = (b, a) if swap else (a, b)
    line = sys._getframe().f_lineno + 1
    tape, y = tg.sub(tape, *args)
    tape, z = tg.mul(tape, c, b)
    assert [n.op for n in tape] == ["leaf"] * 3 + ["broadcast_to", "sub", "broadcast_to", "mul"]
    assert [n.location[1] for n in tape][3:5] == [line, line]
    assert [(call.op, call.first, call.last) for call in tape.calls()] == [("sub", 3, 4),
                                                                          ("mul", 5, 6)]
    ab = np.arange(6, dtype=np.float32).reshape(2, 3) - np.array([[1], [2]], np.float32)
    np.testing.assert_array_equal(tape[y].value.numpy(), -ab if swap else ab)
    np.testing.assert_array_equal(tape[z].value.numpy(), np.array([[4], [8]], np.float32))


def test_a_broadcasting_op_over_an_id_of_another_tape_names_it() -> None:
    tape, a = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
    _, other = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    with pytest.raises(tg.TapeError, match="add: argument 'b'"):
        tg.add(tape, a, other)
    tape, c = tg.leaf(tape, np.ones(4, np.float32))
    with pytest.raises(tg.ShapeError, match=r"add: shapes do not broadcast .* axis -1"):
        tg.add(tape, a, c)
    _, b = tg.leaf(tape, np.ones(3, np.float32))
    with pytest.raises(tg.TapeError, match=r"mul: the first argument must be the tape"):
        tg.mul(None, a, b)  # type: ignore[arg-type]


@pytest.mark.parametrize("op", ["relu", "exp", "add", "mul", "maximum", "pow"])
def test_an_elementwise_op_called_without_its_tape_or_an_operand_says_so(op: str) -> None:
    """PyTorch's habit, `tg.relu(x)`, names the tape as missing (a TapeError, as every other op
    gives), not Python's TypeError for a missing argument; so does a left-out operand."""
    fn = getattr(tg, op)
    tape, x = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    unary = op in ("relu", "exp")
    operands = [x] if unary else [x, x]
    with pytest.raises(tg.TapeError, match=rf"^{op}: called without the tape: .* call it as "
                       rf"tape, y = tg\.{op}\(tape, {'x' if unary else 'a, b'}\)"):
        fn(*operands)
    with pytest.raises(tg.TapeError, match=rf"^{op}: called without the tape"):
        fn(*[tape[i].value for i in operands])  # tensors, as in PyTorch
    with pytest.raises(tg.ArgumentTypeError,
                       match=rf"^{op}: argument '{'x' if unary else 'b'}' is missing"):
        fn(tape, *operands[:-1])
    assert len(tape) == 1  # nothing was recorded
    tape, y = fn(tape, *operands)  # the defaults change no call that gives every argument
    assert tape[y].value.shape == (3,)


def test_an_int_operand_is_the_float_it_names() -> None:
    """`x * 2` is `x * 2.0` (its node and bits); an int without a float stays an error."""
    tape, x = tg.leaf(tg.Tape(), np.array([1.5, -3], np.float32))
    tape, y = tg.mul(tape, x, 2)
    tape, z = tg.pow(tape, x, 3)
    assert [n.args[1] for n in list(tape)[1:]] == [2.0, 3.0]
    assert [type(n.args[1]) for n in list(tape)[1:]] == [float, float]
    np.testing.assert_array_equal(tape[y].value.numpy(), np.array([3, -6], np.float32))
    np.testing.assert_array_equal(tape[z].value.numpy(), np.array([3.375, -27], np.float32))
    with pytest.raises(tg.DTypeError, match="too large for a float"):
        tg.mul(tape, x, 10 ** 400)


def test_nodes_recorded_at_one_line_share_their_site() -> None:
    """A step's nodes live through the step: each line's site is one tuple, not one a node."""
    tape, x = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    ys: list[tg.Id] = []
    for _ in range(3):
        tape, y = tg.exp(tape, x)
        ys.append(y)
    tape, z = tg.neg(tape, x)
    sites = [tape.node(y, "test", "y").location for y in ys]
    assert sites[0][1] == sys._getframe().f_lineno - 4
    assert sites[0] is sites[1] is sites[2]
    assert tape.node(z, "test", "z").location == (__file__, sites[0][1] + 2)
    tape, w = tg.leaf(tape, np.ones((3, 2), np.float32))
    tape, b = tg.leaf(tape, np.ones(2, np.float32))
    tape, m = tg.reshape(tape, x, (1, 3))
    tape, y = tg.linear(tape, m, w, b)  # its product's node, at this line
    assert tape.node(y, "test", "y").location == (__file__, sys._getframe().f_lineno - 1)


def test_a_product_of_equal_batches_is_one_node() -> None:
    """Attention's (b, m, k) @ (b, k, n): no reshapes or broadcasts around the product."""
    rng = np.random.default_rng(0)
    a0, b0 = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 5))
    tape, a = tg.leaf(tg.Tape(), a0)
    tape, b = tg.leaf(tape, b0)
    tape, c = tg.matmul(tape, a, b)
    assert [n.op for n in tape] == ["leaf", "leaf", "matmul"]
    np.testing.assert_allclose(tape[c].value.numpy(), a0 @ b0, rtol=1e-12)
