"""Kernel families: elementwise expressions, strided copies, fills and casts.

Each family is one OpenCL program per dtype holding every kernel of the family, built on first
use and kept by the device (`Device.kernel`). Elementwise ops register a C expression here; the
family's source is generated from the registry, with one kernel per op and per pattern of
buffer/scalar operands, so a Python scalar travels as a kernel argument and never as a buffer.
Reductions and matmul keep their hand-written kernels beside their ops.
"""

from __future__ import annotations

import itertools
import math
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyopencl as cl

from ._device import LOCAL, USER_SOURCE_OPTIONS, Device, fp64_pragma, register_family
from ._tensor import C_TYPES, AnyTensor, DType, Shape, dtype_name, empty, size_of, upload

ARG_NAMES = ("a", "b", "c")

# tapegrad's own expression families: "elementwise" joins the core program (built at the first
# op); RARE_FAMILY, transcendentals few programs use (sin, erf, softplus...), is a program of
# its own per dtype, built when one is first used, so that it adds nothing to a cold start.
# Every other family is a custom op's, of users' C.
RARE_FAMILY = "elementwise_more"
OWN_FAMILIES = ("elementwise", RARE_FAMILY)

# Expressions are compiled without contracting a * b + c into one fused multiply-add, in their
# own kernels and inlined in `_fusion`'s alike: a compiler may fuse across the statements of a
# generated kernel (NVIDIA's does) where op-by-op kernels round each op, and a value must be
# the same bits either way. (Families after them in the core program, matmul's, contract.)
CONTRACT_OFF = "#pragma OPENCL FP_CONTRACT OFF\n"
CONTRACT_ON = "#pragma OPENCL FP_CONTRACT ON\n"

def _no_pending_gather(src: AnyTensor, out: AnyTensor, sizes: Sequence[int],
                       steps: Sequence[int], base: int) -> bool:
    return False


# A gather of a pending tensor evaluated inside its fused kernel: `_fusion.gather`, installed
# by `_opencl` when the package loads (fusion is built on these kernels, so this module
# cannot import it).
_gather_pending: Callable[[AnyTensor, AnyTensor, Sequence[int], Sequence[int], int], bool] = (
    _no_pending_gather)


def set_pending_gather(
        gather: Callable[[AnyTensor, AnyTensor, Sequence[int], Sequence[int], int], bool]
) -> None:
    global _gather_pending
    _gather_pending = gather


# Work-items per 1-D launch, rounded up to the local size: the kernels test `i < n`.
def launch_size(n: int, local: int = LOCAL) -> tuple[int]:
    """A 1-D launch's global size for n work-items in groups of `local`."""
    return (max(local, -(-n // local) * local),)


# Dense 1-D kernels give each work-item DENSE_CHUNK contiguous elements: on PoCL that runs at
# about 15 GB/s against 7 for one element per work-item (the loop vectorizes; fewer work-items).
DENSE_CHUNK = 256
DENSE_PRELUDE = (
    f"#define TG_EACH(n) for (long i = get_global_id(0) * {DENSE_CHUNK}, "
    f"i_end_ = min((long)(n), i + {DENSE_CHUNK}); i < i_end_; ++i)\n")


def dense_size(n: int) -> tuple[int]:
    """The launch size of a TG_EACH kernel over n elements."""
    return launch_size(-(-n // DENSE_CHUNK))


@dataclass(frozen=True)
class Expression:
    """An elementwise kernel body: `expr` over operands (a, b, c unless named) of type T.

    Expressions of one `family` share a program per dtype; custom ops get a family of their own
    so registering one never invalidates a program already built.
    """

    name: str
    arity: int
    expr: str
    family: str = "elementwise"
    names: tuple[str, ...] = ARG_NAMES
    helpers: str = ""
    # Derived from `expr`: it calls a transcendental (`_HEAVY`), and so it is computed when
    # made, never pending; only the other core expressions fuse (`_fusion.elementwise`).
    heavy: bool = field(init=False)
    fuses: bool = field(init=False)

    def __post_init__(self) -> None:
        heavy = bool(_HEAVY.search(self.expr))
        object.__setattr__(self, "heavy", heavy)
        object.__setattr__(self, "fuses", self.family == "elementwise" and not heavy)


_EXPRESSIONS: dict[str, Expression] = {}
# PoCL calls its library for these one element at a time (on one core of this CPU ~5 ns an
# element for exp, 13 for tanh, 15 for log, 27 for erf, where an add or a multiply vectorizes
# at ~0.15 ns): an expression calling one is `heavy`.
_HEAVY = re.compile(r"\b(exp\w*|log\w*|pow\w*|a?(sin|cos|tan)h?|erfc?|[lt]gamma|tg_sigmoid|"
                    r"tg_silu_slope|tg_tanh|tg_erf|tg_pow|tg_sin|tg_cos|cbrt|hypot|atan2)\s*\(")

# Helpers the expressions may call, written once over $ty and made for T (every program of
# expressions) and for T8 (the float kernels of heavy expressions, `_vector_kernel`): $uniform
# gives tg_pow its exponent e_ as one number (for T8, where the eight lanes share it), so a
# uniform exponent takes one branch for eight lanes.
# PoCL's float tanh stops at 0.99999994 for |x| >= 9.0109138, where the correctly rounded value
# (PyTorch's) is 1: gelu's tanh form multiplies that ulp by x (x^3 in its gradient), -2.98e-6
# at x = -100 where PyTorch gives -0, and tanh's gradient 1 - y*y stayed 1.2e-7 (an inf of
# a large cotangent). Its double tanh reaches 1.
# float erf (gelu's) is a polynomial: erf(x) = x + x * P(x^2) below 1, 1 - exp(Q(|x|)) above
# (Q fits log erfc), within 1.4 ulp (tests/test_ops_elem.py); PoCL's library erf was a call
# per element at ~5 ns. Doubles keep the library's.
# pow with the exponents people write is spelled as multiplies and square roots: PoCL's pow is
# a library call per element, two orders of magnitude slower than a multiply (PyTorch
# special-cases these exponents too). C's pow exactly for 2, 1, 0 and
# -1, within an ulp for 3, -2 and -0.5 (-0 and -inf written out); 0.5 is sqrt, as PyTorch's
# and numpy's x ** 0.5 (-0 at -0, NaN at -inf, where C's pow gives +0 and +inf).
_HELPERS = string.Template("""
// One exp, of -|x|: a vector ternary computes both sides, so exp(-x) on one side and exp(x)
// on the other were two library calls per lane (the same values: exp(-|x|) is each side's).
TG_OVL $ty tg_sigmoid($ty x) {
  const $ty e = exp(x < ($ty)0 ? x : -x);
  return x >= ($ty)0 ? ($ty)1 / (($ty)1 + e) : e / (($ty)1 + e);
}
// silu's slope s * (1 + x * (1 - s)), s = sigmoid(x) computed once (an expression naming
// tg_sigmoid twice called it twice: a library exp each).
TG_OVL $ty tg_silu_slope($ty x) {
  const $ty s = tg_sigmoid(x);
  return s * (x * (($ty)1 - s) + ($ty)1);
}
// PoCL's sqrt is a library call per element; clang's builtin is the instruction (correctly
// rounded, as IEEE and OpenCL's sqrt are). Lane by lane on vectors, which LLVM joins into one
// instruction.
TG_OVL $ty tg_sqrt($ty x) {
  $sqrt
}
TG_OVL $ty tg_tanh($ty x) {
#ifdef __clang__  // another compiler (a GPU driver's) would warn of the pragma: plain steps there
  #pragma clang fp contract(on)
#endif
  if (sizeof(x) != 4 * $lanes) return tanh(x);  // doubles: the library's
  const $ty a = x < ($ty)0 ? -x : x, z = x * x;
  const $ty e = ($ty)1 - ($ty)2 / (exp(a + a) + ($ty)1);
  const $ty p = ((((($ty)-5.70498872745e-3f * z + ($ty)2.06390887954e-2f) * z
                   + ($ty)-5.37397155531e-2f) * z + ($ty)1.33314422036e-1f) * z
                 + ($ty)-3.33332819422e-1f) * z;
  const $ty t = a < ($ty)0.625f ? (x == ($ty)0 ? x : p * x + x) : (x < ($ty)0 ? -e : e);
  return x >= ($ty)9.0109138f ? ($ty)1 : (x <= ($ty)-9.0109138f ? ($ty)-1 : t);
}
TG_OVL $ty tg_erf($ty x) {
  // Contracted (an FMA per step) and by Estrin's scheme (pairs, then powers of u and s): the
  // polynomials' chains of dependent steps, not the instruction count, bound these kernels.
#ifdef __clang__  // another compiler (a GPU driver's) would warn of the pragma: plain steps there
  #pragma clang fp contract(on)
#endif
  if (sizeof(x) != 4 * $lanes) return erf(x);  // doubles: the library's
  // Ternaries, not fabs, fmin and copysign: PoCL's are calls on vectors. The exp first, so
  // that little is live across its call.
  const $ty t = x < ($ty)0 ? -x : x, u = t < ($ty)4 ? t : ($ty)4, u2 = u * u, u4 = u2 * u2;
  const $ty q = ((($ty)5.471347322e-07f * u4
                  + (($ty)-2.959104131e-05f * u + ($ty)4.902814981e-04f) * u2
                  + (($ty)-4.374294076e-03f * u + ($ty)2.556892112e-02f)) * u4
                 + (($ty)-1.088996604e-01f * u + ($ty)-6.328263283e-01f) * u2
                 + (($ty)-1.129759073e+00f * u + ($ty)2.236873697e-04f));
  const $ty e = ($ty)1 - exp(q), s = x * x, s2 = s * s;
  const $ty p = ((($ty)7.890776760e-05f * s2
                  + (($ty)-8.020969108e-04f * s + ($ty)5.189503543e-03f)) * s2
                 + (($ty)-2.685440145e-02f * s + ($ty)1.128359810e-01f)) * s2
                + (($ty)-3.761262596e-01f * s + ($ty)1.283791661e-01f);
  return t >= ($ty)1 ? (x < ($ty)0 ? -e : e) : p * x + x;
}
// sin (cosine 0) and cos (1) for |x| <= 8192: j = round(x 2/pi) by the magic constant, r = x -
// j pi/2 in four parts (Cody-Waite, each step an FMA), Cephes' polynomials on
// [-pi/4, pi/4], the quadrant from q = j - 4 round(j / 4) in -2..2. Float arithmetic only, so
// the double forms compile (they call the library first). PoCL's sin and cos are library calls.
TG_OVL $ty tg_trig_($ty x, const int cosine) {
#ifdef __clang__  // another compiler (a GPU driver's) would warn of the pragma: plain steps there
  #pragma clang fp contract(on)
#endif
  const $ty j = (x * ($ty)0.636619772367581343f + ($ty)12582912.0f) - ($ty)12582912.0f;
  const $ty r = (((x - j * ($ty)1.5703125f) - j * ($ty)4.837512969970703125e-4f)
                 - j * ($ty)7.549790126404332e-8f) - j * ($ty)-1.7151245100058819e-15f;
  const $ty z = r * r;
  // x itself at +-0: the reduction and the polynomial would turn -0 into +0
  const $ty s = x == ($ty)0 ? x : (((($ty)-1.9515295891e-4f * z + ($ty)8.3321608736e-3f) * z
                                    + ($ty)-1.6666654611e-1f) * z) * r + r;
  const $ty c = ((($ty)2.443315711809948e-5f * z + ($ty)-1.388731625493765e-3f) * z
                 + ($ty)4.166664568298827e-2f) * (z * z) + (($ty)1 - ($ty)0.5f * z);
  const $ty k = j + ($ty)cosine;
  const $ty q = k - ($ty)4 * ((k * ($ty)0.25f + ($ty)12582912.0f) - ($ty)12582912.0f);
  const $ty v = q * q == ($ty)1 ? c : s;  // quadrants 1 and -1 (3): the cosine's polynomial
  return q < ($ty)-0.5f || q > ($ty)1.5f ? -v : v;  // quadrants -1, 2 and -2: negated
}
// Past |x| = 8192 (and at +-inf) the library's, for the lanes that far: called once if any is.
TG_OVL $ty tg_sin($ty x) {
  if (sizeof(x) != 4 * $lanes) return sin(x);  // doubles: the library's
  const $mask far_ = x > ($ty)8192.0f || x < ($ty)-8192.0f;
  return $any ? (far_ ? sin(x) : tg_trig_(x, 0)) : tg_trig_(x, 0);
}
TG_OVL $ty tg_cos($ty x) {
  if (sizeof(x) != 4 * $lanes) return cos(x);
  const $mask far_ = x > ($ty)8192.0f || x < ($ty)-8192.0f;
  return $any ? (far_ ? cos(x) : tg_trig_(x, 1)) : tg_trig_(x, 1);
}
TG_OVL $ty tg_pow($ty a, $ty b) {
  $uniform
  if (e_ == (T)2) return a * a;
  if (e_ == (T)1) return a;
  if (e_ == (T)0) return ($ty)1;
  if (e_ == (T)0.5) return tg_sqrt(a);
  if (e_ == (T)3) return a * a * a;
  if (e_ == (T)-1) return ($ty)1 / a;
  if (e_ == (T)-2) return ($ty)1 / (a * a);
  if (e_ == (T)-0.5)
    return a == ($ty)(-INFINITY) ? ($ty)0 : ($ty)1 / (tg_sqrt(a) + ($ty)0);
  return pow(a, b);
}
""")
# $mask is a comparison's type and $any whether any lane of it holds (the mask itself for T).
_PRELUDE = "#define TG_OVL __attribute__((overloadable))\n" + _HELPERS.substitute(
    ty="T", lanes=1, uniform="const T e_ = b;", mask="int", any="far_",
    sqrt="return sizeof(x) == 4 ? __builtin_sqrtf(x) : __builtin_sqrt(x);")


VEC8 = """
#define TG_LOAD8(p) ((T8)((p)[0], (p)[1], (p)[2], (p)[3], (p)[4], (p)[5], (p)[6], (p)[7]))
#define TG_STORE8(v, p) do { (p)[0] = (v).s0; (p)[1] = (v).s1; (p)[2] = (v).s2; \\
  (p)[3] = (v).s3; (p)[4] = (v).s4; (p)[5] = (v).s5; (p)[6] = (v).s6; (p)[7] = (v).s7; \\
  } while (0)
"""

# Sixteen adjacent elements (T16) as two halves of eight (after VEC8). Several families'
# sources may join one program (the elementwise ops' sixteen lanes, the matrix products' wide
# tiles): T16 is declared once (a second typedef would warn).
VEC16 = """#ifndef TG_VEC16
#define TG_VEC16
typedef T __attribute__((ext_vector_type(16))) T16;
#define TG_LOAD16(p) ((T16)(TG_LOAD8(p), TG_LOAD8((p) + 8)))
#define TG_STORE16(v, p) do { TG_STORE8((v).lo, p); TG_STORE8((v).hi, (p) + 8); } while (0)
#endif
"""


def _vector_helpers(ty: str, lanes: int) -> str:
    """The helpers over the vector type `ty` of `lanes` lanes. Lanes of one exponent take the
    exponent's case once (or the vector pow); of several, each lane the scalar tg_pow. One
    all(): each is a library call, which testing every case with its own all() paid once per
    case before the one that matched."""
    each = [f"s{j:x}" for j in range(lanes)]
    return _HELPERS.substitute(
        ty=ty, lanes=lanes, mask=f"int{lanes}",
        any="(" + " | ".join(f"far_.{s}" for s in each) + ")",
        sqrt=f"return ({ty})(" + ", ".join(f"tg_sqrt(x.{s})" for s in each) + ");",
        uniform=f"if (!all(b == ({ty})(b.s0)))\n    return ({ty})("
        + ", ".join(f"tg_pow(a.{s}, b.{s})" for s in each) + ");\n  const T e_ = b.s0;")


_PRELUDE8 = _vector_helpers("T8", 8)

# Sixteen lanes (T16) where the program is built with TG_WIDE (a CPU whose vectors hold 16
# floats): the helpers again over T16 (VEC16's loads and stores).
_WIDE = "#ifdef TG_WIDE\n" + VEC16 + _vector_helpers("T16", 16) + "#endif\n"

# Eight adjacent elements as a vector and back, from scalar loads and stores that LLVM merges
# (PoCL's vload8/vstore8 are out-of-line calls: see `_ops/linalg.py`). p is evaluated per lane,
# so it may be any pointer expression, whatever T means where the macro is used.


def expression_names() -> set[str]:
    return set(_EXPRESSIONS)


def register_expression(
    name: str, arity: int, expr: str, family: str = "elementwise",
    names: tuple[str, ...] = ARG_NAMES, helpers: str = "",
) -> Expression:
    if name in _EXPRESSIONS:
        raise ValueError(f"elementwise expression {name!r} is registered twice")
    found = Expression(name, arity, expr, family, names, helpers)
    _EXPRESSIONS[name] = found
    return found


def _pattern(is_buffer: Sequence[bool]) -> str:
    return "".join("b" if flag else "s" for flag in is_buffer)


def expression(name: str) -> Expression:
    """The registered expression of that name (an elementwise primitive's is its name)."""
    return _EXPRESSIONS[name]


def forget_expressions(names: Sequence[str]) -> None:
    """Unregister expressions (a custom op whose kernels did not build)."""
    for name in names:
        _EXPRESSIONS.pop(name, None)


# Sums are compensated: blocks of terms (TG_BLOCK along rows, RD_BLOCK down columns, eight
# columns to a vector) are summed plainly and the block sums added with Kahan's compensation.
# Each running sum s carries c, the low-order part its last addition lost, taken back from
# the next. A float32 sum of n terms then errs like a sum of one block's terms, a few units in
# the last place, where a plain one errs by up to n of them: sum over axis 0 of 16000 rows
# 2e-6 relative, the mean of 4001 values near 1e4 3e-5 (and var, through that mean, by 100%),
# against PyTorch's ~1e-7. Per term a row sum is still one add (Kahan on every term cost ~13%
# on the 16M benchmark row; blocked, within noise). `reduce` and `_fusion` (a pending sum) use
# this one helper, so both paths give the same bits. Once the sum is infinite (an infinite
# term, or an overflow) its compensation is 0: (t - s) - y would be inf - inf, a NaN where a
# plain sum, numpy's and PyTorch's, is +-inf. t - t is 0 exactly when t is finite (a
# comparison, where isfinite may be a call into PoCL's library).
KAHAN = """
#define TG_KAHAN_V(V, s, c, v) { const V y_ = (v) - c, t_ = s + y_; \\
  c = t_ - t_ == (V)0 ? (t_ - s) - y_ : (V)0; s = t_; }
#define TG_KAHAN(s, c, v) TG_KAHAN_V(T, s, c, v)
#define TG_KAHAN8(s, c, v) TG_KAHAN_V(T8, s, c, v)
#define TG_BLOCK 128
// TG_ROW_SUM: `total` = the sum over a contiguous row of C elements of TERM8 (T8, at the
// macro's own index c, for the row's whole groups of 8) and TERM1 (T, the rest), 8 lanes at a
// time in blocks of TG_BLOCK added plainly, the blocks with Kahan's compensation. C and total
// must not be named c.
#define TG_ROW_SUM(total, C, TERM8, TERM1) { \\
  T8 s8_ = (T8)0, k8_ = (T8)0; const long v_ = (C) / 8 * 8; long c = 0; \\
  while (c < v_) { const long e_ = min(v_, c + (long)TG_BLOCK); T8 b_ = (T8)0; \\
    for (; c < e_; c += 8) b_ += (TERM8); TG_KAHAN8(s8_, k8_, b_) } \\
  T a_ = ((s8_.s0 + s8_.s1) + (s8_.s2 + s8_.s3)) + ((s8_.s4 + s8_.s5) + (s8_.s6 + s8_.s7)); \\
  T l_ = ((k8_.s0 + k8_.s1) + (k8_.s2 + k8_.s3)) + ((k8_.s4 + k8_.s5) + (k8_.s6 + k8_.s7)); \\
  for (; c < (C); ++c) TG_KAHAN(a_, l_, (TERM1)) \\
  total = a_ - l_; }
"""


def row_sum(term: Callable[[str], str]) -> str:
    """Statements summing a row's elements k0 <= k < k1 into `total_` (after KAHAN, with k0
    and k1 declared): `term(i)` is the C expression of element i. Blocks of TG_BLOCK go eight
    to a partial sum (element j of each group of eight to the j-th) and each block's sums
    into eight compensated running sums; what is left after the blocks as one shorter block,
    then the last few elements one by one. `_reduction`'s reduce_sum_rows and the fused
    kernels' row sums both take it, so a pending sum and a computed one have the same bits."""
    zeros = "T " + ", ".join(f"b{j}_ = 0" for j in range(8)) + ";"
    kahans = " ".join(f"TG_KAHAN(s{j}_, c{j}_, b{j}_)" for j in range(8))

    def group(at: str) -> str:
        return " ".join(f"b{j}_ += {term(f'{at} + {j}')};" for j in range(8))

    return (
        "  T " + ", ".join(f"s{j}_ = 0" for j in range(8)) + ";\n"
        "  T " + ", ".join(f"c{j}_ = 0" for j in range(8)) + ";\n"
        "  long k = k0;\n"
        f"  for (; k + TG_BLOCK <= k1; k += TG_BLOCK) {{ {zeros}\n"
        f"    for (long u_ = k; u_ < k + TG_BLOCK; u_ += 8) {{ {group('u_')} }}\n"
        f"    {kahans} }}\n"
        f"  if (k + 8 <= k1) {{ {zeros}\n"
        f"    for (; k + 8 <= k1; k += 8) {{ {group('k')} }}\n"
        f"    {kahans} }}\n"
        "  T acc_ = ((s0_ + s1_) + (s2_ + s3_)) + ((s4_ + s5_) + (s6_ + s7_));\n"
        "  T lost_ = ((c0_ + c1_) + (c2_ + c3_)) + ((c4_ + c5_) + (c6_ + c7_));\n"
        f"  for (; k < k1; ++k) TG_KAHAN(acc_, lost_, {term('k')})\n"
        "  const T total_ = acc_ - lost_;\n")

# How the lines that hold an expression in `_elementwise_source`'s kernels begin: the scalar
# tail's and the 8-lane loop's (a build error is reported at the first).
EXPRESSION_LINES = ("    res_[i] = (", "    const T r_ = (")


def _vectorized(found: Expression, dtype: DType) -> bool:
    """Whether `found`'s kernels run eight lanes at a time: PoCL's library computes exp, log,
    tanh, erf... on a float8 in one call, 7-14x faster than lane by lane (exp of 4M floats
    10.9 -> 1.0 ms; erf 54 -> 7.3), within an ulp of the scalar call. Only for float32: calls
    on double8 in the core program left PoCL's build without kernels (see `_ops/losses.py`).
    A custom op's expression only where it means the same on eight lanes (`_lane_safe`)."""
    return (found.heavy and dtype == np.float32
            and (found.family in OWN_FAMILIES or _lane_safe(found)))


# Library functions whose float8 forms compute each lane as the float form would.
_LANE_CALLS = frozenset((
    "exp", "exp2", "exp10", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "cbrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "asinh",
    "acosh", "atanh", "erf", "erfc", "lgamma", "tgamma", "pow", "powr", "hypot", "fabs", "fmin",
    "fmax", "floor", "ceil", "round", "trunc", "fma", "mad", "copysign", "min", "max", "clamp",
    "mix"))
# On a vector a comparison is -1 where true (1 on a scalar), so `g * (a > 0)` would flip its
# sign; a ternary, logic, bits and % read differently too.
_LANE_UNSAFE = re.compile(r"[<>=!&|?^~%]")
_NUMBER = re.compile(r"(?<![\w.])(?:\d[\w.]*|\.\d[\w.]*)")
_WORD = re.compile(r"[A-Za-z_]\w*")


def _lane_safe(found: Expression) -> bool:
    """Whether a custom op's expression means on eight lanes what it means on one: arithmetic
    over its operands, numbers, `(T)` casts and `_LANE_CALLS` only, with no helpers of its own
    (written for T, they would not take a float8)."""
    if found.helpers or _LANE_UNSAFE.search(found.expr):
        return False
    words = _WORD.findall(_NUMBER.sub(" ", found.expr))
    return all(w in found.names or w == "T" or w in _LANE_CALLS or w.startswith("M_")
               for w in words)


# PoCL's float16 log and log10 give a negative input's NaN another payload than their float8
# forms (the library's other functions: the same bits on 16 lanes as on 8, inf, NaN and -0
# among the inputs): logarithms keep 8, so that a piece read in place (8 lanes where its rows
# are not a multiple of 16) and its copy (16) agree bit for bit.
_EIGHT_ONLY = re.compile(r"\blog\w*\s*\(")


def _lanes(found: Expression, head: str, loads8: str, loads1: str, setup: str = "",
           step8: str = "", step1: str = "", vector: bool = True, wide_if: str = "1") -> str:
    """A kernel `head` computing `found` over each work-item's chunk: eight lanes at a time
    (`vector`), then lane by lane over the chunk's last n % 8, the operands read by `loads8`
    and `loads1` (after `setup`; `step8`, `step1` advance them). Inside the eight-lane block T
    is T8, so the expression's casts and helpers take their vector forms. Where the program is
    built with TG_WIDE (`Device.wide_lanes`) sixteen lanes at a time come first, while
    `wide_if` holds: the same code over T16, `loads8` and `step8` made sixteen wide (not for
    logarithms, `_EIGHT_ONLY`). Every heavy kernel is made here, so all read their lanes alike
    and give the same bits."""
    wide = ("#ifdef TG_WIDE\n"
            f"  if ({wide_if}) for (; i + 16 <= i1_; i += 16) {{\n"
            "    typedef T16 T;\n"
            f"    {loads8.replace('TG_LOAD8(', 'TG_LOAD16(')}\n"
            f"    const T r_ = ({found.expr});\n    TG_STORE16(r_, res_ + i);\n"
            f"{step8.replace('+= 8', '+= 16')}  }}\n"
            "#endif\n" if vector and not _EIGHT_ONLY.search(found.expr) else "")
    lanes = wide + (
        f"  for (; i + 8 <= i1_; i += 8) {{\n"
        "    typedef T8 T;  // here the expression's casts and helpers take their "
        "float8 forms\n"
        f"    {loads8}\n"
        f"    const T r_ = ({found.expr});\n    TG_STORE8(r_, res_ + i);\n{step8}  }}\n"
        if vector else "")
    return (
        f"{head} {{\n"
        f"  const long i0_ = get_global_id(0) * {DENSE_CHUNK};\n"
        f"  const long i1_ = min((long)n, i0_ + {DENSE_CHUNK});\n"
        f"  long i = i0_;\n{setup}{lanes}"
        f"  for (; i < i1_; ++i) {{\n    {loads1}\n    res_[i] = ({found.expr});\n{step1}  }}\n"
        "}\n")


def _vector_kernel(found: Expression, flags: Sequence[bool]) -> str:
    """The kernel of a heavy expression (`_lanes`) over buffers and scalars (the same lanes on
    every path: heavy values are computed only by these kernels, `_fusion.elementwise`)."""
    params = ["__global T* res_"]
    vec: list[str] = []
    one: list[str] = []
    for name, is_buf in zip(found.names, flags, strict=False):
        params.append(f"__global const T* {name}_" if is_buf else f"const T {name}_s")
        vec.append(f"const T {name} = " + (f"TG_LOAD8({name}_ + i);" if is_buf
                                           else f"(T)({name}_s);"))
        one.append(f"const T {name} = " + (f"{name}_[i];" if is_buf else f"{name}_s;"))
    params.append("const long n")
    return _lanes(found, f"__kernel void {found.name}__{_pattern(flags)}({', '.join(params)})",
                  " ".join(vec), " ".join(one))


def _view_kernel(found: Expression, vector: bool) -> str:
    """`found` (one operand) over a block view of a buffer: element i of the operand is
    src[o + c], o the start of element i's row among rows of w placed `row` apart from `at`,
    c its column (a split's piece, see `_fusion.pending_view`), walked along each work-item's
    chunk, so a heavy op over a piece reads it in place. The lanes are `_vector_kernel`'s
    (`_lanes`; with w a multiple of 8, eight consecutive elements lie in one row, sixteen
    with w a multiple of 16), so the values are the same bits."""
    name = found.names[0]
    head = (f"__kernel void {found.name}__v(__global T* res_, __global const T* src_, "
            "const long w, const long row, const long at, const long n)")
    return _lanes(found, head, f"const T {name} = TG_LOAD8(src_ + o_ + c_);",
                  f"const T {name} = src_[o_ + c_];",
                  setup="  long o_ = (i / w) * row + at, c_ = i % w;\n",
                  step8="    c_ += 8; if (c_ == w) { c_ = 0; o_ += row; }\n",
                  step1="    if (++c_ == w) { c_ = 0; o_ += row; }\n", vector=vector,
                  wide_if="w % 16 == 0")


def _program_head(dtype: DType, members: Sequence[Expression]) -> list[str]:
    """The start of a program of `members`' kernels: types, preludes, their helpers (each once:
    a custom op's forward and VJPs share its helpers)."""
    t = C_TYPES[dtype]
    vector = any(_vectorized(e, dtype) for e in members)
    return [fp64_pragma(dtype), f"typedef {t} T;\n", f"typedef {t}8 T8;\n" if vector else "",
            CONTRACT_OFF, DENSE_PRELUDE, _PRELUDE, VEC8 + _PRELUDE8 + _WIDE if vector else "",
            *dict.fromkeys(e.helpers for e in members)]


def _elementwise_source(dtype: DType, family: str) -> str:
    members = [e for e in _EXPRESSIONS.values() if e.family == family]
    parts = _program_head(dtype, members)
    for found in members:
        for flags in itertools.product((True, False), repeat=found.arity):
            if not any(flags):
                continue
            if _vectorized(found, dtype):
                parts.append(_vector_kernel(found, flags))
                continue
            params = ["__global T* res_"]
            loads: list[str] = []
            for name, is_buf in zip(found.names, flags, strict=False):
                if is_buf:
                    params.append(f"__global const T* {name}_")
                    loads.append(f"const T {name} = {name}_[i];")
                else:
                    params.append(f"const T {name}")
            params.append("const long n")
            parts.append(
                f"__kernel void {found.name}__{_pattern(flags)}({', '.join(params)}) {{\n"
                f"  TG_EACH(n) {{\n    {' '.join(loads)}\n"
                f"{EXPRESSION_LINES[0]}{found.expr});\n  }}\n}}\n"
            )
    return "".join([*parts, CONTRACT_ON])


def source_lines(dtype: DType, family: str) -> list[str]:
    """The lines of a family's program (a build log's line numbers count from 1)."""
    return _elementwise_source(dtype, family).split("\n")


def run_expression(found: Expression, args: Sequence[AnyTensor | float], out: AnyTensor) -> None:
    """Write a registered expression over equal-shape tensors and scalar operands into `out`,
    with the prebuilt kernel of the expression's program: one kernel per op, no fusion."""
    device = out.device
    kernel = expression_kernel(found, tuple(isinstance(arg, AnyTensor) for arg in args),
                               out.dtype, device)
    n = out.size
    if n == 0:
        return
    device.launch(kernel, dense_size(n), (LOCAL,), out.buffer,
                  *[a.buffer if isinstance(a, AnyTensor) else a for a in args], n)


def _has_view_kernel(found: Expression) -> bool:
    """Whether `found` has a `_view_kernel`: a heavy one-operand expression of tapegrad's own."""
    return found.heavy and found.arity == 1 and found.family in OWN_FAMILIES


def _view_source(dtype: DType) -> str:
    """The `_view_kernel`s of every heavy one-operand expression of tapegrad's own: a program
    of their own, built when a model first needs one (an RNN's gates), so the core program
    and every cold start do not carry them."""
    members = [e for e in _EXPRESSIONS.values() if _has_view_kernel(e)]
    parts = _program_head(dtype, members)
    parts += [_view_kernel(e, _vectorized(e, dtype)) for e in members]
    return "".join([*parts, CONTRACT_ON])


def run_over_view(found: Expression, src: AnyTensor, w: int, row: int, at: int,
                  out: AnyTensor) -> bool:
    """Write heavy one-operand `found` over a block view of `src` (see `_view_kernel`) into
    `out`; False where it has no such kernel (the caller copies the view first)."""
    if not _has_view_kernel(found) or (w % 8 and _vectorized(found, out.dtype)):
        return False
    device = out.device
    key = (found.name, "v", out.dtype)
    kernel = device.launch_cache.get(key)
    if kernel is None:
        kernel = device.kernel("heavy_view", str(out.dtype), f"{found.name}__v",
                               lambda: _view_source(out.dtype))
        device.launch_cache[key] = kernel
    device.launch(kernel, dense_size(out.size), (LOCAL,), out.buffer, src.buffer, w, row, at,
                  out.size)
    return True


def expression_kernel(found: Expression, flags: tuple[bool, ...], dtype: DType, device: Device
                      ) -> Any:
    """The kernel of `found` for operands that are buffers (True) or scalars, building its
    family's program on first use (a custom op's, of users' C, with `USER_SOURCE_OPTIONS`)."""
    key = (found.name, flags, dtype)
    kernel = device.launch_cache.get(key)
    if kernel is None:
        kernel = device.kernel(
            found.family, str(dtype), f"{found.name}__{_pattern(flags)}",
            lambda: _elementwise_source(dtype, found.family),
            options=USER_SOURCE_OPTIONS if found.family not in OWN_FAMILIES else (),
        )
        device.launch_cache[key] = kernel
    return kernel


def expression_prelude() -> str:
    """The helpers every expression may call (T must be defined first)."""
    return _PRELUDE


# --- strided copies: broadcast, transpose, slice, and writing a part of a larger output -----

MAX_DIMS = 8
# Copies over up to CORE_DIMS dims (after merging) are in the core program; those over more,
# rare, are a program of their own ("copy_wide"), built when first needed: they were a third of
# the core's source and ~0.4 s of its build, which every cold start paid.
CORE_DIMS = 4
# One kernel per element size of a dtype (bool; float32, int32; float64, int64), not per
# dtype: a copy moves bits.
_COPY_TYPES = {1: "uchar", 4: "uint", 8: "ulong"}


COPY_CHUNK = 256  # innermost elements per work-item


def _copy_source(rank: int = CORE_DIMS, fills: bool = True) -> str:
    """gather{rank}_{size}/scatter{rank}_{size}: strided copies over up to `rank` dims, and
    fills.

    A copy over fewer dims pads its shape with leading dims of size 1 (`_strided`), whose
    decoding the kernel skips: one kernel per rank cost a cold start ~0.2 s of program build
    (24 more kernels in the core). A work-item copies up to COPY_CHUNK elements of one
    innermost row: the outer index is decoded once per work-item, not per element, and a unit
    inner stride takes a plain contiguous loop the compiler vectorizes.
    """
    parts: list[str] = []
    shape_params = ", ".join(f"const long gs{i}, const long gt{i}" for i in range(rank))
    head = (f"const long rows, const long chunks, const long per, const long base, "
            f"const long dbase, {shape_params}")
    for size, t in _COPY_TYPES.items():
        for name, body_unit, body_step in (
            ("gather", "out[dense + j] = src[off + j];", "out[dense + j] = src[off + j * step];"),
            ("scatter", "out[off + j] = src[dense + j];", "out[off + j * step] = src[dense + j];"),
        ):
            # A broadcast along the innermost axis (a splat, a column over rows): one read.
            zero = (f"const {t} v_ = src[off]; for (long j = j0; j < j1; ++j) "
                    "out[dense + j] = v_;") if name == "gather" else ""
            parts.append(
                f"__kernel void {name}{rank}_{size}(__global {t}* restrict out, "
                f"__global const {t}* restrict src, "
                f"{head}) {{\n"
                f"{gather_loop(rank, body_unit, body_step, 'dbase + ', True, zero)}}}\n")
        if fills:
            parts.append(
                f"__kernel void fill{size}(__global {t}* out, const {t} value, const long n) {{\n"
                f"  TG_EACH(n) out[i] = value;\n}}\n")
            parts.append(  # see `embed_block`: per row of K * B, zeros, the block, zeros
                f"__kernel void embed{size}(__global {t}* out, __global const {t}* part, "
                "const long K, const long B, const long lo, const long w, const long n) {\n"
                f"  long i = get_global_id(0) * {DENSE_CHUNK};\n"
                f"  const long end = min(n, i + {DENSE_CHUNK}), row = K * B;\n"
                "  const long s0 = lo * B, s1 = (lo + w) * B;\n"
                "  while (i < end) {\n"
                "    const long a = i / row, r = i - a * row, stop = min(end, i + row - r);\n"
                f"    __global {t}* o = out + a * row;\n"
                f"    __global const {t}* src = part + a * (w * B) - s0;\n"
                "    const long jend = r + (stop - i);\n"
                "    long j = r;\n"
                f"    for (; j < min(jend, s0); ++j) o[j] = ({t})0;\n"
                "    for (; j < min(jend, s1); ++j) o[j] = src[j];\n"
                f"    for (; j < jend; ++j) o[j] = ({t})0;\n"
                "    i = stop;\n  }\n}\n")
    return DENSE_PRELUDE + "".join(parts)


def gather_loop(d: int, body_unit: str, body_step: str, dense_base: str = "",
                padded: bool = False, body_zero: str = "") -> str:
    """The body of a gather over `d` merged dims (sizes gs{i}, steps gt{i}; `rows`, `chunks`,
    `per`, `base` given): this work-item's runs j0 <= j < j1 of `per` consecutive innermost
    rows (or of one, in `chunks` pieces), each element read from src[off + j * step] and
    written to out[dense + j] by `body_unit` (step 1) or `body_step`. The outer index is decoded
    once per work-item (d - 1 divisions), then carried row to row: over short rows (a head
    transpose's 16 floats) the divisions of one row per work-item took most of the copy's time
    (`gather_shape`). `padded` skips the divisions once the rest of the index is 0 (the leading
    dims of size 1 of a padded shape). Shared by the copy kernels and the fused gathers of
    `_fusion`. `body_zero`, where given, is the whole loop for an innermost step of 0 (a
    broadcast along it: one read, then stores the compiler vectorizes)."""
    guard = "if (r) " if padded else ""
    index = " ".join(f"long k{i} = 0;" for i in range(d - 1))
    decode = "".join(f"  {guard}{{ k{i} = r % gs{i}; r /= gs{i}; off += k{i} * gt{i}; }}\n"
                     for i in reversed(range(d - 1)))
    carry = "".join(f"    if (++k{i} < gs{i}) {{ off += gt{i}; continue; }}\n"
                    f"    off -= (gs{i} - 1) * gt{i}; k{i} = 0;\n"
                    for i in reversed(range(d - 1)))
    return ("  const long gid = get_global_id(0);\n"
            "  const long row0 = (gid / chunks) * per;\n  if (row0 >= rows) return;\n"
            f"  const long j0 = (gid % chunks) * {COPY_CHUNK}, row1 = min(rows, row0 + per);\n"
            f"  const long len = gs{d - 1}, step = gt{d - 1};\n"
            f"  const long j1 = min(len, j0 + {COPY_CHUNK});\n"
            f"  long r = row0, off = base; {index}\n{decode}"
            "  for (long row = row0; row < row1; ++row) {\n"
            f"    const long dense = {dense_base}row * len;\n"
            f"    if (step == 1) {{ for (long j = j0; j < j1; ++j) {body_unit} }}\n"
            + (f"    else if (step == 0) {{ {body_zero} }}\n" if body_zero else "")
            + f"    else {{ for (long j = j0; j < j1; ++j) {body_step} }}\n"
            f"{carry}  }}\n")


def gather_shape(sizes: Sequence[int], steps: Sequence[int], device: Device, rank: int = 0
                 ) -> tuple[tuple[int], list[int], list[int]]:
    """A `gather_loop` kernel's launch size, its (rows, chunks, per) arguments and its
    (gs, gt) pairs over merged `sizes` and `steps`, padded with leading (1, 0) pairs to `rank`
    dims: rows shorter than COPY_CHUNK go `per` to a work-item, to about COPY_CHUNK elements
    each, on a CPU (a GPU keeps a row per work-item, for its many threads); longer ones in
    chunks of COPY_CHUNK."""
    length = sizes[-1]
    rows = math.prod(sizes) // length
    chunks = -(-length // COPY_CHUNK)
    per = 1 if device.is_gpu else max(1, COPY_CHUNK // length)
    dims = [1, 0] * (rank - len(sizes))
    for size, step in zip(sizes, steps, strict=True):
        dims += [size, step]
    return launch_size(-(-rows // per) * chunks), [rows, chunks, per], dims


def _wide_copy_source() -> str:
    return _copy_source(MAX_DIMS, fills=False)


def _simplify(shape: Shape, strides: Sequence[int]) -> tuple[list[int], list[int]]:
    """Drop size-1 dims and merge dims that walk memory as one (at least one dim remains; there
    may be more than MAX_DIMS)."""
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    merged: list[tuple[int, int]] = []
    for n, s in dims:
        if merged and merged[-1][1] == s * n:
            pn, _ = merged[-1]
            merged[-1] = (pn * n, s)
        else:
            merged.append((n, s))
    if not merged:
        merged = [(1, 0)]
    return [n for n, _ in merged], [s for _, s in merged]


def _copy_kernel(device: Device, name: str, itemsize: int, dims: int = 0) -> cl.Kernel:
    """The fill, or the gather/scatter over `dims` padded dims (CORE_DIMS or MAX_DIMS)."""
    key = ("copy", name, itemsize, dims)
    kernel = device.launch_cache.get(key)
    if kernel is None:
        kname = (f"{name}{itemsize}" if name in ("fill", "embed")
                 else f"{name}{dims}_{itemsize}")
        if dims > CORE_DIMS:
            kernel = device.kernel("copy_wide", "all", kname, _wide_copy_source)
        else:
            kernel = device.kernel("copy", "all", kname, _copy_source)
        device.launch_cache[key] = kernel
    return kernel


def strided_gather(
    src: AnyTensor, shape: Shape, strides: Sequence[int], base: int = 0
) -> AnyTensor:
    """out[idx] = src[base + sum(idx * strides)] over `shape` (strides in elements, may be 0).

    A pending src is read by evaluating its DAG at the gathered positions where it can be
    (`_fusion.gather`), rather than written out first."""
    out = empty(shape, src.dtype, src.device)
    gather_into(src, out, shape, strides, base)
    return out


def gather_into(src: AnyTensor, out: AnyTensor, shape: Shape, strides: Sequence[int],
                base: int = 0) -> None:
    """`strided_gather` into an existing `out` (of `shape`'s size)."""
    _strided(src, out, "gather", shape, strides, base)


def strided_scatter(
    src: AnyTensor, out: AnyTensor, strides: Sequence[int], base: int = 0
) -> None:
    """out[base + sum(idx * strides)] = src[idx]: writes a part of a fresh output buffer."""
    _strided(src, out, "scatter", src.shape, strides, base)


class _CopyPlan(NamedTuple):
    """A strided copy's launches, worked out once per (kind, shape, strides, item size,
    device): the merged dims, and the kernel with its launch size and size arguments."""

    sizes: list[int]  # all merged dims (a pending source is gathered over them)
    steps: list[int]
    lead: list[int]  # dims past what one kernel takes: a launch per index of them
    lead_steps: list[int]
    block: int
    kernel: cl.Kernel
    size: tuple[int]
    counts: list[int]
    dims: list[int]


# A model copies the same few layouts every step (its heads' transposes, its biases): each
# worked out again cost more than the launch. Started over when full.
_COPY_PLANS: dict[tuple[Any, ...], _CopyPlan] = {}
COPY_PLANS_MAX = 4096


def _copy_plan(device: Device, name: str, itemsize: int, shape: Shape, strides: Sequence[int]
               ) -> _CopyPlan:
    key = (name, shape, tuple(strides), itemsize, device)
    plan = _COPY_PLANS.get(key)
    if plan is None:
        all_sizes, all_steps = _simplify(shape, strides)
        # More dims than a kernel takes (rare: they could not be merged): one launch per index
        # of the leading dims, each copying the trailing MAX_DIMS dims from its own offsets.
        sizes, steps = all_sizes[-MAX_DIMS:], all_steps[-MAX_DIMS:]
        rank = CORE_DIMS if len(sizes) <= CORE_DIMS else MAX_DIMS
        kernel = _copy_kernel(device, name, itemsize, rank)
        size, counts, dims = gather_shape(sizes, steps, device, rank)
        plan = _CopyPlan(all_sizes, all_steps, all_sizes[:-MAX_DIMS], all_steps[:-MAX_DIMS],
                         math.prod(sizes), kernel, size, counts, dims)
        if len(_COPY_PLANS) >= COPY_PLANS_MAX:
            _COPY_PLANS.clear()
        _COPY_PLANS[key] = plan
    return plan


def _strided(
    src: AnyTensor, out: AnyTensor, name: str, shape: Shape, strides: Sequence[int], base: int
) -> None:
    if size_of(shape) == 0:
        return
    device = src.device
    plan = _copy_plan(device, name, src.dtype.itemsize, shape, strides)
    if (name == "gather" and src.pending is not None and len(plan.sizes) <= CORE_DIMS
            and _gather_pending(src, out, plan.sizes, plan.steps, base)):
        return
    # It touches the shape's elements of either buffer, however large (a step's x[:, t]): the
    # bytes that choose its lane.
    touched = size_of(shape) * src.dtype.itemsize
    if not plan.lead:
        device.launch(plan.kernel, plan.size, (LOCAL,), out.buffer, src.buffer, *plan.counts,
                      base, 0, *plan.dims, largest=touched)
        return
    for k, index in enumerate(itertools.product(*(range(s) for s in plan.lead))):
        offset = base + sum(i * s for i, s in zip(index, plan.lead_steps, strict=True))
        device.launch(plan.kernel, plan.size, (LOCAL,), out.buffer, src.buffer, *plan.counts,
                      offset, k * plan.block, *plan.dims, largest=touched)


# Scalars that never change, uploaded once per (device, dtype, value): a backward's seed (1), and
# the seed scaled by a mean's 1/n, which a VJP folds into another constant (see `constant_value`)
# where a kernel would compute one number: a launch per training step. A few dozen at most.
_CONSTANTS: dict[tuple[Device, DType, str], AnyTensor] = {}
_VALUES: dict[int, float] = {}  # id of each kept constant (alive in _CONSTANTS) -> its value
MAX_CONSTANTS = 64


def constant(value: float, dtype: DType, device: Device) -> AnyTensor:
    """A 0-d tensor holding `value` rounded to `dtype`, shared by every caller."""
    array = np.asarray(value, dtype)
    value = float(array)
    key = (device, dtype, value.hex())  # hex: -0.0 and 0.0 differ, a NaN equals itself
    found = _CONSTANTS.get(key)
    if found is None:
        found = upload(array, device)
        if len(_CONSTANTS) < MAX_CONSTANTS:
            # setdefault: of two threads that both missed, both keep the first one's
            found = _CONSTANTS.setdefault(key, found)
            _VALUES[id(found)] = value
    return found


def kept_buffers() -> set[int]:
    """The ids of the kept constants' buffers (they live as long as the process)."""
    return {id(t.buffer) for t in list(_CONSTANTS.values())}


def constant_value(t: Any) -> float | None:
    """The value of a tensor made by `constant`, else None (any other tensor, or an id)."""
    return _VALUES.get(id(t))


def full(shape: Shape, value: float, dtype: DType, device: Device) -> AnyTensor:
    """A tensor of one value, made on the device (no host copy)."""
    out = empty(shape, dtype, device)
    fill_into(out, value)
    return out


def fill_into(out: AnyTensor, value: float) -> None:
    if out.size == 0:
        return
    itemsize = out.dtype.itemsize
    bits = np.array(value, out.dtype).view(f"u{itemsize}")[()]
    kernel = _copy_kernel(out.device, "fill", itemsize)
    out.device.launch(kernel, dense_size(out.size), (LOCAL,), out.buffer, bits, out.size)


def embed_block(part: AnyTensor, out: AnyTensor, k: int, b: int, lo: int, w: int) -> None:
    """Write `out`, viewed as (A, k, B), as zeros but for `part`, (A, w, B), at [lo, lo + w)
    along k: the transpose of a slice along one axis (a split's piece) in one launch, where a
    fill and a scatter were two."""
    if out.size == 0:
        return
    kernel = _copy_kernel(out.device, "embed", out.dtype.itemsize)
    out.device.launch(kernel, dense_size(out.size), (LOCAL,), out.buffer, part.buffer, k, b,
                      lo, w, out.size)


# Parts one concat launch takes (a program of its own, built when a model first concatenates:
# one kernel per count up to this and per element size).
CONCAT_PARTS = 8


def _part_params(count: int, ctype: str) -> str:
    """The parameters of parts p0..p{count-1} of `ctype` laid end to end and their ends e_i."""
    return ("".join(f"__global const {ctype}* p{i}, " for i in range(count))
            + "".join(f"const long e{i}, " for i in range(count)))


def _pick_part(count: int, index: str, more: Callable[[int], str]) -> str:
    """C choosing, among parts p0..p{count-1} laid end to end (part i ending at e_i), the one
    that `index` lies in: its pointer as `src`, its start as `s`, then `more(i)`."""
    return " else ".join(
        (f"if ({index} < e{i}) " if i < count - 1 else "")
        + f"{{ src = p{i}; s = {f'e{i - 1}' if i else '0'}; {more(i)} }}"
        for i in range(count))


def _concat_source() -> str:
    """concat{P}_{size}: out, viewed as (A, row), gets P parts side by side from column `lo`
    on, part i (A, w_i) contiguous and ending at column e_i of the group (its widths' running
    sums, W the last). A work-item copies COPY_CHUNK elements of the (A, W) group, a run of one
    part's row at a time."""
    parts: list[str] = []
    for size, t in _COPY_TYPES.items():
        for count in range(1, CONCAT_PARTS + 1):
            pick = _pick_part(count, "c", lambda i: f"w = e{i} - s;")
            parts.append(
                f"__kernel void concat{count}_{size}(__global {t}* out, "
                f"{_part_params(count, t)}"
                "const long row, const long lo, const long n) {\n"
                f"  long i = get_global_id(0) * {COPY_CHUNK};\n"
                f"  const long end = min(n, i + {COPY_CHUNK}), W = e{count - 1};\n"
                "  while (i < end) {\n"
                "    const long a = i / W, c = i - a * W;\n"
                f"    __global const {t}* src; long s, w;\n"
                f"    {pick}\n"
                "    const long m = min(end - i, s + w - c);\n"
                f"    __global {t}* dst = out + a * row + lo + c;\n"
                "    src += a * w + (c - s);\n"
                "    for (long q = 0; q < m; ++q) dst[q] = src[q];\n"
                "    i += m;\n  }\n}\n")
    return "".join(parts)


def concat_into(out: AnyTensor, parts: Sequence[AnyTensor], axis: int) -> None:
    """Write fresh `out` as `parts` joined along `axis` (their other sizes out's): a launch per
    CONCAT_PARTS parts, where a scatter per part was one each. Empty parts write nothing."""
    inner = math.prod(out.shape[axis + 1:])
    row = out.shape[axis] * inner
    if out.size == 0 or row == 0:
        return
    lo = 0
    device = out.device
    placed = [(p, p.shape[axis] * inner) for p in parts if p.shape[axis]]
    for start in range(0, len(placed), CONCAT_PARTS):
        group = placed[start:start + CONCAT_PARTS]
        ends = list(itertools.accumulate(w for _, w in group))
        n = out.size // row * ends[-1]
        key = ("concat", len(group), out.dtype.itemsize)
        kernel = device.launch_cache.get(key)
        if kernel is None:
            kernel = device.kernel("concat", "all", f"concat{len(group)}_{out.dtype.itemsize}",
                                   _concat_source)
            device.launch_cache[key] = kernel
        device.launch(kernel, launch_size(-(-n // COPY_CHUNK)), (LOCAL,), out.buffer,
                      *[p.buffer for p, _ in group], *ends, row, lo, n)
        lo += ends[-1]


def put_rows(src: AnyTensor, shape: Shape, w: int, row: int, at: int) -> AnyTensor:
    """A fresh tensor of `shape`: zeros, with src's rows of w elements written `row` apart from
    `at` on (a put, see `_fusion.pending_view`): one embed launch where they are one run or a
    block of every row (a split's piece), else zeros and a scatter."""
    out = empty(shape, src.dtype, src.device)
    rows = src.size // w
    if w == row:  # one contiguous run
        embed_block(src, out, out.size, 1, at, src.size)
    elif at + w <= row and rows * row == out.size:  # a block of every row
        embed_block(src, out, row, 1, at, w)
    else:
        fill_into(out, 0.0)
        strided_scatter(src.with_shape((rows, w)), out, [row, 1], at)
    return out


# Puts one add_puts launch takes (a program per dtype, built when a sum of puts first runs).
PUT_PARTS = 8


def _puts_source(dtype: DType) -> str:
    """add_puts{P}: parts p_i, contiguous, ending at e_i of their concatenation (their sizes'
    running sums), each rows of w elements added into out `row` apart from a_i on, then 0. A
    work-item takes COPY_CHUNK elements of the concatenation, a run of one row at a time."""
    parts = [fp64_pragma(dtype), f"typedef {C_TYPES[dtype]} T;\n"]
    for count in range(1, PUT_PARTS + 1):
        ats = "".join(f"const long a{i}, " for i in range(count))
        pick = _pick_part(count, "i", lambda i: f"at = a{i};")
        parts.append(
            f"__kernel void add_puts{count}(__global T* out, {_part_params(count, 'T')}{ats}"
            "const long w, const long row, const long n) {\n"
            f"  long i = get_global_id(0) * {COPY_CHUNK};\n"
            f"  const long end = min(n, i + {COPY_CHUNK});\n"
            "  while (i < end) {\n"
            "    __global const T* src; long s, at;\n"
            f"    {pick}\n"
            "    const long k = i - s, r = k / w, c = k - r * w, m = min(end - i, w - c);\n"
            "    __global T* dst = out + r * row + at + c;\n"
            "    src += k;\n"
            "    for (long q = 0; q < m; ++q) dst[q] = (dst[q] + src[q]) + (T)0;\n"
            "    i += m;\n  }\n}\n")
    return "".join(parts)


def add_puts_into(out: AnyTensor, parts: Sequence[tuple[AnyTensor, int]], w: int, row: int
                  ) -> None:
    """out[j] = (out[j] + x) + 0 for each element x of each (part, at): the part's rows of w
    elements placed `row` apart from `at` on (a put, see `_fusion.pending_view`). The parts
    must not overlap: each element of out is written by one work-item at most. A launch per
    PUT_PARTS parts."""
    device, dtype = out.device, out.dtype
    for start in range(0, len(parts), PUT_PARTS):
        group = parts[start:start + PUT_PARTS]
        ends = list(itertools.accumulate(part.size for part, _ in group))
        key = ("add_puts", len(group), dtype)
        kernel = device.launch_cache.get(key)
        if kernel is None:
            kernel = device.kernel("add_puts", dtype_name(dtype), f"add_puts{len(group)}",
                                   lambda: _puts_source(dtype))
            device.launch_cache[key] = kernel
        device.launch(kernel, launch_size(-(-ends[-1] // COPY_CHUNK)), (LOCAL,), out.buffer,
                      *[part.buffer for part, _ in group], *ends, *[at for _, at in group],
                      w, row, ends[-1], largest=ends[-1] * dtype.itemsize)


def broadcast_strides(src: Shape, shape: Shape) -> list[int]:
    """The strides (in elements of a contiguous `src`) that read `src` broadcast to `shape`."""
    lead = len(shape) - len(src)
    return [0] * lead + [0 if n == 1 else s for n, s in zip(src, contiguous_strides(src),
                                                             strict=True)]


def contiguous_strides(shape: Shape) -> list[int]:
    strides: list[int] = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]


register_family("elementwise", lambda dtype: _elementwise_source(dtype, "elementwise"))
register_family("copy", lambda dtype: _copy_source())


# --- dtype casts ------------------------------------------------------------------------------


def _cast_source() -> str:
    # Casts involving double exist only where the device has fp64: these kernels share the
    # float32 program, which must still build on a GPU without cl_khr_fp64.
    parts = [DENSE_PRELUDE]
    for (src_dtype, src_t), (dst_dtype, dst_t) in itertools.product(C_TYPES.items(), repeat=2):
        convert = f"({dst_t})(x != 0)" if dst_dtype == np.bool_ else f"({dst_t})x"
        double = "double" in (src_t, dst_t)
        parts.append(
            ("#ifdef cl_khr_fp64\n" if double else "")
            + f"__kernel void cast_{src_dtype}_{dst_dtype}(__global {dst_t}* out, "
            f"__global const {src_t}* src, const long n) {{\n"
            f"  TG_EACH(n) {{ const {src_t} x = src[i]; out[i] = {convert}; }}\n}}\n"
            + ("#endif\n" if double else "")
        )
    return "".join(parts)


def cast(src: AnyTensor, dtype: DType) -> AnyTensor:
    out = empty(src.shape, dtype, src.device)
    if src.size:
        # dtype_name, not str(dtype): numpy formats a dtype in Python, on every cast.
        kernel = src.device.kernel(
            "cast", "all", f"cast_{dtype_name(src.dtype)}_{dtype_name(dtype)}", _cast_source)
        src.device.launch(kernel, dense_size(src.size), (LOCAL,), out.buffer, src.buffer,
                          src.size)
    return out


register_family("cast", lambda dtype: _cast_source())
