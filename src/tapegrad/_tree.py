"""Pytrees: optree's, with dataclass instances as pytrees of their fields.

A pytree is what optree flattens in the namespace `NAMESPACE` ("tapegrad"): dicts (leaves in
sorted key order, rebuilt in the dict's own order), OrderedDicts, defaultdicts, lists, tuples,
namedtuples, deques, None (an empty subtree: a layer without a bias, `{"w": w, "b": None}`),
classes registered with optree, and dataclass instances. Everything else is a leaf: AnyTensors,
ids, numpy arrays, numbers.

Registering a class: optree has no public way to register into its global namespace (an empty
namespace is refused), so a user registers into tapegrad's,
`optree.register_pytree_node(cls, flatten, unflatten, namespace="tapegrad")`. Registrations that
libraries make in optree's global namespace are seen too (a namespace falls back to it).

Dataclasses need no registration (as equinox modules need none): the first time an instance is
met as a leaf, its class is registered in `NAMESPACE`, its children the fields in declaration
order, and then it is flattened natively. A field with `metadata={"static": True}` (equinox's
`field(static=True)`, or optree's `pytree_node=False`) is not a leaf but part of the structure:
trees match only where such values are equal (`==`). An instance is rebuilt without calling
`__init__` or `__post_init__` (`object.__new__` and `object.__setattr__`, as equinox does): a
tree of ids or gradients need not pass the checks made for parameters, frozen dataclasses and
`init=False` fields round-trip, and only fields are kept (attributes set outside the fields are
not). A class registered in `NAMESPACE` by the user before its first use is left as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast, overload

import numpy as np
import optree
from optree import PyTreeSpec

from ._errors import ArgumentTypeError, DTypeError, ShapeError, at_site, shown, takes_positional
from ._tape import Id
from ._tensor import AnyTensor

NAMESPACE = "tapegrad"

# What `dataclasses.is_dataclass` looks for, read here on the class of every leaf flattened.
_DATACLASS_FIELDS = "__dataclass_fields__"
_REGISTERING = threading.Lock()  # a class is checked and registered as one step


def flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """The leaves of `tree` in optree's order, and its structure (`spec.unflatten(leaves)`
    rebuilds it, each container of the class it was)."""
    leaves, spec, _ = _flatten(tree)
    return leaves, spec


def flatten_ordered(tree: Any) -> tuple[list[Any], PyTreeSpec, Hashable]:
    """`flatten`, and the key order of each dict in `tree` as a hashable value: equal for
    trees of one structure whose dicts hold their keys in the same orders (`dict_orders`; a
    plain tree's shape, which its walk made, holds them already)."""
    leaves, spec, shape = _flatten(tree)
    return leaves, spec, dict_orders(tree, spec) if shape is None else shape


def _flatten(tree: Any) -> tuple[list[Any], PyTreeSpec, tuple[Any, ...] | None]:
    """`flatten`, and the tree's plain shape where it is plain (`_plain_shape`), else None."""
    plain: list[object] = []
    try:
        shape = _plain_shape(tree, plain)
    except RecursionError:  # deeper than Python's stack: optree's walk has none
        shape = None
    if shape is not None:
        found = _PLAIN_SPECS.get(shape)
        if found is not None:
            return plain, found, shape
    leaves: list[object]
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    if shape is not None:
        if len(leaves) == len(plain) and all(map(operator.is_, leaves, plain)):
            if len(_PLAIN_SPECS) < _PLAIN_SPECS_MAX:
                _PLAIN_SPECS[shape] = spec
            return leaves, spec, shape
        shape = None
    for leaf in leaves:
        # A dataclass instance is a leaf only until its class is registered.
        if hasattr(type(leaf), _DATACLASS_FIELDS):
            return (*_flatten_registering(tree), None)
    return leaves, spec, None


# The structures of plain trees (dicts with str keys, lists, tuples and None over tensors,
# arrays and numbers: parameters, optimizer states, batches) by their shape as
# `_plain_shape` writes it. Such a tree is flattened in Python, its structure taken from here:
# optree's first call after a step's kernels was most of a jitted call's host time before its
# first launch (docs/BENCHMARKS.md, session 35).
_PLAIN_SPECS: dict[tuple[Any, ...], PyTreeSpec] = {}
_PLAIN_SPECS_MAX = 4096
_PLAIN_LEAVES = (AnyTensor, Id, np.ndarray, float, int)


def _plain_shape(tree: Any, leaves: list[Any]) -> tuple[Any, ...] | None:
    """A hashable shape of `tree` if it is plain (see _PLAIN_SPECS), its leaves appended in
    optree's order (a dict's in sorted key order); None for any other tree (`leaves` then
    holds a part)."""
    kind = tree.__class__
    if kind in _PLAIN_LEAVES:
        leaves.append(tree)
        return ()
    if kind is dict:
        order = tuple(tree)  # a spec rebuilds a dict in its own key order
        if not all(k.__class__ is str for k in order):
            return None
        children: list[Any] = []
        for k in sorted(order):
            child = _plain_shape(tree[k], leaves)
            if child is None:
                return None
            children.append(child)
        return ("dict", order, tuple(children))
    if kind is list or kind is tuple:
        items: list[Any] = []
        for item in tree:
            child = _plain_shape(item, leaves)
            if child is None:
                return None
            items.append(child)
        return (kind.__name__, tuple(items))
    if tree is None:
        return ("none",)
    return None


# Whether a structure holds a dict (by structure: equal structures answer alike), for
# `dict_orders`; bounded as the structures a program sees are few.
_HOLDS_DICT: dict[PyTreeSpec, bool] = {}


def dict_orders(tree: Any, spec: PyTreeSpec) -> tuple[Any, ...]:
    """The keys of each dict in `tree` (of structure `spec`) in insertion order, as a walk
    meets them: structures compare dicts by their sorted keys (leaves come in that order), yet
    a function may iterate a dict in its own order and return another list for it."""
    holds = _HOLDS_DICT.get(spec)
    if holds is None:
        holds = "{" in repr(spec)
        if len(_HOLDS_DICT) < 4096:
            _HOLDS_DICT[spec] = holds
    if not holds:
        return ()
    orders: list[tuple[Any, ...]] = []
    stack: list[Any] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found = cast(dict[Any, Any], node)
            orders.append(tuple(found))
            stack.extend(found.values())
        elif type(node) is list or type(node) is tuple:
            stack.extend(cast(Sequence[Any], node))
        elif node is not None and not isinstance(node, _LEAVES):
            try:
                children, *_ = optree.tree_flatten_one_level(node, namespace=NAMESPACE)
            except ValueError:  # a leaf
                continue
            stack.extend(children)
    return tuple(orders)


# Leaves met most (parameters, inputs, numbers), told apart without asking optree.
_LEAVES = (AnyTensor, np.ndarray, np.generic, int, float, str, Id)


def _flatten_registering(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """`flatten`, registering the classes of dataclass leaves until none is left (each round
    opens one more level of nested dataclasses)."""
    seen: set[type] = set()
    while True:
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
        classes: set[type] = {type(x) for x in leaves if _is_dataclass(x)}
        if classes <= seen:  # none left, or one that stays a leaf however registered
            return leaves, spec
        for cls in classes - seen:
            _register_dataclass(cls)
        seen |= classes


def _is_static(field: dataclasses.Field[Any]) -> bool:
    return (field.metadata.get("static", False) is True
            or field.metadata.get("pytree_node", True) is False)


# optree's registry, its `.get` included (its stubs leave the registry entry's type unknown).
_registry: Any = cast(Any, optree).register_pytree_node


def _register_dataclass(cls: type) -> None:
    """Make the dataclass `cls` a pytree node in NAMESPACE, unless it is one."""
    with _REGISTERING:
        if _registry.get(cls, namespace=NAMESPACE) is not None:
            return
        fields = dataclasses.fields(cls)
        children = tuple(f.name for f in fields if not _is_static(f))
        static = tuple(f.name for f in fields if _is_static(f))

        def flatten_fields(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
            return (tuple(getattr(obj, name) for name in children),
                    tuple(getattr(obj, name) for name in static), children)

        def unflatten_fields(static_values: Any, values: Any) -> Any:
            obj: Any = object.__new__(cast(type[Any], cls))
            for name, value in zip(children, values, strict=True):
                object.__setattr__(obj, name, value)
            for name, value in zip(static, static_values, strict=True):
                object.__setattr__(obj, name, value)
            return obj

        with contextlib.suppress(ValueError):  # registered meanwhile by the user (no lock)
            _registry(cls, flatten_fields, unflatten_fields,
                      path_entry_type=optree.GetAttrEntry, namespace=NAMESPACE)


def leaf_paths(spec: PyTreeSpec) -> list[str]:
    """The key path of each leaf as code: `['layers'][1].w` (empty for a bare leaf). For
    messages: it walks the whole structure, slower than flattening it."""
    return [accessor.codify("") for accessor in spec.accessors()]


def leaf_path(spec: PyTreeSpec, index: int) -> str:
    """The key path of leaf `index` (see `leaf_paths`)."""
    return spec.accessors()[index].codify("")


def describe(node: Any) -> str:
    """A pytree node in words, for errors: "a dict with keys 'b', 'w'", 'a list of 2'."""
    if node is None:
        return "None"
    kind = type(node).__name__
    if isinstance(node, dict):
        return f"a {kind} with keys {_keys(cast(dict[Any, Any], node))}"
    if isinstance(node, list | tuple):
        return f"a {kind} of {len(cast(Sequence[Any], node))}"
    return f"{_article(kind)} {kind}"


def _keys(d: Any) -> str:
    return ", ".join(sorted(map(repr, d)))


def is_node(x: Any) -> bool:
    """Whether `x` is a pytree container (None, an empty subtree, included)."""
    return not optree.tree_is_leaf(x, namespace=NAMESPACE) or _is_dataclass(x)


def match(tree: Any, spec: PyTreeSpec, like: Any, op: str, what: str, like_name: str,
          exact: bool = False) -> list[Any]:
    """The subtrees of `tree` at the places of the leaves of `like` (whose structure is
    `spec`), in `like`'s leaf order; usually leaves, but whatever `tree` holds there is given
    (a caller checks that it is a tensor).

    Dicts are matched by key, so {"b", "w"} against {"w", "b"} pairs w with w. Unless `exact`,
    any dict may stand for any dict and a list for a tuple of the same length. A different
    structure is a ShapeError naming the op, `what` and the first place the two differ:
    `sgd: grads['b'] must be a list or tuple of 1 like params['b'], got a list of 0`.
    """
    try:
        return spec.flatten_up_to(tree)
    except (ValueError, TypeError) as err:
        found = _Walk(op, what, like_name, exact).walk(tree, like, "")
        if exact:  # the walk knows optree's rules; should it ever miss one, say optree's words
            raise ShapeError(at_site(f"{op}: {what} does not match {like_name}: {err}")) from None
        return found


class _Walk:
    """`match`'s slow path: both trees walked from the root to their first difference."""

    def __init__(self, op: str, what: str, like_name: str, exact: bool) -> None:
        self.op, self.what, self.like_name, self.exact = op, what, like_name, exact

    def fail(self, tree: Any, path: str, expected: str, got: str | None = None
             ) -> ShapeError:
        ids = _is_dict(tree) and any(isinstance(k, Id) for k in tree)
        return ShapeError(at_site(
            f"{self.op}: {self.what}{path} must be {expected}, got {got or describe(tree)}"
            + ("; tg.backward's result is keyed by Id: rebuild the params' structure from "
               "it, e.g. {name: grads[i] for name, i in ids.items()}" if ids else "")))

    def walk(self, tree: Any, like: Any, path: str) -> list[Any]:
        """The subtrees of `tree` at `like`'s leaves, `path` the place of both in the roots."""
        like_here = f"{self.like_name}{path}"
        if like is None:
            if tree is not None:
                raise self.fail(tree, path, f"None like {like_here}")
            return []
        if optree.tree_is_leaf(like, namespace=NAMESPACE):
            return [tree]
        kind = type(like).__name__
        if _is_dict(like):
            if not (_is_dict(tree) and set(tree) == set(like)) or (
                    self.exact and type(tree) is not type(like)):
                dict_kind = kind if self.exact else "dict"
                raise self.fail(tree, path, f"{_article(dict_kind)} {dict_kind} with the keys "
                                            f"of {like_here} ({_keys(like)})")
        elif _is_sequence(like):
            if not (_is_sequence(tree) and len(tree) == len(like)) or (
                    self.exact and type(tree) is not type(like)):
                seq_kind = kind if self.exact else "list or tuple"
                raise self.fail(tree, path, f"{_article(seq_kind)} {seq_kind} of {len(like)} "
                                            f"like {like_here}")
        else:  # optree's rules: the same class, the same metadata (static fields, a maxlen)
            if type(tree) is not type(like):
                raise self.fail(tree, path, f"{_article(kind)} {kind} like {like_here}")
            flatten(tree)  # registers its dataclasses, should it hold others than like
            tree_one: Any = optree.tree_flatten_one_level(tree, namespace=NAMESPACE)
            like_one: Any = optree.tree_flatten_one_level(like, namespace=NAMESPACE)
            if (tree_one.metadata != like_one.metadata
                    or len(tree_one.children) != len(like_one.children)):
                if _is_dataclass(like):
                    raise self.fail(tree, path, f"{_article(kind)} {kind} with the static "
                                                f"fields of "
                                                f"{like_here} ({_static_fields(like)})",
                                    f"{_article(kind)} {kind} with {_static_fields(tree)}")
                raise self.fail(tree, path, f"{_article(kind)} {kind} with the structure of "
                                            f"{like_here}")
            return [x for (entry, _, child), (_, _, tree_child)
                    in zip(_children(like), _children(tree), strict=True)
                    for x in self.walk(tree_child, child, path + entry)]
        # a dict by key, a sequence by index
        return [x for entry, key, child in _children(like)
                for x in self.walk(tree[key], child, path + entry)]


def _static_fields(x: Any) -> str:
    """A dataclass instance's static fields as `name=value`, for errors."""
    return ", ".join(f"{f.name}={getattr(x, f.name)!r}" for f in dataclasses.fields(x)
                     if _is_static(f))


def _is_dict(x: object) -> bool:
    return isinstance(x, dict)


def _is_sequence(x: object) -> bool:
    return isinstance(x, list | tuple)


def _article(word: str) -> str:
    return "an" if word[0] in "AEIOUaeiou" else "a"


def _is_dataclass(x: object) -> bool:
    """Whether `x` is a dataclass instance (not a dataclass: a class is a leaf)."""
    return hasattr(type(x), _DATACLASS_FIELDS)


def _children(node: Any) -> list[tuple[str, Any, Any]]:
    """A node's children in optree's order, each with its key path from the node (`['w']`,
    `[0]`, `.w`) and its key (a dict's key, a sequence's index)."""
    accessors, children, _ = optree.tree_flatten_with_accessor(
        node, is_leaf=lambda x: x is not node, namespace=NAMESPACE)
    return [(a.codify(""), a[0].entry, child)
            for a, child in zip(accessors, children, strict=True)]


# Overloads by arity type a lambda's parameters (Any) where the user's code is checked strictly.
@overload
def tree_map(fn: Callable[[Any], Any], tree: Any, /) -> Any: ...
@overload
def tree_map(fn: Callable[[Any, Any], Any], tree: Any, rest: Any, /) -> Any: ...
@overload
def tree_map(fn: Callable[[Any, Any, Any], Any], tree: Any, rest: Any, rest2: Any, /) -> Any: ...
@overload
def tree_map(fn: Callable[..., Any], tree: Any, /, *rest: Any) -> Any: ...
def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """`fn` applied to each leaf of `tree` (and the leaves at the same places of `rest`), in a
    tree of `tree`'s structure: optree's `tree_map` over tapegrad's pytrees, the ones that
    transforms, optimizers and gradcheck take and give back.

        host = tg.tree_map(lambda g: g.numpy(), grads)
        steps = tg.tree_map(lambda m, v: m.numpy() / v.numpy(), state["m"], state["v"])

    Pytrees are dicts (leaves in sorted key order), OrderedDicts, defaultdicts, lists, tuples,
    namedtuples, None (an empty subtree: `fn` never sees it), dataclass instances and classes
    registered with optree in the namespace "tapegrad"
    (`optree.register_pytree_node(cls, flatten, unflatten, namespace="tapegrad")`). Dataclasses
    need no registration: they are pytrees of their fields, rebuilt without calling
    `__init__`; a field declared with `dataclasses.field(metadata={"static": True})` is not a
    leaf but part of the structure. Everything else is a leaf (AnyTensors, ids, arrays,
    numbers).

    Each of `rest` has `tree`'s structure, or holds subtrees where `tree` has leaves (they are
    given to `fn` whole); otherwise a ShapeError names the first place where they differ.
    """
    if not callable(fn):
        raise DTypeError(at_site(
            f"tree_map: fn must be a function, got {shown(fn)}; the function comes first, as "
            "in tg.tree_map(fn, tree)"))
    leaves, spec = flatten(tree)
    columns = [match(r, spec, tree, "tree_map", f"rest[{k}]", "tree", exact=True)
               for k, r in enumerate(rest)]
    try:
        return spec.unflatten([fn(*xs) for xs in zip(leaves, *columns, strict=True)])
    except TypeError as err:
        if takes_positional(fn, 1 + len(rest)) is not False:
            raise  # raised inside fn
        raise ArgumentTypeError(at_site(
            f"tree_map: fn is called with one leaf of each of the {1 + len(rest)} trees given, "
            f"and does not take {1 + len(rest)} positional argument{'s' * bool(rest)} "
            f"({err})")) from err
