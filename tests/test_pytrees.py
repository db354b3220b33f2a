"""Pytrees are optree's, dataclasses included without registration: round trips of each kind,
transforms and optimizers returning the structure they were given, key paths in errors,
tg.tree_map, and gradcheck's warning on float32 arguments."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections import OrderedDict, defaultdict
from typing import Any, NamedTuple, cast

import numpy as np
import optree
import pytest

import tapegrad as tg
from tapegrad import _tree

Out = tuple[tg.Tape, tg.Id]


@dataclasses.dataclass
class Linear:
    w: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class FrozenLinear:
    w: Any
    b: Any


@dataclasses.dataclass
class Activated:
    """A layer whose activation is part of the structure, not a leaf."""
    w: Any
    act: str = dataclasses.field(default="tanh", metadata={"static": True})


@dataclasses.dataclass
class WithDerived:
    """A field that __init__ does not take."""
    w: Any
    scale: Any = dataclasses.field(init=False, default=None)


@dataclasses.dataclass
class Checked:
    """__post_init__ accepts numpy arrays only: rebuilding a tree of ids must not run it."""
    w: Any

    def __post_init__(self) -> None:
        if not isinstance(self.w, np.ndarray):
            raise TypeError("w must be a numpy array")


@dataclasses.dataclass
class Model:
    layers: list[Any]
    head: Any


class Pair(NamedTuple):
    w: Any
    b: Any


def class_of(x: object) -> type:
    """type(x), without narrowing x's static type (a narrowed OrderedDict has unknown items)."""
    return type(x)


def roundtrip(tree: Any) -> tuple[Any, list[Any]]:
    leaves, spec = _tree.flatten(tree)
    return spec.unflatten(leaves), leaves


def test_each_container_kind_round_trips_with_its_class_and_order() -> None:
    a, b = np.array([1.0]), np.array([2.0])
    back, leaves = roundtrip(Linear(a, b))
    assert type(back) is Linear and back.w is a and back.b is b and leaves == [a, b]
    back, leaves = roundtrip(FrozenLinear(a, b))
    assert type(back) is FrozenLinear and back == FrozenLinear(a, b) and len(leaves) == 2
    back, leaves = roundtrip(Activated(a, act="relu"))
    assert type(back) is Activated and back.act == "relu" and back.w is a and leaves == [a]
    derived = WithDerived(a)
    derived.scale = b
    back, leaves = roundtrip(derived)
    assert type(back) is WithDerived and back.w is a and back.scale is b and leaves == [a, b]
    back, leaves = roundtrip(Pair(a, b))
    assert type(back) is Pair and back == Pair(a, b) and leaves == [a, b]
    ordered: OrderedDict[str, Any] = OrderedDict([("z", a), ("a", b)])
    back, leaves = roundtrip(ordered)
    assert class_of(back) is OrderedDict and list(back) == ["z", "a"] and leaves == [a, b]
    counts: defaultdict[str, Any] = defaultdict(list, {"y": a, "x": b})
    back, leaves = roundtrip(counts)
    assert type(back) is defaultdict and back.default_factory is list and leaves == [b, a]
    # A plain dict: leaves in sorted key order, rebuilt in its own order.
    back, leaves = roundtrip({"w": a, "b": b})
    assert list(back) == ["w", "b"] and leaves == [b, a]


def test_nested_mixes_and_none_subtrees_round_trip() -> None:
    x = [np.full(2, float(i)) for i in range(5)]
    tree = {"model": Model([Linear(x[0], None), FrozenLinear(x[1], x[2])], Pair(x[3], None)),
            "extra": (None, [x[4]])}
    back, leaves = roundtrip(tree)
    assert len(leaves) == 5 and all(any(leaf is v for v in x) for leaf in leaves)
    model = back["model"]
    assert type(model) is Model and type(model.layers[0]) is Linear
    assert model.layers[0].b is None and model.head.b is None and back["extra"][0] is None
    assert type(model.layers[1]) is FrozenLinear and model.layers[1].b is x[2]
    assert back["extra"][1][0] is x[4]


def test_tensors_ids_arrays_numbers_and_classes_stay_leaves() -> None:
    tape, i = tg.leaf(tg.Tape(), np.ones(2))
    things: list[Any] = [tg.AnyTensor(np.ones(2)), i, np.ones(3), np.float32(1.0), 2, 3.5,
                         "name", Linear]  # a dataclass itself (the class) is a leaf
    leaves, _ = _tree.flatten(things)
    assert len(leaves) == len(things) and all(a is b for a, b in zip(leaves, things, strict=True))
    assert tape is not None


def test_post_init_is_not_run_when_a_tree_is_rebuilt() -> None:
    def f(tape: tg.Tape, p: Checked) -> Out:
        tape, y = tg.mul(tape, p.w, p.w)
        return tg.sum(tape, y)

    grads = tg.grad(f)(Checked(np.array([1.0, -2.0])))
    assert type(grads) is Checked
    np.testing.assert_allclose(grads.w.numpy(), [2.0, -4.0])


# --- transforms ---------------------------------------------------------------------------------

def mlp_dict(tape: tg.Tape, p: dict[str, Any], x: tg.Id) -> Out:
    tape, h = tg.matmul(tape, x, p["l1"]["w"])
    tape, h = tg.add(tape, h, p["l1"]["b"])
    tape, h = tg.tanh(tape, h)
    tape, h = tg.matmul(tape, h, p["l2"]["w"])
    tape, h = tg.add(tape, h, p["l2"]["b"])
    tape, h = tg.mul(tape, h, h)
    return tg.sum(tape, h)


def mlp_model(tape: tg.Tape, p: Model, x: tg.Id) -> Out:
    l1, l2 = p.layers
    return mlp_dict(tape, {"l1": {"w": l1.w, "b": l1.b}, "l2": {"w": l2.w, "b": l2.b}}, x)


def _weights() -> tuple[dict[str, dict[str, np.ndarray[Any, Any]]], np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    p = {"l1": {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)},
         "l2": {"w": rng.standard_normal((4, 2)), "b": rng.standard_normal(2)}}
    return p, rng.standard_normal((5, 3))


def test_grad_over_a_dataclass_of_params_matches_the_dict_version() -> None:
    p, x = _weights()
    model = Model([Linear(p["l1"]["w"], p["l1"]["b"]), FrozenLinear(p["l2"]["w"], p["l2"]["b"])],
                  head=None)
    want = tg.grad(mlp_dict)(p, x)
    got = tg.grad(mlp_model)(model, x)
    assert type(got) is Model and got.head is None
    assert type(got.layers[0]) is Linear and type(got.layers[1]) is FrozenLinear
    for mine, theirs in zip(got.layers, ("l1", "l2"), strict=True):
        np.testing.assert_array_equal(mine.w.numpy(), want[theirs]["w"].numpy())
        np.testing.assert_array_equal(mine.b.numpy(), want[theirs]["b"].numpy())
    value, got2 = tg.value_and_grad(mlp_model)(model, x)
    want_value, _ = tg.value_and_grad(mlp_dict)(p, x)
    np.testing.assert_array_equal(value.numpy(), want_value.numpy())
    np.testing.assert_array_equal(got2.layers[1].w.numpy(), want["l2"]["w"].numpy())


def test_grad_on_a_tape_and_vjp_keep_dataclasses_and_namedtuples() -> None:
    def f(tape: tg.Tape, p: Pair, q: Activated) -> Out:
        tape, y = tg.mul(tape, p.w, p.b)
        tape, y = tg.mul(tape, y, q.w)
        return tg.sum(tape, y)

    w, b, v = np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.array([0.5, -1.0])
    tape = tg.Tape()
    tape, wi = tg.leaf(tape, w, requires_grad=True)
    tape, bi = tg.leaf(tape, b, requires_grad=True)
    tape, vi = tg.leaf(tape, v, requires_grad=True)
    tape, (gp, gq) = tg.grad(f, argnums=(0, 1))(tape, Pair(wi, bi), Activated(vi, act="relu"))
    assert type(gp) is Pair and type(gq) is Activated and gq.act == "relu"
    np.testing.assert_allclose(tg.value(tape, gp.w).numpy(), b * v)
    np.testing.assert_allclose(tg.value(tape, gq.w).numpy(), w * b)
    out, vjp_fn = tg.vjp(f, Pair(w, b), Activated(v))
    np.testing.assert_allclose(out.numpy(), np.sum(w * b * v))
    ct_p, ct_q = vjp_fn(np.array(2.0))
    assert type(ct_p) is Pair and type(ct_q) is Activated
    np.testing.assert_allclose(ct_p.b.numpy(), 2 * w * v)


def test_a_non_float_leaf_is_named_by_its_key_path() -> None:
    def f(tape: tg.Tape, p: Model) -> Out:
        return tg.sum(tape, p.head)

    with pytest.raises(tg.DTypeError, match=r"^grad: argument 0\.layers\[1\]\.w has dtype "
                       r"int64, but gradients exist only for float32 or float64 data"):
        tg.grad(f)(Model([Linear(np.ones(2), None), Linear(np.array([1, 2]), None)],
                         np.ones(2)))


# --- optimizers ---------------------------------------------------------------------------------

def _step_all(params: Any, grads: Any) -> list[Any]:
    """Two adam steps and two sgd steps with momentum from params and grads."""
    new_a, state_a = tg.optim.adam(params, grads, lr=0.1)
    new_a, state_a = tg.optim.adam(new_a, grads, state_a, lr=0.1)
    new_s, state_s = tg.optim.sgd(params, grads, lr=0.1, momentum=0.9)
    new_s, state_s = tg.optim.sgd(new_s, grads, state_s, lr=0.1, momentum=0.9)
    return [new_a, state_a["m"], state_a["v"], new_s, state_s["momentum"]]


def test_optimizers_over_dataclasses_and_namedtuples_match_the_dict_version() -> None:
    rng = np.random.default_rng(1)
    w, b, gw, gb = (rng.standard_normal(s) for s in ((3, 2), (2,), (3, 2), (2,)))
    want = _step_all({"w": w, "b": b}, {"b": gb, "w": gw})
    for kind in (Linear, FrozenLinear, Pair):
        got = _step_all(kind(w, b), kind(gw, gb))
        for mine, theirs in zip(got, want, strict=True):
            assert type(mine) is kind
            np.testing.assert_array_equal(mine.w.numpy(), theirs["w"].numpy())
            np.testing.assert_array_equal(mine.b.numpy(), theirs["b"].numpy())
    got = _step_all(Activated(w, act="gelu"), Activated(gw, act="gelu"))
    assert all(type(t) is Activated and t.act == "gelu" for t in got)
    np.testing.assert_array_equal(got[0].w.numpy(), want[0]["w"].numpy())


def test_optimizers_match_dicts_by_key_and_keep_the_params_order() -> None:
    params: OrderedDict[str, Any] = OrderedDict([("w", np.ones(2)), ("b", np.full(3, 2.0))])
    grads = {"b": np.full(3, 1.0), "w": np.full(2, 10.0)}
    new, state = tg.optim.sgd(params, grads, lr=0.1)
    assert class_of(new) is OrderedDict and list(new) == ["w", "b"]
    assert class_of(state["momentum"]) is OrderedDict
    np.testing.assert_allclose(new["w"].numpy(), np.zeros(2), atol=1e-15)
    np.testing.assert_allclose(new["b"].numpy(), np.full(3, 1.9))


def test_a_mismatch_names_the_first_differing_key_path() -> None:
    params = {"layers": [Linear(np.ones((3, 2)), np.ones(2)), Linear(np.ones((2, 2)), None)]}
    good = {"layers": [Linear(np.ones((3, 2)), np.ones(2)), Linear(np.ones((2, 2)), None)]}
    tg.optim.sgd(params, good, lr=0.1)
    wrong_shape = {"layers": [Linear(np.ones((3, 2)), np.ones(2)), Linear(np.ones(2), None)]}
    with pytest.raises(tg.ShapeError) as info:
        tg.optim.sgd(params, wrong_shape, lr=0.1)
    assert str(info.value).startswith(
        "sgd: grads['layers'][1].w has shape (2,), the param (2, 2)")
    assert "test_pytrees.py" in str(info.value)  # the caller's line
    not_none = {"layers": [Linear(np.ones((3, 2)), np.ones(2)), Linear(np.ones((2, 2)), 1.0)]}
    with pytest.raises(tg.ShapeError, match=r"^sgd: grads\['layers'\]\[1\]\.b must be None like "
                       r"params\['layers'\]\[1\]\.b, got a float"):
        tg.optim.sgd(params, not_none, lr=0.1)
    other_class = {"layers": [Linear(np.ones((3, 2)), np.ones(2)), Pair(np.ones((2, 2)), None)]}
    with pytest.raises(tg.ShapeError, match=r"^adam: grads\['layers'\]\[1\] must be a Linear "
                       r"like params\['layers'\]\[1\], got a Pair of 2"):
        tg.optim.adam(params, other_class)
    with pytest.raises(tg.ShapeError, match=r"^adam: grads must be an Activated with the static "
                       r"fields of params \(act='tanh'\), got an Activated with act='relu'"):
        tg.optim.adam(Activated(np.ones(2)), Activated(np.ones(2), act="relu"))
    _, state = tg.optim.adam(params, good)
    state["m"]["layers"][0] = {"w": np.ones((3, 2))}
    with pytest.raises(tg.ShapeError, match=r"^adam: state\['m'\]\['layers'\]\[0\] must be a "
                       r"Linear like params\['layers'\]\[0\], got a dict with keys 'w'"):
        tg.optim.adam(params, good, state)


# --- tree_map -----------------------------------------------------------------------------------

def test_tree_map_maps_leaves_of_every_kind_and_keeps_the_structure() -> None:
    tree = {"a": Linear(1.0, None), "b": (Pair(2.0, 3.0), [4.0]), "c": Activated(5.0)}
    doubled = tg.tree_map(lambda x: 2 * x, tree)
    assert doubled == {"a": Linear(2.0, None), "b": (Pair(4.0, 6.0), [8.0]),
                       "c": Activated(10.0)}
    summed = tg.tree_map(lambda x, y: x + y, tree, doubled)
    assert summed["b"][0] == Pair(6.0, 9.0) and summed["c"] == Activated(15.0)
    # `rest` may hold subtrees where `tree` has leaves: fn gets them whole.
    pairs = tg.tree_map(lambda x, y: (x, y), [1, 2], [{"k": 3}, None])
    assert pairs == [(1, {"k": 3}), (2, None)]
    seen: list[Any] = []
    tg.tree_map(seen.append, {"x": None, "y": 1})
    assert seen == [1]  # None is an empty subtree: fn never sees it


def test_tree_map_mismatches_name_the_place() -> None:
    with pytest.raises(tg.ShapeError, match=r"^tree_map: rest\[0\]\['b'\] must be a tuple of 2 "
                       r"like tree\['b'\], got a list of 2"):
        tg.tree_map(lambda x, y: x + y, {"a": 1, "b": (2, 3)}, {"a": 1, "b": [2, 3]})
    with pytest.raises(tg.ShapeError, match=r"^tree_map: rest\[1\] must be a dict with the "
                       r"keys of tree \('a'\), got a dict with keys 'b'"):
        tg.tree_map(lambda x, y, z: x, {"a": 1}, {"a": 2}, {"b": 3})
    with pytest.raises(tg.ShapeError, match=r"^tree_map: rest\[0\]\.layers must be a list of 1 "
                       r"like tree\.layers, got a list of 2"):
        tg.tree_map(lambda x, y: x, Model([1], 2), Model([1, 3], 2))


def _identity(a: object) -> object:
    return a


def test_tree_map_names_a_function_that_cannot_take_the_leaves() -> None:
    """fn not a function (the tree first, as in some libraries), or one that does not take a
    leaf of each tree: tapegrad's errors saying so; a TypeError inside fn passes through."""
    with pytest.raises(tg.DTypeError, match=r"^tree_map: fn must be a function, got 3"):
        tg.tree_map(cast(Any, 3), [1, 2])
    with pytest.raises(tg.ArgumentTypeError, match=r"^tree_map: fn is called with one leaf of "
                       r"each of the 2 trees given, and does not take 2 positional arguments"):
        tg.tree_map(cast(Any, _identity), [1, 2], [1, 2])
    with pytest.raises(TypeError, match=r"has no len\(\)") as inside:
        tg.tree_map(lambda a: len(a), [1])
    assert not isinstance(inside.value, tg.TapegradError)


def test_tree_map_is_typed_and_documented() -> None:
    doc = tg.tree_map.__doc__ or ""
    assert 'namespace="tapegrad"' in doc and '{"static": True}' in doc
    assert tg.tree_map(lambda x: x + 1, 1) == 2  # a bare leaf is a tree of one


# --- registration -------------------------------------------------------------------------------

class Box:
    """A user's class, registered with optree in tapegrad's namespace."""

    def __init__(self, content: Any) -> None:
        self.content = content


def box_children(box: Box) -> tuple[tuple[Any], None, tuple[str]]:
    return (box.content,), None, ("content",)


def box_from(_: None, children: Any) -> Box:
    return Box(*children)


register: Any = cast(Any, optree).register_pytree_node  # optree's stubs want a Collection
register(Box, box_children, box_from, path_entry_type=optree.GetAttrEntry, namespace="tapegrad")


@dataclasses.dataclass
class Registered:
    """A dataclass whose user registered it: its registration (a and b swapped) is kept."""
    a: Any
    b: Any


def registered_children(r: Registered) -> tuple[tuple[Any, Any], None, None]:
    return (r.b, r.a), None, None


def registered_from(_: None, children: Any) -> Registered:
    b, a = children
    return Registered(a, b)


register(Registered, registered_children, registered_from, namespace="tapegrad")


def test_classes_registered_by_the_user_in_tapegrads_namespace_are_pytrees() -> None:
    def f(tape: tg.Tape, box: Box) -> Out:
        tape, y = tg.mul(tape, box.content["x"], 3.0)
        return tg.sum(tape, y)

    grads = tg.grad(f)(Box({"x": np.ones(2)}))
    assert type(grads) is Box
    np.testing.assert_array_equal(grads.content["x"].numpy(), [3.0, 3.0])
    leaves, _ = _tree.flatten(Registered(1, 2))
    assert leaves == [2, 1]  # the user's order, not the fields'
    with pytest.raises(tg.DTypeError, match=r"sgd: params\.content\['x'\] must be an AnyTensor"):
        tg.optim.sgd(Box({"x": "text"}), Box({"x": "text"}), lr=0.1)


def test_dataclasses_first_met_in_several_threads_register_once() -> None:
    kinds = [dataclasses.make_dataclass(f"Fresh{i}", ["w", "b"]) for i in range(8)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        try:
            for kind in kinds:
                back, leaves = roundtrip([kind(np.ones(1), kind(np.ones(2), None))])
                assert type(back[0]) is kind and type(back[0].b) is kind and len(leaves) == 2
        except BaseException as err:  # reported below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# --- gradcheck ----------------------------------------------------------------------------------

def weighted(tape: tg.Tape, p: dict[str, Any], x: tg.Id) -> Out:
    tape, y = tg.mul(tape, p["w"], x)
    return tg.sum(tape, y)


def test_gradcheck_warns_on_float32_naming_the_argument() -> None:
    p = {"w": np.array([1.0, 2.0], np.float32)}
    with pytest.warns(UserWarning, match=r"^gradcheck: argument 0\['w'\] is float32: finite "
                      r"differences in float32 are unreliable.*pass float64 arrays") as caught:
        assert tg.gradcheck(weighted, p, np.array([3.0, 4.0])) is True
    assert len(caught) == 1 and caught[0].filename == __file__  # the caller's line
    with pytest.warns(UserWarning, match=r"^gradcheck: argument 1 is float32"):
        tg.gradcheck(weighted, {"w": np.ones(2)}, tg.AnyTensor(np.ones(2, np.float32)))


def test_gradcheck_on_float64_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tg.gradcheck(weighted, {"w": np.array([1.0, 2.0])}, np.array([3.0, 4.0]))
        assert tg.gradcheck(weighted, Pair(np.ones(2), None)._asdict(), np.ones(2))


class _Pair(NamedTuple):
    a: Any
    b: Any


def _plain_trees() -> list[Any]:
    t = tg.AnyTensor(np.ones(2))
    u = tg.AnyTensor(np.zeros(3))
    return [
        {"w": t, "b": u}, {"b": u, "w": t},  # one structure, two insertion orders
        {"m": {"x": t, "a": u}, "v": {"x": u, "a": t}, "step": 3},
        [t, (u, None, 1.5), [], {}, np.arange(3)], (t,), [], None, t, 7,
        {"layer": {"w": t, "b": None}}, ((t, u), [t]),
        # not plain: optree's own walk
        OrderedDict([("z", t), ("a", u)]), _Pair(t, u), {"flag": True, "x": t},
        {1: t, 2: u}, defaultdict(list, {"a": t}), [np.float32(2.0), t],
    ]


@pytest.mark.parametrize("k", range(len(_plain_trees())))
def test_flatten_gives_optrees_leaves_and_structure_every_time(k: int) -> None:
    """`_tree.flatten` walks plain trees (dicts with str keys, lists, tuples and None over
    tensors, arrays and numbers) in Python and takes their structure from a table filled by
    optree: the same leaves (the very objects, in optree's order) and a structure equal to
    optree's, which rebuilds the tree with each dict's own key order, at the first call and
    the later ones; other trees take optree's walk."""
    tree: Any = _plain_trees()[k]
    kind: Any = tree.__class__
    want_leaves, want_spec = optree.tree_flatten(tree, namespace=_tree.NAMESPACE)
    for _ in range(3):
        leaves, spec = _tree.flatten(tree)
        assert len(leaves) == len(want_leaves)
        assert all(a is b for a, b in zip(leaves, want_leaves, strict=True))
        assert spec == want_spec
        rebuilt: Any = spec.unflatten(leaves)
        assert type(rebuilt) is kind
        if isinstance(tree, dict):
            assert list(cast(dict[Any, Any], rebuilt)) == list(cast(dict[Any, Any], tree))
            inner = cast(dict[Any, Any], tree).get("m")
            if isinstance(inner, dict):
                got = cast(dict[Any, Any], rebuilt)["m"]
                assert list(got) == list(cast(dict[Any, Any], inner))

