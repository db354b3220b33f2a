"""What a new user meets first: the package's public names, error classes that read
`tapegrad.ShapeError`, a forgotten requires_grad explained, a notebook cell run twice, tensors
that print their values, and tapes shown as the ops the user called."""

from __future__ import annotations

import importlib
import pickle
import pkgutil
import re
from types import ModuleType
from typing import Any, cast

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import _errors

HERE = "test_first_hour.py"


# --- the package -------------------------------------------------------------------------------

def _public_modules() -> list[ModuleType]:
    """Every module of tapegrad whose dotted name has no private part. The demo's modules are
    runnable examples, not library API, and are left out."""
    names = ["tapegrad"] + [
        m.name for m in pkgutil.walk_packages(tg.__path__, "tapegrad.")
        if not any(part.startswith("_") for part in m.name.split("."))
        and not m.name.startswith("tapegrad.demo")]
    return [importlib.import_module(name) for name in names]


def _is_example(obj: object) -> bool:
    """tapegrad.demo, an attribute of tapegrad once anything imported it (as the walk does)."""
    return isinstance(obj, ModuleType) and obj.__name__.startswith("tapegrad.demo")


def test_the_public_modules_are_the_documented_ones() -> None:
    assert [m.__name__ for m in _public_modules()] == [
        "tapegrad", "tapegrad.distributed", "tapegrad.nn", "tapegrad.nn.init",
        "tapegrad.optim"]


@pytest.mark.parametrize("module", _public_modules(), ids=lambda m: m.__name__)
def test_public_modules_expose_public_names_only(module: ModuleType) -> None:
    """`dir(tg.optim)` listed np, cl, Any, cast, flatten, C_TYPES...: now what a module shows
    is its `__all__`, and every name of it is documented."""
    assert hasattr(module, "__all__"), f"{module.__name__} has no __all__"
    exported = set(module.__all__) - {"__version__"}
    shown = {name for name in dir(module) if not name.startswith("_")
             and not _is_example(getattr(module, name))}
    assert shown == exported, (f"{module.__name__}: shown but not in __all__: "
                               f"{sorted(shown - exported)}; in __all__ but missing: "
                               f"{sorted(exported - shown)}")
    for name in exported:
        obj = getattr(module, name)
        if callable(obj) or isinstance(obj, ModuleType):
            assert obj.__doc__, f"{module.__name__}.{name} has no docstring"


def test_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("tapegrad")
    except PackageNotFoundError:  # the source tree on sys.path, not installed
        assert tg.__version__ == "0+unknown"
        return
    assert tg.__version__ == installed
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", tg.__version__)


def test_error_classes_read_as_tapegrad_names_and_pickle() -> None:
    for cls in (tg.TapegradError, tg.ShapeError, tg.DTypeError, tg.TapeError, tg.DeviceError,
                tg.AnomalyError, tg.GradcheckError, tg.NotAnIdError, tg.ArgumentTypeError,
                tg.IndexRangeError, tg.MissingGradientError):
        assert cls.__module__ == "tapegrad" and getattr(tg, cls.__name__) is cls
        assert issubclass(cls, tg.TapegradError)
        again = pickle.loads(pickle.dumps(cls("message")))
        assert type(again) is cls and str(again) == "message"
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
    with pytest.raises(tg.ShapeError) as info:
        tg.reshape(tape, x, (4,))
    assert f"{type(info.value).__module__}.{type(info.value).__qualname__}" == \
        "tapegrad.ShapeError"
    assert _errors.ShapeError is tg.ShapeError


# --- a forgotten requires_grad ----------------------------------------------------------------

def _forgot() -> tuple[tg.Tape, tg.Id, tg.Id, tg.Id, tg.Id, tg.Id]:
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32), name="x")
    tape, w = tg.leaf(tape, np.ones((3, 2), np.float32), name="w")  # no requires_grad
    tape, h = tg.matmul(tape, x, w)
    tape, loss = tg.sum(tape, h)
    tape, unused = tg.leaf(tape, np.ones(2, np.float32), requires_grad=True, name="unused")
    return tape, x, w, h, loss, unused


def test_backward_reaching_no_requires_grad_leaf_is_empty_and_says_why_on_lookup() -> None:
    tape, _, w, _, loss, _ = _forgot()
    grads = tg.backward(tape, loss)
    assert len(grads) == 0 and dict(grads) == {}
    with pytest.raises(tg.MissingGradientError) as info:
        grads[w]
    message = str(info.value)
    assert isinstance(info.value, KeyError) and isinstance(info.value, tg.TapeError)
    assert "node 1 (leaf 'w'" in message and "does not require grad" in message
    assert "requires_grad=True" in message and "wrt=" in message
    assert re.search(rf"called at \S*{HERE}:\d+", message)
    assert not message.startswith("'")  # not KeyError's quoted repr of the message
    assert grads.get(w) is None  # a plain mapping otherwise


def test_missing_gradient_messages_tell_each_case_apart() -> None:
    tape, x, _, h, loss, unused = _forgot()
    tape, idx = tg.leaf(tape, np.arange(2))
    grads = tg.backward(tape, loss)
    with pytest.raises(tg.MissingGradientError, match=r"not a leaf.*pass wrt=\[\.\.\.\]"):
        grads[h]
    with pytest.raises(tg.MissingGradientError,
                       match=r"the loss \(node 3\) does not depend on it"):
        grads[unused]
    with pytest.raises(tg.MissingGradientError, match="only float values take gradients"):
        grads[idx]
    with pytest.raises(tg.MissingGradientError, match="keyed by the Ids of the tape, not int"):
        grads[0]  # pyright: ignore[reportArgumentType] - a user's mistake
    other, y = tg.leaf(tg.Tape(), np.ones(1, np.float32))
    with pytest.raises(tg.MissingGradientError, match="not a node of the tape"):
        grads[y]
    # what the messages suggest works: wrt gives the interior node's and the leaf's gradients
    asked = tg.backward(tape, loss, wrt=[h, x])
    np.testing.assert_array_equal(asked[h].numpy(), np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(asked[x].numpy(), np.full((2, 3), 2.0, np.float32))
    del other


def test_recorded_sweep_result_explains_missing_keys_too() -> None:
    tape, _, w, _, loss, _ = _forgot()
    tape, grads = tg.backward_on_tape(tape, loss, None)
    with pytest.raises(tg.MissingGradientError, match="does not require grad"):
        grads[w]


# --- a notebook cell run twice ------------------------------------------------------------------

def test_an_identical_custom_op_definition_is_the_same_op() -> None:
    cube = tg.elementwise_op("first_hour_cube", 1, "a * a * a", ["g * (T)3 * a * a"])
    again = tg.elementwise_op("first_hour_cube", 1, "a * a * a", ["g * (T)3 * a * a"])
    assert again is cube
    tape, x = tg.leaf(tg.Tape(), np.array([2.0], np.float32))
    tape, y = again(tape, x)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), [8.0])


def test_a_changed_custom_op_definition_says_how_to_get_it() -> None:
    tg.elementwise_op("first_hour_sq", 1, "a * a", ["g * (T)2 * a"])
    with pytest.raises(tg.TapegradError) as info:
        tg.elementwise_op("first_hour_sq", 1, "a * a * a", ["g * (T)3 * a * a"])
    message = str(info.value)
    assert "'first_hour_sq' is already defined, with another forward, vjps" in message
    assert "(forward 'a * a', now 'a * a * a')" in message
    assert "'first_hour_sq_v2'" in message and "restart" in message and HERE in message


# --- values a person can read -----------------------------------------------------------------

def test_repr_shows_values_like_numpy() -> None:
    t = tg.AnyTensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert repr(t) == ("AnyTensor([[0., 1., 2.],\n           [3., 4., 5.]], shape=(2, 3), "
                       "dtype=float32, device='0:0')")
    assert repr(tg.AnyTensor(np.float64(2.5))) == \
        "AnyTensor(2.5, shape=(), dtype=float64, device='0:0')"
    assert repr(tg.AnyTensor(np.zeros((0, 3), np.int64))) == \
        "AnyTensor([], shape=(0, 3), dtype=int64, device='0:0')"
    big = repr(tg.AnyTensor(np.arange(3000, dtype=np.int32)))
    assert big == ("AnyTensor([   0,    1,    2, ..., 2997, 2998, 2999], shape=(3000,), "
                   "dtype=int32, device='0:0')")


def test_a_pending_value_prints_its_values() -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([1.0, -2.0], np.float32))
    tape, y = tg.mul(tape, x, 3.0)
    tape, y = tg.add(tape, y, 1.0)
    assert repr(tg.value(tape, y)) == \
        "AnyTensor([ 4., -5.], shape=(2,), dtype=float32, device='0:0')"


def test_scalars_convert_like_numpy() -> None:
    t = tg.AnyTensor(np.float32(1.5))
    assert float(t) == 1.5 and t.item() == 1.5 and isinstance(t.item(), float)
    assert int(tg.AnyTensor(np.int64(7))) == 7
    np.testing.assert_array_equal(np.asarray(tg.AnyTensor(np.arange(3.0))), [0.0, 1.0, 2.0])
    assert np.asarray(tg.AnyTensor(np.arange(3.0)), dtype=np.float32).dtype == np.float32
    with pytest.raises(tg.ShapeError, match=r"item\(\) needs a tensor of one element"):
        tg.AnyTensor(np.ones(2)).item()
    assert bool(tg.AnyTensor(np.array([2.0]))) and not bool(tg.AnyTensor(np.float32(0)))
    with pytest.raises(tg.ShapeError, match=r"truth value of a tensor of shape \(3,\) is "
                       "ambiguous"):
        bool(tg.AnyTensor(np.zeros(3)))


# --- the tape shown as the ops the user called --------------------------------------------------

def _model() -> tuple[tg.Tape, dict[str, tg.Id]]:
    tape, x = tg.leaf(tg.Tape(), np.ones((4, 3), np.float32), name="x")
    tape, w = tg.leaf(tape, np.ones(3, np.float32), requires_grad=True, name="w")
    tape, xw = tg.mul(tape, x, w)  # broadcast_to and mul
    tape, h = tg.var(tape, xw, axis=0, keepdims=True)  # a composition of primitives
    tape, r = tg.relu(tape, h)
    tape, labels = tg.leaf(tape, np.zeros(1, np.int64))
    tape, loss = tg.cross_entropy(tape, r, labels)
    return tape, {"x": x, "w": w, "h": h, "r": r, "labels": labels, "loss": loss}


def _ops(table: str) -> list[str]:
    return [re.split(r"\s{2,}", line.strip())[1] for line in table.splitlines()[2:]]


def test_describe_shows_one_row_per_call() -> None:
    tape, ids = _model()
    table = tg.describe(tape)
    h, loss = ids["h"].index, ids["loss"].index
    first_ce = ids["labels"].index + 1
    assert _ops(table) == ["leaf", "leaf", "mul (nodes 2-3)", f"var (nodes 4-{h})", "relu", "leaf",
                           f"cross_entropy (nodes {first_ce}-{loss})"]
    rows = {int(line.split()[0]): re.split(r"\s{2,}", line.strip())
            for line in table.splitlines()[2:]}
    assert rows[h][2:6] == ["(1, 3)", "float32", "3", "yes"]  # parents from outside
    assert rows[loss][4] == f"{ids['r'].index}, {ids['labels'].index}"
    assert rows[h][-1].endswith(HERE + ":" + rows[h][-1].rsplit(":", 1)[1])


def test_describe_expands_every_call_or_chosen_ones() -> None:
    tape, ids = _model()
    every = _ops(tg.describe(tape, expand=True))
    assert len(every) == len(tape)
    steps = [op for op in every if op.startswith("var/")]
    assert len(steps) == ids["h"].index - 3 and "var/clip" in steps
    chosen = _ops(tg.describe(tape, expand=[ids["h"]]))
    assert steps == [op for op in chosen if op.startswith("var/")]
    assert chosen[-1].startswith("cross_entropy (nodes ")
    with pytest.raises(tg.DTypeError, match="expand must be True, False or a list of Ids"):
        tg.describe(tape, expand="all")  # pyright: ignore[reportArgumentType]


def test_to_dot_draws_a_call_as_one_box_or_a_cluster() -> None:
    tape, ids = _model()
    h, r = ids["h"].index, ids["r"].index
    dot = tg.to_dot(tape, highlight=ids["loss"])
    boxes = re.findall(r"^  n(\d+) \[", dot, re.M)
    assert len(boxes) == 7
    assert f'label="#{h} var (nodes 4-{h})' in dot
    assert f"n{h} -> n{r} [color=\"red\"" in dot and f"n3 -> n{h} [color=\"red\"" in dot
    assert "n0 -> n3;" in dot  # x takes no gradient: off the highlighted path
    expanded = tg.to_dot(tape, expand=[ids["h"]])
    assert "subgraph cluster_4 {" in expanded and 'label="var"' in expanded
    assert len(re.findall(r"^ +n(\d+) \[", expanded, re.M)) == 7 - 1 + h - 3


def test_a_broadcasting_op_and_a_renamed_primitive_are_calls_too() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((4, 3), np.float32))
    tape, b = tg.leaf(tape, np.ones(3, np.float32))
    tape, w = tg.leaf(tape, np.ones((3, 2), np.float32))
    tape, h = tg.add(tape, x, b)  # records a broadcast_to first
    tape, z = tg.linear(tape, h, w)  # one matmul node
    tape, e = tg.exp(tape, z)  # one exp node: no call of its own
    assert _ops(tg.describe(tape))[3:] == [f"add (nodes 3-{h.index})",
                                           f"linear ({tape[z].op})", "exp"]
    assert _ops(tg.describe(tape, expand=True))[3:] == [
        "add/broadcast_to", "add/add", "linear/matmul", "exp"]
    del e


def test_an_unpacked_result_where_an_id_goes_says_to_unpack_it() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    pair = tg.relu(tape, x)
    for call in (lambda: tg.sum(tape, pair), lambda: tg.mul(tape, pair, 2.0),  # type: ignore
                 lambda: tg.exp(tape, pair), lambda: tg.add(tape, x, pair)):  # type: ignore
        with pytest.raises(tg.NotAnIdError, match=r"not tuple \(it is the \(tape, id\) pair an "
                           r"op returns: unpack it, as in tape, y = tg\.op\(\.\.\.\)\)"):
            call()


def test_calls_follow_the_tape_through_growth_and_branches() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
    grown, _ = tg.mse(tape, x, x)
    assert tape.calls() == [] and len(grown.calls()) == 1
    branch, _ = tg.softmax(tape, x)  # from the shorter tape: a copy, without mse
    branch, _ = tg.var(branch, x)
    assert [c.op for c in branch.calls()] == ["var"]
    assert [c.op for c in grown.calls()] == ["mse"]
    longer, _ = tg.var(grown, x, axis=0)
    assert [c.op for c in longer.calls()] == ["mse", "var"]
    assert [c.op for c in grown.calls()] == ["mse"]  # the older tape is unchanged


def test_a_call_inside_a_transform_is_grouped_by_the_op_the_user_called() -> None:
    def f(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, y = tg.var(tape, x, axis=1)
        return tg.sum(tape, y)

    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float64), requires_grad=True)
    tape, _ = tg.grad(f)(tape, x)
    assert "var" in [c.op for c in tape.calls()]


def test_an_array_given_with_a_tape_first_is_named_before_f_runs() -> None:
    """grad(f)(tape, array): the array is named as grad's argument, with what to do, before f
    runs (where an op inside f would have refused it first, at f's line)."""
    ran: list[bool] = []

    def f(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        ran.append(True)
        return tg.sum(tape, x)

    with pytest.raises(tg.DTypeError, match=r"^grad: argument 0 is a ndarray, but a "
                       r"differentiated argument's leaves must be float ids; with a tape first, "
                       r"arguments are ids on that tape: put arrays on it with tg.leaf"):
        tg.grad(f)(tg.Tape(), cast(Any, np.ones(3)))
    assert not ran


def test_a_config_field_in_differentiated_params_is_named_with_the_static_hint() -> None:
    from dataclasses import dataclass

    @dataclass
    class Model:
        w: Any
        layers: int

    def f(tape: tg.Tape, p: Model, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, h = tg.mul(tape, x, p.w)
        return tg.sum(tape, h)

    tape, w = tg.leaf(tg.Tape(), np.ones(2), requires_grad=True)
    tape, x = tg.leaf(tape, np.ones(2))
    hint = r"metadata=\{'static': True\}"
    with pytest.raises(tg.DTypeError, match=r"value_and_grad: argument 0\.layers is an int, "
                       r"but a differentiated argument's leaves must be float ids.*" + hint):
        tg.value_and_grad(f)(tape, Model(w, 3), x)
    with pytest.raises(tg.DTypeError, match=r"grad: argument 0\.layers has dtype int64.*" + hint):
        tg.grad(f)(Model(np.ones(2), 3), np.ones(2))

    @dataclass
    class Named:
        w: Any
        activation: str

    def g(tape: tg.Tape, p: Named) -> tuple[tg.Tape, tg.Id]:
        return tg.sum(tape, p.w)

    # a string field: named the same way, with the same hint
    with pytest.raises(tg.DTypeError, match=r"value_and_grad: argument 0\.activation is a str, "
                       r"neither an array, a number nor an AnyTensor.*" + hint):
        tg.value_and_grad(g)(Named(np.ones(2), "relu"))


_TAPE, _X = tg.leaf(tg.Tape(), np.ones((3, 4), np.float32))


@pytest.mark.parametrize(("call", "op", "words"), [
    (lambda: cast(Any, tg.reshape)(_TAPE, _X, 3, 4), "reshape",
     "the shape is one tuple: tg.reshape(tape, x, (3, 4))"),
    (lambda: cast(Any, tg.sum)(_TAPE, _X, dim=1), "sum",
     "name it axis= (numpy's word), not dim="),
    (lambda: cast(Any, tg.mean)(_TAPE, _X, axis=0, keepdim=True), "mean",
     "keepdims= (numpy's), not keepdim="),
    (lambda: cast(Any, tg.dropout)(_TAPE, _X, 0.5), "dropout",
     "missing 1 required positional argument: 'seed'"),
])
def test_an_op_called_with_pytorchs_habits_says_what_it_takes(
        call: Any, op: str, words: str) -> None:
    """A call whose arguments do not fit the op's parameters is an ArgumentTypeError naming
    the op, with the PyTorch habit behind it where one shows, at the user's line."""
    with pytest.raises(tg.ArgumentTypeError, match=re.escape(words)) as caught:
        call()
    message = str(caught.value)
    assert message.startswith(f"{op}: ") and "test_first_hour.py:" in message


def test_an_axis_given_as_a_word_is_named_whole() -> None:
    """A PyTorch-style or pandas-style axis name is refused as itself, not letter by
    letter."""
    for call in (lambda: tg.sum(_TAPE, _X, axis=cast(Any, "rows")),
                 lambda: tg.transpose(_TAPE, _X, axes=cast(Any, "rows"))):
        with pytest.raises(tg.ArgumentTypeError, match="got 'rows'"):
            call()
