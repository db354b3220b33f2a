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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

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
    """Check `fn`'s jaxtyping annotations on every call: `jaxtyped(typechecker=beartype)`.

        @tg.typed
        def layer(tape: tg.Tape, x: Float[tg.Id, "batch d_in"], w: Float[tg.Id, "d_in d_out"]
                  ) -> tuple[tg.Tape, Float[tg.Id, "batch d_out"]]:
            return tg.matmul(tape, x, w)

    Works on functions and methods, and (as jaxtyped does) on dataclasses. The signature seen by
    static checkers is `fn`'s own.
    """
    wrapped: _F = _jaxtyped_beartype()(fn)
    return wrapped
