"""Typed ids: jaxtyping annotations over `tg.Id`, checked at run time by beartype.

jaxtyping checks an object by reading its `.shape` (a tuple of ints) and `.dtype` (whose
`.type.__name__` it compares, as for a numpy dtype). `Id` has both, so every jaxtyping dtype
family works on it unchanged: `Float[tg.Id, "batch dim"]`, `Float32[...]`, `Int[tg.Id, " n"]`,
`Bool[...]`, `Shaped[...]`, with `*batch`, `#dim` and fixed sizes as for numpy arrays. For a
static checker such as pyright, `Float[tg.Id, "..."]` is `Annotated[tg.Id, "..."]`, i.e. `tg.Id`.

`typed` is `jaxtyping.jaxtyped(typechecker=beartype)`. On a user's tape function it checks every
annotated argument and the result, and binds each dimension name to one size across all of them
within one call, including ids inside a `tuple[tg.Tape, Float[tg.Id, "batch out"]]` result. A
mismatch raises jaxtyping's `TypeCheckError` (a `TypeError`) naming the parameter or the return
value, the expected type and the sizes bound so far.

Only user functions that ask for it pay for the check: tapegrad's own ops are never wrapped, and
jaxtyping and beartype are imported when `typed` is first used, not by `import tapegrad`.

The check is remembered. It depends only on what the arguments are: an id's shape and dtype, a
tape's type, a number's or string's value. So a call whose arguments look exactly like those of
a call that passed runs unchecked, and its result is compared with that call's (shape and dtype
of each id in it); a result that differs is checked in full. A training loop calls its layers
with the same shapes every step: the CNN demo's convolution block spent ~220 us per call in
the checkers (a third of the block), for the same answer every time. Calls with other arguments
(arrays, containers of them, objects) are checked every time. One difference: inside a call
that runs unchecked, jaxtyping's own `isinstance` checks in the body do not see the sizes bound
by the arguments.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import typing
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from ._errors import DTypeError, at_site
from ._tape import Id, Tape

_F = TypeVar("_F", bound=Callable[..., Any])

_PLAIN = (bool, int, float, str)
_MAX_REMEMBERED = 1024  # argument signatures per function; past this the memory starts over
_MISSING = object()

_decorator: Callable[[Any], Any] | None = None


def _jaxtyped_beartype() -> Callable[[Any], Any]:
    global _decorator
    if _decorator is None:
        # jaxtyped's `typechecker` parameter is unannotated upstream, hence the ignore.
        from beartype import beartype
        from jaxtyping import jaxtyped  # pyright: ignore[reportUnknownVariableType]

        _decorator = jaxtyped(typechecker=beartype)
    return _decorator


def typed(fn: _F) -> _F:
    """Check `fn`'s jaxtyping annotations: `jaxtyped(typechecker=beartype)`, remembering the
    calls that passed (see the module's docstring).

        @tg.typed
        def layer(tape: tg.Tape, x: Float[tg.Id, "batch d_in"], w: Float[tg.Id, "d_in d_out"]
                  ) -> tuple[tg.Tape, Float[tg.Id, "batch d_out"]]:
            return tg.matmul(tape, x, w)

    Works on functions and methods, and (as jaxtyped does) on dataclasses. The signature seen by
    static checkers is `fn`'s own.
    """
    if not callable(fn):
        raise DTypeError(at_site(
            f"typed: decorates a function, a method or a dataclass, not {type(fn).__name__}"))
    if not inspect.isfunction(fn):  # a class (dataclass) or other callable: as jaxtyped does
        plain: _F = _jaxtyped_beartype()(fn)
        return plain
    try:
        # Evaluated here, in fn's module and the scope that decorates it (a function defined
        # in a function may name its locals): the checkers see them on `body`, whose own
        # globals are this module's (string annotations: `from __future__ import annotations`).
        hints = typing.get_type_hints(fn, localns=dict(sys._getframe(1).f_locals),
                                      include_extras=True)
    except Exception:  # names it cannot find now: left to the checkers, on every call
        every_call: _F = _jaxtyped_beartype()(fn)
        return every_call
    replay = threading.local()

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        found = getattr(replay, "result", _MISSING)
        if found is not _MISSING:  # a result already computed, being checked
            return found
        return fn(*args, **kwargs)

    # fn's signature with the evaluated annotations: jaxtyping reads the signature and would
    # evaluate string annotations in body's globals (this module's), beartype the annotations.
    signature = inspect.signature(fn)
    body.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p.replace(annotation=hints.get(p.name, p.annotation))
                    for p in signature.parameters.values()],
        return_annotation=hints.get("return", signature.return_annotation))
    body.__annotations__ = hints
    checked = _jaxtyped_beartype()(body)
    passed: dict[Hashable, Hashable] = {}  # arguments' signature -> the result's, both checked

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        key = _signature((args, tuple(sorted(kwargs.items()))))
        if key is None:
            return checked(*args, **kwargs)
        want = passed.get(key)
        if want is None:
            result = checked(*args, **kwargs)
            got = _signature(result)
            if got is not None:
                if len(passed) >= _MAX_REMEMBERED:
                    passed.clear()
                passed[key] = got
            return result
        result = fn(*args, **kwargs)  # these arguments passed before
        if _signature(result) != want:
            replay.result = result
            try:
                checked(*args, **kwargs)  # the arguments again, and this result
            finally:
                del replay.result
        return result

    typed_fn: _F = call  # pyright: ignore[reportAssignmentType]
    return typed_fn


def _signature(value: Any) -> Hashable | None:
    """All that a jaxtyping/beartype check of `value` depends on, or None if that is not known
    (any object but ids, tapes, None, bool/int/float/str and tuples/lists of them)."""
    kind: Any = value.__class__
    if kind is Id:
        return (kind, value.shape, value.dtype)
    if kind is Tape or value is None:
        return kind
    if kind in _PLAIN:
        return (kind, value)
    if kind is tuple or kind is list:
        items = [_signature(v) for v in value]
        return None if None in items else (kind, tuple(items))
    return None
