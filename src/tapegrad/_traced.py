"""Numbers that remember how they were computed from a jitted step's number arguments.

`tg.jit` hands `f` its number arguments as `TracedFloat`/`TracedInt`: a real float (a float
subclass) and an integer (not an int subclass: see `traced`), which every check and every op
takes as such, that also carry a function from the step's numbers to their value. Python
arithmetic on them gives traced numbers again, so a learning rate scaled in Python
(`base_lr * step / warmup`), or Adam's bias correction from its step count, reaches a kernel
argument as a function the compiled step evaluates on each call's numbers instead of a
constant.

Whatever the recording decided from a traced number's value is a *guard*: a comparison, a
truth test, a conversion with `int()`/`float()`/`round()`, an int used as an index or a
range. A recorded step is replayed only while its guards give what they gave at recording;
otherwise the step is recorded again. What C code reads from a float (math.exp, numpy's
constructors) leaves no trace: `tg.jit` finds such a number by recording twice and comparing
(see `_jit`).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import numpy as np

# A function of the step's numbers (in argument order) to a value.
NumberFn = Callable[[Sequence[Any]], Any]
Operator = Callable[[Any, Any], Any]


class Guards:
    """The facts a recording relied on: (fn, value) pairs that must still hold on replay.

    `decoy` (for a checking recording): the traced floats' values as C code reads them (the
    float inside the object, which math functions and numpy read without asking Python) are
    made different from their values, which every traced path uses: work that depended on a
    number by a path the trace does not follow then differs from the program at once,
    whatever the numbers were. (A traced int holds no C value: every read asks it.)"""

    def __init__(self, decoy: bool = False) -> None:
        self.facts: list[tuple[NumberFn, object]] = []
        self.decoy = decoy

    def note(self, fn: NumberFn, value: object) -> None:
        self.facts.append((fn, value))

    def hold(self, numbers: Sequence[Any]) -> bool:
        try:
            return all(fn(numbers) == value for fn, value in self.facts)
        except (ArithmeticError, ValueError, TypeError):
            return False


class Traced:
    """Mixin of the two traced number types: `_plain` is the value, `_fn` computes it."""

    _plain: Any
    _fn: NumberFn
    _guards: Guards

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """numpy scalar arithmetic with a traced number (`np.float32(0.5) * lr`) goes to the
        traced number's own operator, so the result stays traced; so does any other ufunc of
        numbers with a number result (`np.cos(np.pi * step / n)`, `np.minimum(1.0, step / w)`:
        a schedule), as a function of the call's numbers. Anything else (a comparison, an
        array operand) converts the traced number first, which notes its value as a guard, as
        numpy's own conversion did without this method."""
        scalars = method == "__call__" and not kwargs and all(
            isinstance(x, Traced | np.generic | int | float) for x in inputs)
        name = _DEFERRED.get(ufunc.__name__)
        if scalars and name is not None and len(inputs) == 2:
            a, b = inputs
            done = (getattr(a, f"__{name}__")(b) if isinstance(a, Traced)
                    else getattr(b, f"__r{name}__")(a))
            if done is not NotImplemented:
                return done
        compared = _UFUNC_COMPARISONS.get(ufunc.__name__)
        if scalars and compared is not None and len(inputs) == 2:
            a, b = inputs  # a comparison: its outcome is the guard, not the numbers' values
            done = (getattr(a, f"__{compared[0]}__")(b) if isinstance(a, Traced)
                    else getattr(b, f"__{compared[1]}__")(a))
            if done is not NotImplemented:
                return np.bool_(done)
        if scalars and ufunc.nout == 1:
            result = ufunc(*[plain(x) for x in inputs])
            if isinstance(result, np.floating | np.integer):  # not a bool: a decision
                fns = [fn_of(x) for x in inputs]

                def again(n: Sequence[Any]) -> Any:
                    return ufunc(*[fn(n) for fn in fns])
                return traced(result, again, self._guards)
        values = [_converted(x) if isinstance(x, Traced) else x for x in inputs]
        return getattr(ufunc, method)(*values, **kwargs)


def _converted(x: Any) -> Any:
    """float(x) or int(x) of a traced number: its value, noted as a guard."""
    return float(x) if isinstance(x, float) else int(x)


def traced(value: Any, fn: NumberFn, guards: Guards) -> Any:
    """`value` as a traced number computed by `fn`; values other than ints and floats (a
    bool from a comparison, a complex) are returned plain."""
    kind: object = value.__class__
    # numpy scalars too (a number times np.float64(2)): `_plain` keeps numpy's type, so that
    # later arithmetic rounds as the untraced step's would.
    if kind is float or isinstance(value, np.floating):
        v: float = float(cast(Any, value))
        # the decoy: a value that differs from any finite v (by 0.5 + |v| / 2)
        out: Any = TracedFloat(v + 0.5 + abs(v) * 0.5 if guards.decoy else v)
    elif kind is int or isinstance(value, np.integer):
        # Not an int: every read of its value (an index, a range, int(), float()) asks it, and
        # so is a guard; and a plain float on its left (0.5 * step, 0.9 ** step) finds no int
        # there and asks it to compute the result, which an int subclass's C value answered
        # untraced.
        out = TracedInt.__new__(TracedInt)
    else:
        return value
    out._plain, out._fn, out._guards = value, fn, guards
    return out


def plain(value: Any) -> Any:
    """A traced number's value as a plain float or int; anything else as it is."""
    return value._plain if isinstance(value, Traced) else value


def fn_of(value: Any) -> NumberFn:
    """How to compute `value` from the step's numbers (a constant for a plain number)."""
    if isinstance(value, Traced):
        return value._fn

    def constant(numbers: Sequence[Any]) -> Any:
        return value
    return constant


def rounded(value: Any, convert: Callable[[Any], Any]) -> Any:
    """convert(value), a rounding (a float's to np.float32, as a kernel argument of that type
    would take it; round() to an int), that keeps a traced number traced (np.float32 or
    round of it would read its value, a guard or a decoy)."""
    def round_plain(v: Any) -> Any:
        with np.errstate(over="ignore"):  # beyond the type's range: +-inf, as numpy rounds
            return convert(v)
    if isinstance(value, Traced):
        fn = value._fn

        def rounded_fn(numbers: Sequence[Any]) -> Any:
            return round_plain(fn(numbers))
        return traced(round_plain(value._plain), rounded_fn, value._guards)
    return round_plain(value)


def as_float(value: Any) -> float:
    """float(value) that keeps a traced number traced (float() would make it a guard)."""
    if not isinstance(value, Traced):
        return float(value)  # the op path's common case, without rounded's error state
    # A traced numpy float (np.float32) becomes a Python float, as float() makes it eagerly.
    return cast(float, value if value._plain.__class__ is float else rounded(value, float))


def as_index(value: Any) -> int:
    """operator.index(value) that keeps a traced int traced (index() of it gives a plain int,
    a guard)."""
    if isinstance(value, TracedInt):
        # A traced numpy integer becomes a Python int, as index() makes it eagerly.
        return cast(int, value if value._plain.__class__ is int
                    else rounded(value, operator.index))
    return operator.index(value)


def is_integer(value: object) -> TypeGuard[int]:
    """Whether `value` is an integer argument: a Python or numpy integer, or a traced int
    (bools are not integers here)."""
    return (isinstance(value, int | np.integer | TracedInt)
            and not isinstance(value, bool | np.bool_))


def integer(value: object) -> int | None:
    """An integer argument (`is_integer`) as a plain int, a traced one's value a guard; None
    for anything else."""
    return operator.index(value) if is_integer(value) else None


def _operand(other: object) -> NumberFn | None:
    """How to compute an arithmetic operand (None: not a number, NotImplemented)."""
    if isinstance(other, int | float | np.floating | np.integer | Traced):
        return fn_of(other)
    return None


def _binary(op: Operator) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The method `x op other` and its reflection `other op x` (the same with op's operands
    swapped)."""
    def method(op: Operator) -> Callable[..., Any]:
        def apply(self: Traced, other: object) -> Any:
            g = _operand(other)
            if g is None:
                return NotImplemented
            f = self._fn

            def result(n: Sequence[Any]) -> Any:
                return op(f(n), g(n))
            return traced(op(self._plain, plain(other)), result, self._guards)
        return apply

    return method(op), method(lambda a, b: op(b, a))


def _unary(op: Callable[[Any], Any]) -> Callable[..., Any]:
    def method(self: Any) -> Any:
        fn: NumberFn = self._fn

        def result(n: Sequence[Any]) -> Any:
            return op(fn(n))
        return traced(op(self._plain), result, self._guards)
    return method


def _compare(op: Operator) -> Callable[..., Any]:
    def method(self: Traced, other: object) -> Any:
        g = _operand(other)
        if g is None:
            return NotImplemented
        f = self._fn
        outcome = op(self._plain, plain(other))

        def again(n: Sequence[Any]) -> Any:
            return op(f(n), g(n))
        self._guards.note(again, outcome)
        return outcome
    return method


def _decided(convert: Callable[[Any], Any]) -> Callable[..., Any]:
    """A conversion that leaves the traced world: the value it gave becomes a guard."""
    def method(self: Any, *rest: Any) -> Any:
        fn = self._fn
        result = convert(self._plain, *rest)

        def again(n: Sequence[Any]) -> Any:
            return convert(fn(n), *rest)
        self._guards.note(again, result)
        return result
    return method


# The ufuncs of the operators traced numbers define (`Traced.__array_ufunc__`).
_DEFERRED = {"add": "add", "subtract": "sub", "multiply": "mul", "true_divide": "truediv",
             "divide": "truediv", "floor_divide": "floordiv", "remainder": "mod", "power": "pow"}

# numpy's comparison ufuncs: the traced number's method, and its mirror for a traced right side.
_UFUNC_COMPARISONS = {"greater": ("gt", "lt"), "greater_equal": ("ge", "le"),
                      "less": ("lt", "gt"), "less_equal": ("le", "ge"), "equal": ("eq", "eq"),
                      "not_equal": ("ne", "ne")}

_ARITHMETIC: dict[str, Operator] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "mod": operator.mod,
    "truediv": lambda a, b: a / b, "floordiv": lambda a, b: a // b, "pow": lambda a, b: a ** b}
_BITWISE: dict[str, Operator] = {
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
    "lshift": lambda a, b: a << b, "rshift": lambda a, b: a >> b}
_COMPARISONS: dict[str, Operator] = {
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "eq": operator.eq, "ne": operator.ne}


def _methods(bitwise: bool) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    for name, op in (_ARITHMETIC | (_BITWISE if bitwise else {})).items():
        methods[f"__{name}__"], methods[f"__r{name}__"] = _binary(op)
    for name, op in _COMPARISONS.items():
        methods[f"__{name}__"] = _compare(op)
    for name, op in (("neg", operator.neg), ("pos", operator.pos), ("abs", abs)):
        methods[f"__{name}__"] = _unary(op)
    if bitwise:
        methods["__invert__"] = _unary(operator.invert)
    methods["__bool__"] = _decided(bool)
    methods["__float__"] = _decided(float)
    methods["__int__"] = _decided(int)
    methods["__index__"] = _decided(operator.index)
    methods["__round__"] = _decided(round)
    for name, convert in (("trunc", math.trunc), ("floor", math.floor), ("ceil", math.ceil)):
        methods[f"__{name}__"] = _decided(convert)
    methods["__hash__"] = _hash
    methods["__repr__"] = _repr
    methods["__str__"] = _repr
    methods["__format__"] = _format
    methods["__reduce__"] = _reduce
    return methods


def _hash(self: Traced) -> int:
    return hash(self._plain)


def _repr(self: Traced) -> str:
    return repr(self._plain)


def _format(self: Traced, spec: str) -> str:
    return format(self._plain, spec)


def _reduce(self: Traced) -> tuple[Any, tuple[Any]]:
    """Pickled as its plain value (a recording's guards do not travel)."""
    value: Any = self._plain
    kind: Any = value.__class__
    return kind, (value,)


class TracedFloat(Traced, float):
    """A float argument of a jitted step (see the module docstring)."""


class TracedInt(Traced):
    """An int argument of a jitted step (see the module docstring): not an int subclass (see
    `traced`), but an integer to `operator.index`, range(), indexing and numpy."""

    if TYPE_CHECKING:  # set below with the other methods (`_methods`): conversions, guards
        def __int__(self) -> int: ...
        def __float__(self) -> float: ...
        def __index__(self) -> int: ...

    def __divmod__(self, other: Any) -> Any:
        return self // other, self % other

    def __rdivmod__(self, other: Any) -> Any:
        return other // self, other % self

    # The rest of int's surface: itself where int gives itself back, else its value (a guard).
    @property
    def real(self) -> Any:
        return self

    @property
    def numerator(self) -> Any:
        return self

    @property
    def imag(self) -> int:
        return 0

    @property
    def denominator(self) -> int:
        return 1

    def conjugate(self) -> Any:
        return self

    def bit_length(self) -> int:
        return int(self).bit_length()

    def bit_count(self) -> int:
        return int(self).bit_count()

    def to_bytes(self, *args: Any, **kwargs: Any) -> bytes:
        return int(self).to_bytes(*args, **kwargs)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        """numpy's arrays of it (np.array([step, 1]), np.full(2, step)): of its value."""
        return np.asarray(int(self), dtype)


for _name, _method in _methods(False).items():
    setattr(TracedFloat, _name, _method)
_int_methods = _methods(True)
_traced_pow = _int_methods["__pow__"]


def _pow(self: TracedInt, other: Any, modulo: Any = None) -> Any:
    """x ** y traced; pow(x, y, m) of the values (a guard)."""
    if modulo is None:
        return _traced_pow(self, other)
    return pow(int(self), int(other), int(modulo))


_int_methods["__pow__"] = _pow
for _name, _method in _int_methods.items():
    setattr(TracedInt, _name, _method)
numbers.Integral.register(TracedInt)
numbers.Real.register(TracedFloat)
