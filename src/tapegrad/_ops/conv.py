"""Sliding-window ops over NCHW tensors: conv2d, max_pool2d, avg_pool2d.

Every op here is a set of kernels in which each work-item owns a whole plane (one channel of
one image) and is the only one to write its outputs, so no kernel ever adds into a shared
location (no float atomics, the same result on every run):

- `conv2d` is one primitive: the product of the weight, viewed as (out, in*kh*kw), with the
  patch matrix of x (`im2col`'s, zeros at padded positions), written in NCHW by one kernel,
  `conv_panel`, which gathers each chunk of patches as it multiplies: the patch matrix is never
  stored. Its VJP: the weight's cotangent is `conv2d_weight_grad`, g times the patch matrix
  transposed, one kernel reading the patches from the zero-padded x in place; x's is
  `conv2d_input_grad`, at stride 1 conv_panel again over g with the weight flipped (planes
  whose weights hold a NaN or inf computed again as col2im's sums), else col2im of w^T g
  (im2col's adjoint: each input element sums the patch entries that copied it, in a fixed
  order). On a GPU the three are im2col, col2im and the product's kernels, the first two with
  a work-item per element (`_gpu_source`) rather than per plane. The three
  primitives' VJPs are each other (bilinear maps).
- `max_pool2d` records the window argmax as an int64 node (`max_pool2d_argmax`, the first
  maximum in window order, as PyTorch), then reads the values at those positions
  (`pool_gather`). The VJP of `pool_gather` is `pool_scatter` (each input element sums the
  cotangents of the windows whose argmax it is), whose VJP is `pool_gather` again.
- `avg_pool2d` (PyTorch's default count_include_pad=True: the divisor is always kh*kw) and its
  VJP `avg_pool2d_grad` are each other's adjoint.

Kernels take every size as an argument: one program per dtype, whatever the shapes.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from .._device import LOCAL, Device, fp64_pragma, register_family
from .._errors import ArgumentTypeError, DTypeError, ShapeError, at_site, shown
from .._fusion import pad_planes
from .._kernels import CONTRACT_ON, VEC8, VEC16, fill_into, launch_size, strided_gather
from .._primitive import Aval, Emitter, LinearOp, Primitive, register, transposes
from .._tape import Id, Tape, record, takes_tape
from .._tensor import C_TYPES, INT64, AnyTensor, DType, Shape, dtype_name, empty, is_float
from .._traced import integer, is_integer
from . import linalg as _linalg
from . import shape as _shape
from .broadcast import SUM, ReduceParams

# --- geometry --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    """A 2-D sliding window over an input plane of h x w: kernel, stride and padding."""

    h: int
    w: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int

    @property
    def oh(self) -> int:
        return (self.h + 2 * self.ph - self.kh) // self.sh + 1

    @property
    def ow(self) -> int:
        return (self.w + 2 * self.pw - self.kw) // self.sw + 1

    def args(self) -> list[np.int64]:
        """Kernel arguments H, W, OH, OW, KH, KW, SH, SW, PH, PW."""
        return [np.int64(v) for v in (self.h, self.w, self.oh, self.ow, self.kh, self.kw,
                                      self.sh, self.sw, self.ph, self.pw)]


_GEOMETRY = ("const long H, const long W, const long OH, const long OW, const long KH, "
             "const long KW, const long SH, const long SW, const long PH, const long PW")

# Every kernel here gives one work-item a whole plane: the index decoding (64-bit divisions)
# happens once per work-item, not per element, which made these kernels 3-10x faster than one
# work-item per element. The loops run over the ranges of offsets or outputs that stay inside
# the plane, computed once per row or offset, so no cell is tested for padding. Sums
# into an element run in a fixed order (window offsets ascending; pool_scatter's outputs
# ascending, as PyTorch's), so gradients are bitwise reproducible.

_RANGES = """
// PoCL's min and max on longs are calls into its kernel library, not inlined: ternaries.
#define TG_MIN(a, b) ((a) < (b) ? (a) : (b))
#define TG_MAX(a, b) ((a) > (b) ? (a) : (b))
// The outputs o with 0 <= o * S - P + k < L lie in [out_lo, out_hi); S == 1 (a convolution of
// stride 1) takes no division.
inline long out_lo(const long P, const long k, const long S) {
  const long a = P - k;
  return a <= 0 ? 0 : (S == 1 ? a : (a + S - 1) / S);
}
inline long out_hi(const long L, const long P, const long k, const long S, const long O) {
  const long a = L - 1 + P - k;
  return a < 0 ? 0 : TG_MIN(O, (S == 1 ? a : a / S) + 1);
}
"""

# For each window offset (ki, kj) and each output position (oh, ow) whose cell (y, x) lies in
# the plane.
_CELLS_BY_OFFSET = """
  for (long ki = 0; ki < KH; ++ki) {
    const long oh0 = out_lo(PH, ki, SH), oh1 = out_hi(H, PH, ki, SH, OH);
    for (long kj = 0; kj < KW; ++kj) {
      const long ow0 = out_lo(PW, kj, SW), ow1 = out_hi(W, PW, kj, SW, OW);
      for (long oh = oh0; oh < oh1; ++oh) {
        const long y = oh * SH - PH + ki;
        for (long ow = ow0; ow < ow1; ++ow) {
          const long x = ow * SW - PW + kj;
          BODY
        }
      }
    }
  }
"""

# For each window (oh, ow), its cells inside the plane, in window order.
_CELLS_BY_WINDOW = """
  for (long oh = 0; oh < OH; ++oh) {
    const long y0 = oh * SH - PH, ki0 = TG_MAX(-y0, 0), ki1 = TG_MIN(KH, H - y0);
    for (long ow = 0; ow < OW; ++ow) {
      const long x0 = ow * SW - PW, kj0 = TG_MAX(-x0, 0), kj1 = TG_MIN(KW, W - x0);
      START
      for (long ki = ki0; ki < ki1; ++ki) {
        const long y = y0 + ki;
        for (long kj = kj0; kj < kj1; ++kj) {
          const long x = x0 + kj;
          BODY
        }
      }
      END
    }
  }
"""

# One plane per work-item: `pin` the plane's input (H x W), `pout` its output (OH x OW).
_PLANE = ("  const long plane = get_global_id(0);\n  if (plane >= n) return;\n"
          "  const long HW = H * W, OHW = OH * OW;\n")


def _zero(name: str) -> str:
    return f"  for (long j = 0; j < HW; ++j) {name}[j] = (T)0;\n"


def _source(dtype: DType) -> str:
    head = fp64_pragma(dtype) + f"typedef {C_TYPES[dtype]} T;\n" + _RANGES
    return head + (
        # cols[(c, ki, kj), (b, oh, ow)] = x[b, c, oh*SH - PH + ki, ow*SW - PW + kj] or 0; one
        # work-item per plane (b, c): for each offset, OH rows of OW contiguous outputs, each
        # row zeros, a copied span and zeros.
        f"__kernel void im2col(__global T* out, __global const T* src, const long C, {_GEOMETRY},"
        f" const long ncols, const long n) {{\n{_PLANE}"
        "  const long c = plane % C, b = plane / C;\n"
        "  __global const T* pin = src + plane * HW;\n"
        "  for (long ki = 0; ki < KH; ++ki) {\n"
        "    const long oh0 = out_lo(PH, ki, SH), oh1 = out_hi(H, PH, ki, SH, OH);\n"
        "    for (long kj = 0; kj < KW; ++kj) {\n"
        "      const long ow0 = TG_MIN(out_lo(PW, kj, SW), OW);\n"
        "      const long ow1 = TG_MAX(ow0, out_hi(W, PW, kj, SW, OW));\n"
        "      __global T* o = out + ((c * KH + ki) * KW + kj) * ncols + b * OHW;\n"
        "      for (long oh = 0; oh < OH; ++oh, o += OW) {\n"
        "        if (oh < oh0 || oh >= oh1) {\n"
        "          for (long ow = 0; ow < OW; ++ow) o[ow] = (T)0;\n"
        "          continue;\n"
        "        }\n"
        "        const long at = (oh * SH - PH + ki) * W - PW + kj;\n"
        "        long ow = 0;\n"
        "        for (; ow < ow0; ++ow) o[ow] = (T)0;\n"
        "        for (; ow < ow1; ++ow) o[ow] = pin[at + ow * SW];\n"
        "        for (; ow < OW; ++ow) o[ow] = (T)0;\n"
        "      }\n    }\n  }\n}\n"
        # x[b, c, y, x] = sum of the cols entries copied from it; one work-item per (b, c).
        f"__kernel void col2im(__global T* out, __global const T* cols, const long C, "
        f"{_GEOMETRY}, const long ncols, const long n) {{\n{_PLANE}"
        "  const long c = plane % C, b = plane / C;\n"
        "  __global T* pout = out + plane * HW;\n" + _zero("pout")
        + _CELLS_BY_OFFSET.replace(
            "BODY", "pout[y * W + x] += "
            "cols[((c * KH + ki) * KW + kj) * ncols + (b * OH + oh) * OW + ow];")
        + "}\n"
        # The first maximum of each window in window order, or its last NaN (PyTorch's CPU
        # kernel takes a cell that is greater or NaN); -inf padding never wins. The rule of both
        # max-pool kernels, in one place: cell a wins if it is the window's first (best_at < 0),
        # greater, or a NaN. Each cell's comparison depends on the
        # one before: this chain, not the loads, bounds the general kernel (a C version takes
        # as long), hence the 2x2 kernel below.
        "#define TG_TAKE(a) { const T v = pin[a];"
        " const int take = (best_at < 0) | (v > best) | (v != v);"
        " best = take ? v : best; best_at = take ? (a) : best_at; }\n"
        f"__kernel void max_pool2d_argmax(__global long* out, __global T* maxima, "
        f"__global const T* src, {_GEOMETRY}, const long n) {{\n{_PLANE}"
        "  __global const T* pin = src + plane * HW;\n"
        + _CELLS_BY_WINDOW.replace("START", "long best_at = -1;\n      T best = (T)0;").replace(
            "BODY", "TG_TAKE(y * W + x)").replace(
            "END", "out[plane * OHW + oh * OW + ow] = best_at; "
            "maxima[plane * OHW + oh * OW + ow] = best;")
        + "}\n"
        # The same for 2x2 windows at stride 2 without padding (most CNNs' pooling): every
        # window lies inside the plane, so it is four loads and three selects, with no loop or
        # range per window.
        "__kernel void max_pool2x2_argmax(__global long* out, __global T* maxima, "
        f"__global const T* src, {_GEOMETRY}, const long n) {{\n{_PLANE}"
        "  __global const T* pin = src + plane * HW;\n"
        "  __global long* pat = out + plane * OHW;\n"
        "  __global T* pmax = maxima + plane * OHW;\n"
        "  for (long oh = 0; oh < OH; ++oh)\n"
        "    for (long ow = 0; ow < OW; ++ow) {\n"
        "      const long a = 2 * (oh * W + ow);\n"
        "      long best_at = a;\n"
        "      T best = pin[a];\n"
        "      TG_TAKE(a + 1) TG_TAKE(a + W) TG_TAKE(a + W + 1)\n"
        "      pat[oh * OW + ow] = best_at;\n"
        "      pmax[oh * OW + ow] = best;\n"
        "    }\n}\n"
        # out[plane, o] = x[plane, at[plane, o]]
        "__kernel void pool_gather(__global T* out, __global const T* src, "
        "__global const long* at, const long HW, const long L, const long n) {\n"
        "  const long i = get_global_id(0);\n  if (i >= n) return;\n"
        "  out[i] = src[(i / L) * HW + at[i]];\n}\n"
        # x[plane, y, x] = sum of g over the windows whose argmax is (y, x): each output adds
        # its cotangent at its position, outputs ascending (positions outside the plane, which
        # the argmax kernel never writes, are skipped).
        f"__kernel void pool_scatter(__global T* out, __global const T* g, "
        f"__global const long* at, {_GEOMETRY}, const long n) {{\n{_PLANE}"
        "  __global T* pout = out + plane * HW;\n" + _zero("pout")
        + "  __global const T* pg = g + plane * OHW;\n"
        "  __global const long* pa = at + plane * OHW;\n"
        "  for (long o = 0; o < OHW; ++o) {\n"
        "    const long a = pa[o];\n"
        "    if ((ulong)a < (ulong)HW) pout[a] += pg[o];\n"
        "  }\n}\n"
        # Window sums over zero padding, divided by KH*KW (count_include_pad).
        f"__kernel void avg_pool2d(__global T* out, __global const T* src, {_GEOMETRY}, "
        f"const long n) {{\n{_PLANE}"
        "  __global const T* pin = src + plane * HW;\n"
        + _CELLS_BY_WINDOW.replace("START", "T acc = (T)0;").replace(
            "BODY", "acc += pin[y * W + x];").replace(
            "END", "out[plane * OHW + oh * OW + ow] = acc / (T)(KH * KW);")
        + "}\n"
        f"__kernel void avg_pool2d_grad(__global T* out, __global const T* g, {_GEOMETRY}, "
        f"const long n) {{\n{_PLANE}"
        "  __global T* pout = out + plane * HW;\n" + _zero("pout")
        + _CELLS_BY_OFFSET.replace("BODY", "pout[y * W + x] += g[plane * OHW + oh * OW + ow];")
        + "  for (long j = 0; j < HW; ++j) pout[j] /= (T)(KH * KW);\n}\n"
    )


def _conv_panel(dtype: DType, width: int = 16, direct: bool = False) -> str:
    """`conv_panel`: conv2d's forward as one product with the patch matrix never stored.

    C = W (O x C*kh*kw) @ cols (+ a bias per row), written in NCHW (matmul's split layout), by
    the panel kernel's tiles (`_linalg.panel_tiles`) over B's chunks gathered from x into the
    work-item's private memory: each chunk of k rows of the panel's 16 patch columns, as
    im2col would have written them and mm_pack packed them. The same tiles, the same chunks
    and the same order of every sum as mm_panel over the packed patch matrix, so the same bits
    (tests/test_ops_nn.py); but neither the patch matrix (9 times x's size for a 3x3 kernel)
    nor its packed copy is written, and one launch does the work of three.

    The columns run over (image, output row, OWP columns), each row padded to OWP, a multiple
    of 8: every half-panel of 8 columns lies in one output row, so its patch entries for one
    (c, ki, kj) lie on one input row, SW apart (one vector load where they are adjacent and
    inside it, else 8 tested loads), and its outputs are contiguous in C (a vector store
    unless the row ends inside it; the padding columns are computed and never stored). Per
    group of 8 columns: hb, x's image; hy and hx, its first window's corner (negative in the
    padding); hc, its first output in C; hn, how many of its 8 outputs exist.

    `width` 32 makes `conv_panel32`: panels of 32 columns (four groups of 8), each tile row
    two 16-wide registers, as `mm_panel32` (`_linalg.wide_panels`); the same sums in the same
    order, so the same bits.

    `direct` makes `conv_direct{width}`, for x whose every window lies inside it (padded
    already, PH = PW = 0), at SW = 1 and with whole groups of 8 outputs (OW a multiple of 8):
    a group's 8 patch entries at each k are 8 adjacent elements of x, read where they lie
    (one offset per k, the same for every group) instead of gathered into the chunk first.
    The same products in the same order: conv_panel's bits.
    """
    half = width // 2  # a tile register's columns
    groups = width // 8
    rm = _linalg.tile_rows(dtype, width)
    kc = _linalg.KC[dtype]
    name = _linalg.panel_name("conv_direct" if direct else "conv_panel", width)
    gather = f"""    {{  // this chunk's patch rows, as im2col writes them and mm_pack packs them
      int c = k0 / KK, ki = (k0 % KK) / KW, kj = k0 % KW;
      for (int kk = 0; kk < kn;) {{
        const int run = min(KW - kj, kn - kk);  // the offsets kj left in this (c, ki) row
        for (int h = 0; h < {groups}; ++h) {{
          T* d = tile + kk * {width} + 8 * h;
          const int y = hy[h] + ki;
          if ((uint)y >= (uint)H) {{
            for (int r = 0; r < run; ++r, d += {width}) TG_STORE8((T8)0, d);
            continue;
          }}
          const long at = (long)c * HW + hb[h] + (long)y * W;  // the row's start in X
          __global const T* src = X + at;
          for (int r = 0, x = hx[h] + kj; r < run; ++r, ++x, d += {width}) {{
            if (SW == 1 && x >= 0 && x + 8 <= W) {{
              const T8 v = TG_LOAD8(src + x);
              TG_STORE8(v, d);
            }} else if (SW == 1 && at + x >= 0 && at + x + 8 <= XN) {{
              // across the row's end or start: 8 loads from x's memory, the lanes outside the
              // row set to 0 (selected, so a NaN beside the row stays out)
              const T8 v = TG_LOAD8(src + x);
              const TI8 lane = (TI8)(0, 1, 2, 3, 4, 5, 6, 7);
              const T8 inside = lane >= (TI8)(-x) && lane < (TI8)(W - x) ? v : (T8)0;
              TG_STORE8(inside, d);
            }} else {{
              for (int j = 0; j < 8; ++j) {{
                const int xj = x + j * SW;
                d[j] = (uint)xj < (uint)W ? src[xj] : (T)0;
              }}
            }}
          }}
        }}
        kk += run;
        kj += run;
        if (kj == KW) {{ kj = 0; if (++ki == KH) {{ ki = 0; ++c; }} }}
      }}
    }}"""
    if direct:
        # Each group's first window corner in x, and per k of the chunk its offset from there.
        setup = (f"  __global const T* xg[{groups}];\n"
                 f"  for (int h = 0; h < {groups}; ++h)\n"
                 "    xg[h] = hn[h] ? X + hb[h] + (long)hy[h] * W + hx[h] : X;\n"
                 f"  long koff[{kc}];")
        chunk = """    {  // this chunk's offsets of (c, ki, kj) from a window's corner
      int c = k0 / KK, ki = (k0 % KK) / KW, kj = k0 % KW;
      for (int kk = 0; kk < kn; ++kk) {
        koff[kk] = (long)c * HW + (long)ki * W + kj;
        if (++kj == KW) { kj = 0; if (++ki == KH) { ki = 0; ++c; } }
      }
    }"""
        pair = "\n          ".join(
            f"const T{half} b{j} = (T{half})("
            + ", ".join(f"TG_LOAD8(xg[{j * (groups // 2) + h}] + o_)"
                        for h in range(groups // 2)) + ");" for j in range(2))
        tiles = _linalg.panel_tiles(rm, chunk, "const long* kp = koff", "++kp", half,
                                    b_loads=f"const long o_ = *kp;\n          {pair}")
    else:
        setup = f"  T tile[{kc * width}];"
        tiles = _linalg.panel_tiles(rm, gather, "const T* bp = tile", f"bp += {width}", half)
    # A tile register holds one group of 8 columns (width 16) or two (width 32).
    if half == 8:
        hadd = "#define TG_HADD(acc, h, o) TG_GADD(acc, h, o)\n"
        hstore = "#define TG_HSTORE(v, h, o) TG_GSTORE(v, h, o)\n"
    else:
        hadd = ("#define TG_HADD(acc, h, o) do { TG_GADD((acc).lo, 2 * (h), o); "
                "TG_GADD((acc).hi, 2 * (h) + 1, o); } while (0)\n")
        hstore = ("#define TG_HSTORE(v, h, o) do { TG_GSTORE((v).lo, 2 * (h), o); "
                  "TG_GSTORE((v).hi, 2 * (h) + 1, o); } while (0)\n")
    return f"""
// A group with fewer than 8 outputs goes through `part_`, lane by lane (a loop: eight
// unrolled tests per group and row made PoCL's first compile of the kernel ~1.3x slower).
#define TG_GADD(acc, h, o) do {{ __global const T* p_ = C + hc[h] + (o); \\
  if (hn[h] == 8) {{ acc += TG_LOAD8(p_); }} else {{ T part_[8]; \\
    for (int j_ = 0; j_ < 8; ++j_) part_[j_] = j_ < hn[h] ? p_[j_] : (T)0; \\
    acc += TG_LOAD8(part_); }} }} while (0)
#define TG_GSTORE(v, h, o) do {{ __global T* p_ = C + hc[h] + (o); \\
  if (hn[h] == 8) {{ TG_STORE8(v, p_); }} else {{ T part_[8]; TG_STORE8(v, part_); \\
    for (int j_ = 0; j_ < hn[h]; ++j_) p_[j_] = part_[j_]; }} }} while (0)
{hadd}{hstore}__kernel void {name}(__global T* C, __global const T* A, __global const T* X,
                         const int M, const int K, const int ncols, const int mr,
                         const int kc, const int Cin, const int H, const int W, const int KH,
                         const int KW, const int SH, const int SW, const int PH, const int PW,
                         const int OH, const int OW, const int OWP, const long XN,
                         __global const T* bias, const int bmode) {{
  const int p = get_global_id(0), col0 = p * {width}, rstart = get_global_id(1) * mr;
  if (col0 >= ncols || rstart >= M) return;
  const int rend = min(M, rstart + mr), HW = H * W, KK = KH * KW, S = OH * OW;
  const long sam = K, sak = 1, rs = S;
  long hb[{groups}], hc[{groups}];
  int hy[{groups}], hx[{groups}], hn[{groups}];
  for (int h = 0; h < {groups}; ++h) {{  // a group past the last column: no outputs, image 0
    const int col = col0 + 8 * h, in = col < ncols;
    const int b = in ? col / (OH * OWP) : 0, r = in ? col % (OH * OWP) : 0;
    const int oh = r / OWP, ow = r % OWP;
    hb[h] = (long)b * Cin * HW;
    hc[h] = (long)b * M * S + oh * OW + ow;
    hy[h] = oh * SH - PH;
    hx[h] = ow * SW - PW;
    hn[h] = in ? min(8, OW - ow) : 0;
  }}
{setup}
  {_linalg.tile_registers(rm, half)}
  const T{half} bc0 = 0, bc1 = 0;
{tiles}}}
#undef TG_HADD
#undef TG_HSTORE
#undef TG_GADD
#undef TG_GSTORE
"""


# Rows of dw^T a work-item of conv_wgrad16 owns: one 16-lane accumulator each, where
# conv_wgrad's RM rows hold two 8-lane ones (as the wide panels' tiles, `_linalg.WIDE_ROWS`).
WGRAD16_ROWS = 8


def _wgrad_name(dev: Device, dtype: DType) -> str:
    """conv_wgrad16 where products take wide panels (float32, 16 floats a vector), else
    conv_wgrad."""
    return "conv_wgrad16" if _linalg.wide_panels(dev, dtype) else "conv_wgrad"


def _wgrad_rows(name: str, dtype: DType) -> int:
    return WGRAD16_ROWS if name == "conv_wgrad16" else _linalg.ROWS[dtype]


def _conv_wgrad(dtype: DType, lanes: int = 8) -> str:
    """`conv_wgrad`: conv2d's weight gradient as the product dw^T = cols @ g^T, the patch
    matrix cols never stored: dw[o, (c, ki, kj)] = the sum over outputs (b, oh, ow) of
    g[b, o, oh, ow] * xp[b, c, oh*SH + ki, ow*SW + kj], xp being x zero-padded (every patch
    entry inside it, so no entry is tested).

    A work-item owns RM rows (c, ki, kj) of dw^T and one panel of 16 columns (o), g packed by
    mm_pack per image as (image, panel, OH*OW, 16): per output position, two 8-wide loads of
    g, RM broadcasts from xp (all at one offset from each row's base), 2 RM FMAs, as the
    product's tiles. Sums over KC positions at a time start from 0 and are then added to the
    running totals, as the product's chunks (the error grows with the chunks, not the
    positions).

    `lanes` 16 makes `conv_wgrad16`: one 16-wide load of g and an FMA of 16 lanes per row
    (WGRAD16_ROWS rows), where the 8-lane FMAs bound the kernel on a CPU with 16-float
    vectors. Each lane is one channel o, summed in the same order: the same bits."""
    rm = _linalg.ROWS[dtype] if lanes == 8 else WGRAD16_ROWS
    rows = range(rm)
    name = "conv_wgrad" if lanes == 8 else "conv_wgrad16"
    bases = "\n".join(
        f"  __global const T* a{r} = X + tg_patch_base(min(r0 + {r}, Kn - 1), KH, KW, Hp, Wp);"
        for r in rows)
    if lanes == 8:
        flush = " ".join(
            f"TG_STORE8(TG_LOAD8(tot + {16 * r}) + c{r}0, tot + {16 * r}); "
            f"TG_STORE8(TG_LOAD8(tot + {16 * r + 8}) + c{r}1, tot + {16 * r + 8}); "
            f"c{r}0 = (T8)0; c{r}1 = (T8)0;" for r in rows)
        tile = f"T8 {', '.join(f'c{r}0 = 0, c{r}1 = 0' for r in rows)};"
        loads = "const T8 b0 = TG_LOAD8(bp), b1 = TG_LOAD8(bp + 8);"
        fmas = _linalg.tile_fmas(rm)
    else:
        flush = " ".join(f"TG_STORE16(TG_LOAD16(tot + {16 * r}) + c{r}, tot + {16 * r}); "
                         f"c{r} = (T16)0;" for r in rows)
        tile = f"T16 {', '.join(f'c{r} = 0' for r in rows)};"
        loads = "const T16 b = TG_LOAD16(bp);"
        fmas = "\n".join(f"        {{ const T16 x = (T16)(a{r}[ka]); c{r} += x * b; }}"
                         for r in rows)
    helper = "" if lanes == 16 else """
inline long tg_patch_base(const int n, const int KH, const int KW, const int Hp, const int Wp) {
  const int KK = KH * KW;
  return (long)(n / KK) * Hp * Wp + (n % KK) / KW * Wp + n % KW;
}"""
    return f"""{helper}
#define TG_FLUSH {{ {flush} }}
__kernel void {name}(__global T* DW, __global const T* P, __global const T* X,
                         const int O, const int Cin, const int Hp, const int Wp, const int KH,
                         const int KW, const int SH, const int SW, const int OH, const int OW,
                         const int N, const int kc) {{
  const int p = get_global_id(0), r0 = get_global_id(1) * {rm};
  const int Kn = Cin * KH * KW, panels = (O + 15) / 16;
  if (p >= panels || r0 >= Kn) return;
{bases}
  {tile}
  T tot[{16 * rm}];
  for (int i = 0; i < {16 * rm}; ++i) tot[i] = (T)0;
  int count = 0;
  for (int b = 0; b < N; ++b) {{
    __global const T* bp = P + ((long)b * panels + p) * OH * OW * 16;
    for (int oh = 0; oh < OH; ++oh) {{
      const long at = ((long)b * Cin * Hp + (long)oh * SH) * Wp;
      for (int ow = 0; ow < OW; ++ow, bp += 16) {{
        const long ka = at + ow * SW;
        {loads}
{fmas}
        if (++count == kc) {{ count = 0; TG_FLUSH }}
      }}
    }}
  }}
  TG_FLUSH
  for (int r = 0; r < {rm}; ++r)
    for (int j = 0; j < 16; ++j)
      if (r0 + r < Kn && p * 16 + j < O) DW[(long)(p * 16 + j) * Kn + r0 + r] = tot[r * 16 + j];
}}
#undef TG_FLUSH
"""


# Output channels up to which the weight's gradient runs `conv_wgrad_few` (at stride 1 along
# a row): conv_wgrad's panel of 16 channels did 16 times the work for one (an autoencoder's
# last layer) and took longer than for 16; at 12 the panel was the faster.
FEW_CHANNELS = 8


def _few_rows(dtype: DType, o: int) -> int:
    """Rows of dw^T a work-item of conv_wgrad_few{o} owns: RM * o accumulators of 8 lanes,
    at most 24 (float32) or 12 (float64)."""
    return max(1, min(_linalg.ROWS[dtype], (24 if dtype == np.float32 else 12) // o))


def _conv_wgrad_few(dtype: DType) -> str:
    """`conv_wgrad_few{O}` for O up to FEW_CHANNELS: conv_wgrad's sums with 8 output positions
    along a row at a time in the lanes, g read in place (NCHW): a work-item owns RM rows
    (c, ki, kj) of dw^T (`_few_rows`) and all O channels; per 8 positions O loads of g and RM
    of xp (every entry inside it at stride 1 along the row), RM * O FMAs. Each lane sums its
    positions over KC at a time from 0, then the lanes' sums, pairwise, and the sums of a
    row's last positions (OW % 8, one by one) join the running totals, with Kahan's
    compensation: every KC positions, counted together."""
    out: list[str] = []
    for o in range(1, FEW_CHANNELS + 1):
        rm = _few_rows(dtype, o)
        pairs = [(r, j) for r in range(rm) for j in range(o)]
        bases = "\n".join(
            f"  const long a{r} = tg_patch_base(min(r0 + {r}, Kn - 1), KH, KW, Hp, Wp);"
            for r in range(rm))
        loads = "\n".join(f"        const T8 g{j} = TG_LOAD8(gp + {j} * OHW + ow);"
                           for j in range(o))
        fmas = "\n".join(
            f"        {{ const T8 x = TG_LOAD8(xr + a{r}); "
            + " ".join(f"c{r}_{j} += x * g{j};" for j in range(o)) + " }"
            for r in range(rm))
        flush = " ".join(
            f"TG_ADD({r * o + j}, ((c{r}_{j}.s0 + c{r}_{j}.s1) + (c{r}_{j}.s2 + c{r}_{j}.s3))"
            f" + ((c{r}_{j}.s4 + c{r}_{j}.s5) + (c{r}_{j}.s6 + c{r}_{j}.s7)) + rest[{r * o + j}])"
            f" c{r}_{j} = (T8)0; rest[{r * o + j}] = (T)0;"
            for r, j in pairs)
        tail = "\n".join(
            f"        {{ const T x = xr[a{r}]; "
            + " ".join(f"rest[{r * o + j}] += x * gp[{j} * OHW + ow];" for j in range(o))
            + " }" for r in range(rm))
        out.append(f"""
#define TG_FLUSH {{ {flush} }}
#define TG_ADD(i, v) {{ const T y_ = (v) - lost[i], t_ = tot[i] + y_; \\
  lost[i] = (t_ - tot[i]) - y_; tot[i] = t_; }}
__kernel void conv_wgrad_few{o}(__global T* DW, __global const T* G, __global const T* X,
                                const int Cin, const int Hp, const int Wp, const int KH,
                                const int KW, const int SH, const int OH, const int OW,
                                const int N, const int kc) {{
  const int r0 = get_global_id(0) * {rm};
  const int Kn = Cin * KH * KW;
  const long OHW = (long)OH * OW;
  if (r0 >= Kn) return;
{bases}
  T8 {", ".join(f"c{r}_{j} = (T8)0" for r, j in pairs)};
  T tot[{rm * o}], lost[{rm * o}], rest[{rm * o}];
  for (int i = 0; i < {rm * o}; ++i) {{ tot[i] = (T)0; lost[i] = (T)0; rest[i] = (T)0; }}
  int count = 0;
  for (int b = 0; b < N; ++b) {{
    for (int oh = 0; oh < OH; ++oh) {{
      __global const T* gp = G + (long)b * {o} * OHW + (long)oh * OW;
      __global const T* xr0 = X + ((long)b * Cin * Hp + (long)oh * SH) * Wp;
      int ow = 0;
      for (; ow + 8 <= OW; ow += 8) {{
        __global const T* xr = xr0 + ow;
{loads}
{fmas}
        if ((count += 8) >= kc) {{ count = 0; TG_FLUSH }}
      }}
      for (; ow < OW; ++ow) {{
        __global const T* xr = xr0 + ow;
{tail}
        if (++count >= kc) {{ count = 0; TG_FLUSH }}
      }}
    }}
  }}
  TG_FLUSH
  for (int r = 0; r < {rm}; ++r)
    for (int j = 0; j < {o}; ++j)
      if (r0 + r < Kn) DW[(long)j * Kn + r0 + r] = tot[r * {o} + j] - lost[r * {o} + j];
}}
#undef TG_FLUSH
#undef TG_ADD
""")
    return "".join(out)


# The pad the weight's gradient reads x through: x's planes zero-padded by PH rows and PW
# columns on each side, each output written once (PAD's fill and scatter wrote the inside
# twice, in two launches).
_PAD_PLANES = (
    "__kernel void pad_planes(__global T* out, __global const T* src, const long H, "
    "const long W, const long PH, const long PW, const long n) {\n"
    "  const long plane = get_global_id(0);\n  if (plane >= n) return;\n"
    "  const long Wp = W + 2 * PW, Hp = H + 2 * PH;\n"
    "  __global const T* pin = src + plane * H * W;\n"
    "  __global T* po = out + plane * Hp * Wp;\n"
    "  for (long y = 0; y < Hp; ++y, po += Wp) {\n"
    "    const long yy = y - PH;\n"
    "    if (yy < 0 || yy >= H) {\n"
    "      for (long x = 0; x < Wp; ++x) po[x] = (T)0;\n"
    "      continue;\n"
    "    }\n"
    "    for (long x = 0; x < PW; ++x) po[x] = (T)0;\n"
    "    for (long x = 0; x < W; ++x) po[PW + x] = pin[yy * W + x];\n"
    "    for (long x = PW + W; x < Wp; ++x) po[x] = (T)0;\n"
    "  }\n}\n"
)


# x's cotangent at stride 1 is conv_panel over g with the weight flipped: wf[c, (o, ki, kj)] =
# w[o, c, KH-1-ki, KW-1-kj], written by `conv_flip` (a work-item per input channel c) with 0
# for a NaN or inf entry, since g's zero padding would multiply it (NaN where col2im and
# PyTorch reach no term); after the C*O*KH*KW entries, per channel, whether it had such an
# entry. `conv_dgrad_fix` then computes the planes of those channels again as col2im's sums
# have them, only the terms that exist (the zeroed entry times an inf in g was NaN where
# col2im has inf): for a channel without such an entry, the work-item returns at once.
_DGRAD = ("__kernel void conv_flip(__global T* out, __global const T* w, const long O, "
          "const long KH, const long KW, const long n) {\n"
          "  const long c = get_global_id(0);\n  if (c >= n) return;\n"
          "  const long KK = KH * KW;\n"
          "  __global T* dst = out + c * O * KK;\n"
          "  int bad = 0;\n"
          "  for (long o = 0; o < O; ++o) {\n"
          "    __global const T* src = w + (o * n + c) * KK + KK - 1;  // (ki, kj) reversed\n"
          "    for (long k = 0; k < KK; ++k) {\n"
          "      const T v = src[-k];\n"
          "      const int finite = isfinite(v);\n"
          "      bad |= !finite;\n"
          "      dst[o * KK + k] = finite ? v : (T)0;\n"
          "    }\n  }\n"
          "  out[n * O * KK + c] = (T)bad;\n}\n"
          f"__kernel void conv_dgrad_fix(__global T* out, __global const T* g, "
          f"__global const T* w, __global const T* wf, const long C, const long O, {_GEOMETRY}, "
          f"const long n) {{\n{_PLANE}"
          "  const long c = plane % C, b = plane / C, KK = KH * KW;\n"
          "  if (wf[C * O * KK + c] == (T)0) return;\n"
          "  __global T* pout = out + plane * HW;\n"
          "  __global const T* pg = g + b * O * OHW;\n"
          + _zero("pout")
          # col2im's sums, the patch matrix's entry (c, ki, kj) at (oh, ow) made as w^T g makes it
          + _CELLS_BY_OFFSET.replace(
              "BODY", "T t = (T)0;\n"
              "          for (long o = 0; o < O; ++o)\n"
              "            t += w[(o * C + c) * KK + ki * KW + kj] * pg[o * OHW + oh * OW + ow];\n"
              "          pout[y * W + x] += t;")
          + "}\n")


# conv2d's CPU kernels are a program of their own (not a core family), built at the first
# convolution: in the core program they made every cold start's build ~0.5 s longer (2.1-2.3
# against 2.7-2.8 s for the float32 core), convolutions or not.
CONV_FAMILY = "conv"


def _conv_source(dtype: DType) -> str:
    return (fp64_pragma(dtype) + "".join(f"typedef {C_TYPES[dtype]}{w} T{w};\n" for w in ("", "8"))
            # the lanes' index type in conv_panel: a float8's, a double8's
            + f"typedef {'int8' if dtype == np.float32 else 'long8'} TI8;\n"
            + CONTRACT_ON + VEC8 + _RANGES + _conv_panel(dtype) + _conv_wgrad(dtype)
            + _conv_wgrad_few(dtype)
            + _PAD_PLANES + _DGRAD
            # float32's conv_panel32 (`_linalg.wide_panels`), in this program: one of its
            # own cost a cold first step a build
            + _conv_panel(dtype, direct=True)
            + (VEC16 + _conv_panel(dtype, 32) + _conv_panel(dtype, 32, direct=True)
               + _conv_wgrad(dtype, 16) if dtype == np.float32 else ""))


def _conv_kernel(dev: Device, dtype: DType, name: str) -> Any:
    return dev.kernel(CONV_FAMILY, dtype_name(dtype), name, lambda: _conv_source(dtype))


register_family("window", _source)


def _window_kernel(dev: Device, dtype: DType, name: str) -> Any:
    return dev.kernel("window", dtype_name(dtype), name, lambda: _source(dtype))


def _launch(dev: Device, dtype: DType, name: str, out: AnyTensor, args: Sequence[Any],
            per_item: int = 1, program: Callable[[Device, DType, str], Any] = _window_kernel
            ) -> None:
    """Run kernel `name` of the window program (or of `program`) with one work-item per
    `per_item` elements of `out` (a plane, or a patch row of one image)."""
    if out.size == 0:
        return
    n = out.size // per_item
    kernel = program(dev, dtype, name)
    local = _local(dev, n)
    dev.launch(kernel, launch_size(n, local), (local,), out.buffer, *args, np.int64(n))


def _local(dev: Device, items: int) -> int:
    """The local size of a launch of `items` work-items that each do much work (a plane, a
    patch row): on a CPU, where a group runs on one core, groups of LOCAL left the other cores
    idle below LOCAL planes a core (col2im over 32 planes). A power of two: PoCL compiles a
    kernel once per local size."""
    return LOCAL if dev.is_gpu else min(LOCAL, 1 << max(0, (items // (4 * dev.compute_units))
                                                         .bit_length() - 1))


def _float_rule_arg(op: str, name: str, x: Any, ndim: int) -> None:
    if not is_float(x.dtype):
        raise DTypeError(at_site(f"{op}: {name} has dtype {dtype_name(x.dtype)}, expected "
                                 "float32 or float64"))
    if x.ndim != ndim:
        raise ShapeError(at_site(f"{op}: {name} must be {ndim}-D, got shape {x.shape}"))


# --- im2col / col2im: the patch matrix, where the product computes a convolution ------------


def _cols_shape(c: int, n: int, p: Window) -> Shape:
    return (c * p.kh * p.kw, n * p.oh * p.ow)


def _im2col(dev: Device, x: AnyTensor, p: Window) -> AnyTensor:
    """The patch matrix of NCHW x: (C*kh*kw, N*OH*OW), zero at padded positions."""
    out = empty(_cols_shape(x.shape[1], x.shape[0], p), x.dtype, dev)
    geometry = [np.int64(x.shape[1]), *p.args(), np.int64(out.shape[1])]
    if _per_element(dev, out, x):
        _launch(dev, x.dtype, "im2col_each", out, [x.buffer, *geometry],
                program=_window_gpu_kernel)
    else:
        _launch(dev, x.dtype, "im2col", out, [x.buffer, *geometry], p.kh * p.kw * p.oh * p.ow)
    return out


def _col2im(dev: Device, cols: AnyTensor, n: int, c: int, p: Window) -> AnyTensor:
    """im2col's adjoint: (n, c, h, w), each element the sum of the patch entries copied from
    it."""
    out = empty((n, c, p.h, p.w), cols.dtype, dev)
    geometry = [np.int64(c), *p.args(), np.int64(cols.shape[1])]
    if _per_element(dev, out, cols):
        _launch(dev, cols.dtype, "col2im_each", out, [cols.buffer, *geometry],
                program=_window_gpu_kernel)
    else:
        _launch(dev, cols.dtype, "col2im", out, [cols.buffer, *geometry], p.h * p.w)
    return out


def _per_element(dev: Device, out: AnyTensor, src: AnyTensor) -> bool:
    """Whether the patch matrix's kernels run a work-item per element (`_gpu_source`): on a
    GPU, where a plane's work-item in turn left all but a few hundred threads idle, and
    where int indices reach every element."""
    return dev.is_gpu and max(out.size, src.size) <= _INT_MAX


def _gpu_source(dtype: DType) -> str:
    """im2col and col2im with a work-item per element written (neighbours write neighbours),
    its position decoded in int arithmetic: for GPUs, where the per-plane kernels above ran a
    few hundred threads. col2im_each sums an element's entries in col2im's order (window
    offsets ascending, from 0), so either kernel gives the same bits."""
    geometry = _GEOMETRY.replace("const long", "const int")
    return fp64_pragma(dtype) + f"typedef {C_TYPES[dtype]} T;\n" + (
        # cols[(c, ki, kj), (b, oh, ow)] = x[b, c, oh*SH - PH + ki, ow*SW - PW + kj] or 0
        f"__kernel void im2col_each(__global T* out, __global const T* src, const int C, "
        f"{geometry}, const int ncols, const int n) {{\n"
        "  const int i = get_global_id(0);\n  if (i >= n) return;\n"
        "  const int row = i / ncols, col = i - row * ncols;\n"
        "  const int ow = col % OW, t = col / OW, oh = t % OH, b = t / OH;\n"
        "  const int kj = row % KW, r = row / KW, ki = r % KH, c = r / KH;\n"
        "  const int y = oh * SH - PH + ki, x = ow * SW - PW + kj;\n"
        "  out[i] = (y >= 0 && y < H && x >= 0 && x < W)"
        " ? src[((b * C + c) * H + y) * W + x] : (T)0;\n}\n"
        # x[b, c, y, x] = the sum of the entries copied from it, offsets (ki, kj) ascending
        f"__kernel void col2im_each(__global T* out, __global const T* cols, const int C, "
        f"{geometry}, const int ncols, const int n) {{\n"
        "  const int i = get_global_id(0);\n  if (i >= n) return;\n"
        "  const int x = i % W, t = i / W, y = t % H, u = t / H, c = u % C, b = u / C;\n"
        "  T acc = (T)0;\n"
        "  for (int ki = 0; ki < KH; ++ki) {\n"
        "    const int dy = y + PH - ki, oh = dy / SH;\n"
        "    if (dy < 0 || oh * SH != dy || oh >= OH) continue;\n"
        "    for (int kj = 0; kj < KW; ++kj) {\n"
        "      const int dx = x + PW - kj, ow = dx / SW;\n"
        "      if (dx < 0 || ow * SW != dx || ow >= OW) continue;\n"
        "      acc += cols[((c * KH + ki) * KW + kj) * ncols + (b * OH + oh) * OW + ow];\n"
        "    }\n  }\n  out[i] = acc;\n}\n")


def _window_gpu_kernel(dev: Device, dtype: DType, name: str) -> Any:
    return dev.kernel("window_gpu", dtype_name(dtype), name, lambda: _gpu_source(dtype))


# --- conv2d ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConvParams:
    """conv2d's window over x's planes, and whether a per-channel bias is the third operand."""

    window: Window
    bias: bool


def _conv_rule(args: Sequence[Any], p: ConvParams) -> Aval:
    x, w = args[0], args[1]
    _float_rule_arg("conv2d", "x", x, 4)
    win = p.window
    want = (x.shape[1], win.kh, win.kw)
    if w.ndim != 4 or tuple(w.shape[1:]) != want or x.shape[2:] != (win.h, win.w):
        raise ShapeError(at_site(f"conv2d: x {x.shape} and w {w.shape} do not fit the window "
                                 f"{(win.kh, win.kw)} over planes {(win.h, win.w)}"))
    if len(args) != 2 + p.bias or (p.bias and tuple(args[2].shape) != (w.shape[0],)):
        want_bias = f"a bias of shape {(w.shape[0],)}" if p.bias else "no bias"
        raise ShapeError(at_site(f"conv2d: expected {want_bias}"))
    return Aval((x.shape[0], w.shape[0], win.oh, win.ow), x.dtype)


# The patch gather holds a chunk of KC patch rows of 16 columns in private memory per
# work-item; int indices inside the kernel bound the sizes it takes.
_INT_MAX = (1 << 31) - 1


def _by_product(dev: Device) -> bool:
    """Whether convolutions run as im2col and the product's kernels (as before conv_panel):
    on a GPU. conv_panel and conv_wgrad are written for CPU cores (a work-item per group, a
    16 KiB private chunk each), and have not been measured on a GPU."""
    return dev.is_gpu


def _conv_forward(dev: Device, args: Sequence[AnyTensor], p: ConvParams, aval: Aval
                  ) -> AnyTensor:
    """One `conv_panel` launch; im2col then the product on a GPU (`_by_product`), where the
    kernel's int indices would overflow or where there is nothing to sum (no input channel)."""
    x, w = args[0], args[1]
    win = p.window
    n, c = x.shape[0], x.shape[1]
    o = w.shape[0]
    flat = _end_to_end(win)
    if flat is not None:
        x, w, win = x.with_shape((n, c, 1, flat.w)), w.with_shape((o, c, 1, flat.kw)), flat
    k = c * win.kh * win.kw
    s = win.oh * win.ow
    bias = (args[2].buffer, _linalg.ROW_BIAS) if p.bias else (None, _linalg.NO_BIAS)
    if (k == 0 or _by_product(dev)
            or max(x.size, math.prod(aval.shape), w.size, _panel_columns(n, win) + 32)
            > _INT_MAX):
        cols = _im2col(dev, x, win)
        c2 = _linalg.MATMUL.forward(
            dev, [w.with_shape((o, k)), cols, *args[2:]],
            _linalg.MatmulParams(False, False, bias[1], split=s), Aval((n, o, s), aval.dtype))
        return c2.with_shape(aval.shape)
    out = empty(aval.shape, aval.dtype, dev)
    if _pointwise(win, s):
        # Each image's output is W (O x C) @ its planes (C x HW): the panel kernel reads them
        # in place, where conv_panel's gather added nothing but its cost.
        _linalg.shared_a_product(dev, out, w, (c, 1), x, (o, s, c, n), bias)
    else:
        _panel(dev, out, w, x, win, bias)
    return out


def _pointwise(win: Window, s: int) -> bool:
    """A 1x1 window at stride 1 without padding over planes of whole 16-column panels: the
    convolution is a product per image (`_linalg.shared_a_product`)."""
    return (win.kh == win.kw == 1 and win.sh == win.sw == 1 and win.ph == win.pw == 0
            and s % 16 == 0)


def _end_to_end(win: Window) -> Window | None:
    """The window over each plane's rows laid end to end, where it spans a row whole (kw == w,
    no padding across): one output column, which conv_panel and conv_wgrad pad to 8 (a text
    CNN's window as wide as its embedding), becomes a row of oh. None where it does not, or
    the plane is one row already. The same sums, in the same order."""
    if win.kw != win.w or win.pw or win.h == 1:
        return None
    return Window(1, win.h * win.w, 1, win.kh * win.w, 1, win.sh * win.w, 0, win.ph * win.w)


def _panel_columns(n: int, win: Window) -> int:
    """conv_panel's columns over n images: each output row padded to whole halves of 8."""
    return n * win.oh * _linalg.round_up(win.ow, 8)


def _product_g(g: AnyTensor) -> AnyTensor:
    """An output cotangent (n, o, oh, ow) as the product's (o, n*oh*ow), one transposing
    copy: the layout of w @ cols, for the fallbacks that run the product."""
    n, o, oh, ow = g.shape
    s = oh * ow
    return strided_gather(g, (o, n, s), [s, o * s, 1]).with_shape((o, n * s))


def _direct(win: Window) -> bool:
    """Whether `_panel` reads the patches where they lie in x (`conv_direct`, x padded first
    where the window pads it): at stride 1 along a row, with whole groups of 8 outputs."""
    return win.sw == 1 and win.ow % 8 == 0


def _padded(dev: Device, x: AnyTensor, win: Window) -> AnyTensor:
    """x with its planes zero-padded by the window's (ph, pw): one `pad_planes` launch (with
    x's pending DAG inside where x is pending: `_fusion.pad_planes`)."""
    n, c = x.shape[0], x.shape[1]
    padded = empty((n, c, win.h + 2 * win.ph, win.w + 2 * win.pw), x.dtype, dev)
    if (x.pending is not None and padded.size
            and pad_planes(x, padded, (win.h, win.w, win.ph, win.pw), _local(dev, n * c))):
        return padded  # x's elementwise DAG (a relu) computed inside the pad
    _launch(dev, x.dtype, "pad_planes", padded,
            [x.buffer, *(np.int64(v) for v in (win.h, win.w, win.ph, win.pw))],
            padded.shape[2] * padded.shape[3], _conv_kernel)
    return padded


def _panel(dev: Device, out: AnyTensor, w: AnyTensor, x: AnyTensor, win: Window,
           bias: tuple[Any, int]) -> None:
    """out = the convolution of x with w (viewed (O, C*kh*kw)) over `win`, plus the bias
    (buffer, mode): one conv_panel launch."""
    if out.size == 0:
        return
    n, c = x.shape[0], x.shape[1]
    o = out.shape[1]
    owp = _linalg.round_up(win.ow, 8)
    ncols = _panel_columns(n, win)
    width = 32 if _linalg.wide_panels(dev, out.dtype) else 16
    rm = _linalg.tile_rows(out.dtype, width)
    base = "conv_panel"
    if _direct(win):
        base = "conv_direct"
        if win.ph or win.pw:
            x = _padded(dev, x, win)
            win = Window(win.h + 2 * win.ph, win.w + 2 * win.pw, win.kh, win.kw, win.sh, 1, 0, 0)
    kernel = _conv_kernel(dev, out.dtype, _linalg.panel_name(base, width))
    panels = -(-ncols // width)
    # As the product's row blocks (each work-item gathers its chunks once for all its rows).
    rb = _linalg.row_blocks(-(-o // rm), panels)
    dev.launch(kernel, (panels, -(-o // (rm * rb)), 1), (1, 1, 1), out.buffer, w.buffer,
               x.buffer, o, c * win.kh * win.kw, ncols, rm * rb, _linalg.KC[out.dtype], c,
               win.h, win.w, win.kh, win.kw, win.sh, win.sw, win.ph, win.pw, win.oh, win.ow,
               owp, x.size, *bias)


# The flipped convolution's rows are x's channels, RM to a tile: below 8 they waste most of
# it (1 channel: 3.5x col2im's time, 6: 2x; 8: 0.84-0.99x, 16 and more: 0.53-1.03x). Without
# padding it multiplies g's zero border too, H*W/(OH*OW) times the product's work (1.36: 0.86x
# col2im's time; 2.25: 2x). Figures: BENCHMARKS "Session 17".
DGRAD_MIN_CHANNELS = 8
DGRAD_MAX_EXTRA = 1.5


def _dgrad_rule(args: Sequence[Any], p: Window) -> Aval:
    g, w = args
    _float_rule_arg("conv2d_input_grad", "g", g, 4)
    _float_rule_arg("conv2d_input_grad", "w", w, 4)
    if g.shape[1] != w.shape[0] or g.shape[2:] != (p.oh, p.ow) or w.shape[2:] != (p.kh, p.kw):
        raise ShapeError(at_site(f"conv2d_input_grad: g {g.shape} and w {w.shape} do not fit "
                                 f"the window {(p.kh, p.kw)} over planes {(p.h, p.w)}"))
    return Aval((g.shape[0], w.shape[1], p.h, p.w), g.dtype)


def _dgrad_forward(dev: Device, args: Sequence[AnyTensor], p: Window, aval: Aval
                   ) -> AnyTensor:
    """A 1x1 window at stride 1 without padding (`_pointwise`), on a CPU: a product per image.
    At stride 1 with padding below the kernel's size, on a CPU, for x with DGRAD_MIN_CHANNELS
    channels and padding enough that little of g's zero border is summed: the convolution of
    g, zero-padded by (kh-1-ph, kw-1-pw), with the weight flipped and its channels swapped
    (`conv_flip`, then `_panel`), then `conv_dgrad_fix`, which computes the planes of the
    channels whose weights hold a NaN or inf again, term by term.
    Else col2im(w^T g), as for the product w @ cols: the patch matrix's cotangent, then its
    sums (im2col's adjoint)."""
    g, w = args
    o, c, kh, kw = w.shape
    n = g.shape[0]
    out = empty(aval.shape, aval.dtype, dev)
    if out.size == 0:
        return out
    flat = _end_to_end(p)
    if flat is not None:
        w, p = w.with_shape((o, c, 1, flat.kw)), flat
        kh, kw = 1, flat.kw
    flipped = Window(p.oh, p.ow, kh, kw, 1, 1, kh - 1 - p.ph, kw - 1 - p.pw)
    too_big = max(g.size, out.size, w.size, _panel_columns(n, flipped) + 16) > _INT_MAX
    if _pointwise(p, p.oh * p.ow) and not _by_product(dev) and g.size and not too_big:
        # A 1x1 window: each image's cotangent is W^T (C x O, read in place) @ its g (O x
        # HW), every term of col2im's sums and no padding to fix.
        _linalg.shared_a_product(dev, out, w, (1, c), g, (c, p.oh * p.ow, o, n))
        return out
    if (p.sh != 1 or p.sw != 1 or flipped.ph < 0 or flipped.pw < 0 or g.size == 0
            or c < DGRAD_MIN_CHANNELS or p.h * p.w > DGRAD_MAX_EXTRA * p.oh * p.ow
            or _by_product(dev) or too_big):
        cols = _linalg.MATMUL.forward(dev, [w.with_shape((o, c * kh * kw)), _product_g(g)],
                                      _linalg.MatmulParams(True, False),
                                      Aval(_cols_shape(c, n, p), aval.dtype))
        return _col2im(dev, cols, n, c, p).with_shape(aval.shape)
    wf = empty((w.size + c,), w.dtype, dev)  # (c, o, kh, kw), then a flag per channel
    dev.launch(_conv_kernel(dev, w.dtype, "conv_flip"), launch_size(c), (LOCAL,), wf.buffer,
               w.buffer, *(np.int64(v) for v in (o, kh, kw, c)))
    _panel(dev, out, wf, g, flipped, (None, _linalg.NO_BIAS))
    _launch(dev, w.dtype, "conv_dgrad_fix", out,
            [g.buffer, w.buffer, wf.buffer, np.int64(c), np.int64(o), *p.args()], p.h * p.w,
            _conv_kernel)
    return out


def _dgrad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: Window,
               needs: Sequence[bool]) -> list[Any]:
    # Bilinear in (g, w): for g, conv2d's forward map (its adjoint's adjoint) on h; for w, the
    # weight gradient of that convolution, h its input and g its output's cotangent.
    g, w = args
    return [e.apply(CONV, [h, w], ConvParams(p, False)) if needs[0] else None,
            e.apply(CONV_WGRAD, [g, h], p) if needs[1] else None]


CONV_DGRAD: Primitive[Window] = register(Primitive(
    "conv2d_input_grad", _dgrad_rule, _dgrad_forward, _dgrad_vjp,
    doc="conv2d's input gradient from the output's cotangent g and the weight: at stride 1, "
        "conv_panel over g with the weight flipped (terms only where col2im has them); else "
        "col2im(w^T g)."))


def _conv_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: ConvParams,
              needs: Sequence[bool]) -> list[Any]:
    x, w = args[0], args[1]
    parts: list[Any] = [None, None]
    if p.bias:  # first, as the product's: g then dies sooner beside the other two
        parts.append(e.apply(SUM, [g], ReduceParams((0, 2, 3), False)) if needs[2] else None)
    if needs[0]:
        parts[0] = e.apply(CONV_DGRAD, [g, w], p.window)
    if needs[1]:
        parts[1] = e.apply(CONV_WGRAD, [g, x], p.window)
    return parts


CONV: Primitive[ConvParams] = register(Primitive(
    "conv2d", _conv_rule, _conv_forward, _conv_vjp,
    doc="2-D cross-correlation of NCHW x with w (out, in, kh, kw), plus a per-channel bias: "
        "one kernel gathering x's patches as it multiplies (no patch matrix)."))


def _wgrad_rule(args: Sequence[Any], p: Window) -> Aval:
    g, x = args
    _float_rule_arg("conv2d_weight_grad", "x", x, 4)
    _float_rule_arg("conv2d_weight_grad", "g", g, 4)
    if x.shape[2:] != (p.h, p.w) or g.shape[0] != x.shape[0] or g.shape[2:] != (p.oh, p.ow):
        raise ShapeError(at_site(f"conv2d_weight_grad: g {g.shape} and x {x.shape} do not fit "
                                 f"the window {(p.kh, p.kw)} over planes {(p.h, p.w)}"))
    return Aval((g.shape[1], x.shape[1], p.kh, p.kw), x.dtype)


def _wgrad_forward(dev: Device, args: Sequence[AnyTensor], p: Window, aval: Aval) -> AnyTensor:
    """x zero-padded (`pad_planes`, where there is padding), g packed in panels of 16 channels
    per image (mm_pack), then one `conv_wgrad` launch; on a GPU (`_by_product`), g as the
    product's (O, N*OH*OW) times im2col's patch matrix transposed."""
    g, x = args
    o, c = aval.shape[0], aval.shape[1]
    n, s = x.shape[0], p.oh * p.ow
    out = empty(aval.shape, aval.dtype, dev)
    if out.size == 0:
        return out
    flat = _end_to_end(p)
    if flat is not None:
        x, p = x.with_shape((n, c, 1, flat.w)), flat
    if g.size == 0:  # no output positions: nothing summed
        fill_into(out, 0.0)
        return out
    if _by_product(dev):
        cols = _im2col(dev, x, p)
        dw = _linalg.MATMUL.forward(dev, [_product_g(g), cols], _linalg.MatmulParams(False, True),
                                    Aval((o, c * p.kh * p.kw), aval.dtype))
        return dw.with_shape(aval.shape)
    if p.ph or p.pw:
        x = _padded(dev, x, p)
    rows = c * p.kh * p.kw
    if o <= FEW_CHANNELS and p.sw == 1:
        kernel = _conv_kernel(dev, aval.dtype, f"conv_wgrad_few{o}")
        rm = _few_rows(aval.dtype, o)
        dev.launch(kernel, (-(-rows // rm),), (1,), out.buffer, g.buffer, x.buffer, c,
                   x.shape[2], x.shape[3], p.kh, p.kw, p.sh, p.oh, p.ow, n,
                   _linalg.KC[aval.dtype])
        return out
    packed = _linalg.pack_panels(g, (n, s, o), (o * s, 1, s))
    name = _wgrad_name(dev, aval.dtype)
    kernel = _conv_kernel(dev, aval.dtype, name)
    dev.launch(kernel, (-(-o // 16), -(-rows // _wgrad_rows(name, aval.dtype)), 1), (1, 1, 1),
               out.buffer, packed.buffer, x.buffer, o, c, x.shape[2], x.shape[3], p.kh, p.kw,
               p.sh, p.sw, p.oh, p.ow, n, _linalg.KC[aval.dtype])
    return out


def _wgrad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: Window,
               needs: Sequence[bool]) -> list[Any]:
    # Bilinear in (g, x): for g, the convolution of x with h; for x, conv2d's input gradient
    # with h as the weight and g as the output's cotangent.
    g, x = args
    return [e.apply(CONV, [x, h], ConvParams(p, False)) if needs[0] else None,
            e.apply(CONV_DGRAD, [g, h], p) if needs[1] else None]


CONV_WGRAD: Primitive[Window] = register(Primitive(
    "conv2d_weight_grad", _wgrad_rule, _wgrad_forward, _wgrad_vjp,
    doc="conv2d's weight gradient from the output's cotangent g and the input x: one product "
        "over the output positions, patches read from (padded) x in place."))


# --- pooling primitives ----------------------------------------------------------------------


def _pool_rule(op: str) -> Any:
    def rule(args: Sequence[Any], p: Window) -> Aval:
        (x,) = args
        _float_rule_arg(op, "x", x, 4)
        if x.shape[2:] != (p.h, p.w):
            raise ShapeError(at_site(f"{op}: x has planes {x.shape[2:]}, the window expects "
                                     f"{(p.h, p.w)}"))
        return Aval((*x.shape[:2], p.oh, p.ow), INT64 if op == "max_pool2d_argmax"
                    else x.dtype)
    return rule


def _pool_forward(name: str) -> Any:
    def forward(dev: Device, args: Sequence[AnyTensor], p: Window, aval: Aval) -> AnyTensor:
        (x,) = args
        out = empty(aval.shape, aval.dtype, dev)
        _launch(dev, x.dtype, name, out, [x.buffer, *p.args()], p.oh * p.ow)
        return out
    return forward


# The window maxima that max_pool2d_argmax writes beside their positions, kept by the positions
# tensor until pool_gather reads that very x at them: it takes the maxima instead of a launch
# of its own (max_pool2d: one kernel, not two). An entry dies with its positions.
_MAXIMA: weakref.WeakKeyDictionary[AnyTensor, tuple[AnyTensor, AnyTensor]] = (
    weakref.WeakKeyDictionary())


def _is_2x2(p: Window) -> bool:
    """Whether `max_pool2x2_argmax` computes this window (`FAST_2X2` off: never, for tests)."""
    return FAST_2X2 and p.kh == p.kw == p.sh == p.sw == 2 and p.ph == p.pw == 0


FAST_2X2 = True


def _argmax_forward(dev: Device, args: Sequence[AnyTensor], p: Window, aval: Aval
                    ) -> AnyTensor:
    (x,) = args
    out = empty(aval.shape, aval.dtype, dev)
    maxima = empty(aval.shape, x.dtype, dev)
    name = "max_pool2x2_argmax" if _is_2x2(p) else "max_pool2d_argmax"
    _launch(dev, x.dtype, name, out, [maxima.buffer, x.buffer, *p.args()], p.oh * p.ow)
    _MAXIMA[out] = (x, maxima)
    return out


MAX_POOL_ARGMAX: Primitive[Window] = register(Primitive(
    "max_pool2d_argmax", _pool_rule("max_pool2d_argmax"), _argmax_forward, None,
    doc="int64 position (y*W + x in its plane) of each window's first maximum, or its last "
        "NaN (as PyTorch)."))


def _avg_grad_rule(args: Sequence[Any], p: Window) -> Aval:
    (g,) = args
    _float_rule_arg("avg_pool2d_grad", "g", g, 4)
    if g.shape[2:] != (p.oh, p.ow):
        raise ShapeError(at_site(f"avg_pool2d_grad: g has planes {g.shape[2:]}, expected "
                                 f"{(p.oh, p.ow)}"))
    return Aval((*g.shape[:2], p.h, p.w), g.dtype)


def _avg_grad_forward(dev: Device, args: Sequence[AnyTensor], p: Window, aval: Aval
                      ) -> AnyTensor:
    (g,) = args
    out = empty(aval.shape, aval.dtype, dev)
    _launch(dev, aval.dtype, "avg_pool2d_grad", out, [g.buffer, *p.args()], p.h * p.w)
    return out


AVG_POOL, AVG_POOL_GRAD = transposes(
    LinearOp("avg_pool2d", _pool_rule("avg_pool2d"), _pool_forward("avg_pool2d"),
             "Window means over zero padding, divided by kh*kw (count_include_pad=True)."),
    LinearOp("avg_pool2d_grad", _avg_grad_rule, _avg_grad_forward,
             "The adjoint of avg_pool2d: each input element sums g/(kh*kw) over its windows."))


def _check_at(op: str, at: Any, lead: Shape, p: Window) -> None:
    want = (*lead, p.oh, p.ow)
    if at.dtype != INT64 or tuple(at.shape) != want:
        raise ShapeError(at_site(f"{op}: positions must be int64 of shape {want}, got "
                                 f"{dtype_name(at.dtype)} of shape {at.shape}"))


def _gather_rule(args: Sequence[Any], p: Window) -> Aval:
    x, at = args
    _float_rule_arg("pool_gather", "x", x, 4)
    if tuple(x.shape[2:]) != (p.h, p.w):
        raise ShapeError(at_site(f"pool_gather: x has planes {x.shape[2:]}, the window "
                                 f"expects {(p.h, p.w)}"))
    _check_at("pool_gather", at, x.shape[:2], p)
    return Aval(tuple(at.shape), x.dtype)


def _gather_forward(dev: Device, args: Sequence[AnyTensor], p: Window, aval: Aval
                    ) -> AnyTensor:
    x, at = args
    found = _MAXIMA.pop(at, None)
    if found is not None and found[0] is x:  # written by the argmax kernel (see _MAXIMA)
        return found[1]
    out = empty(aval.shape, aval.dtype, dev)
    _launch(dev, aval.dtype, "pool_gather", out,
            [x.buffer, at.buffer, np.int64(p.h * p.w), np.int64(p.oh * p.ow)])
    return out


def _scatter_rule(args: Sequence[Any], p: Window) -> Aval:
    g, at = args
    _float_rule_arg("pool_scatter", "g", g, 4)
    if tuple(g.shape[2:]) != (p.oh, p.ow):
        raise ShapeError(at_site(f"pool_scatter: g has planes {g.shape[2:]}, expected "
                                 f"{(p.oh, p.ow)}"))
    _check_at("pool_scatter", at, g.shape[:2], p)
    return Aval((*g.shape[:2], p.h, p.w), g.dtype)


def _scatter_forward(dev: Device, args: Sequence[AnyTensor], p: Window, aval: Aval
                     ) -> AnyTensor:
    g, at = args
    out = empty(aval.shape, aval.dtype, dev)
    _launch(dev, aval.dtype, "pool_scatter", out, [g.buffer, at.buffer, *p.args()], p.h * p.w)
    return out


POOL_GATHER, POOL_SCATTER = transposes(
    LinearOp("pool_gather", _gather_rule, _gather_forward,
             "x at the int64 window positions (from max_pool2d_argmax): the max pool's values."),
    LinearOp("pool_scatter", _scatter_rule, _scatter_forward,
             "The adjoint of pool_gather: each input element sums g over the windows that "
             "chose it, in a fixed order (no atomics)."))


# --- the public ops --------------------------------------------------------------------------

Pair = int | Sequence[int]


def _pair(op: str, name: str, value: object, low: int) -> tuple[int, int]:
    """An int or a pair of ints, each at least `low`, as a pair."""
    single = is_integer(value)
    items: list[object] = (
        [value, value] if single
        else list(cast(Sequence[object], value)) if isinstance(value, tuple | list)
        else [])
    ints = [n for n in map(integer, items) if n is not None]
    if len(items) != 2 or len(ints) != 2:
        typed = (single or isinstance(value, tuple | list)) and len(ints) == len(items)
        wrong = ShapeError if typed else ArgumentTypeError  # a wrong length, or a wrong type
        raise wrong(at_site(f"{op}: {name} must be an int or a pair of ints, got {shown(value)}"))
    if min(ints) < low:
        raise ShapeError(at_site(f"{op}: {name} must be at least {low}, got {shown(value)}"))
    return ints[0], ints[1]


def _check_float(op: str, name: str, x: Id) -> None:
    if not is_float(x.dtype):
        raise DTypeError(at_site(f"{op}: {name} has dtype {dtype_name(x.dtype)}, expected "
                                 "float32 or float64"))


def _check_input(op: str, tape: Tape, x: Id) -> None:
    tape.node(x, op, "x")
    _check_float(op, "x", x)
    if x.ndim not in (3, 4):
        raise ShapeError(at_site(f"{op}: x must be (N, C, H, W) or unbatched (C, H, W), got "
                                 f"shape {x.shape}"))


def _window(op: str, x: Id, kernel: tuple[int, int], stride: tuple[int, int],
            padding: tuple[int, int]) -> Window:
    h, w = x.shape[-2:]
    win = Window(h, w, kernel[0], kernel[1], stride[0], stride[1], padding[0], padding[1])
    if win.oh < 1 or win.ow < 1:
        raise ShapeError(at_site(
            f"{op}: the kernel {kernel} is larger than the padded input "
            f"{(h + 2 * padding[0], w + 2 * padding[1])} (x has shape {x.shape}, padding "
            f"{padding})"))
    return win


def _batched(tape: Tape, x: Id) -> tuple[Tape, Id]:
    return (tape, x) if x.ndim == 4 else _shape.reshape(tape, x, (1, *x.shape))


def _unbatched(tape: Tape, y: Id, was: Id) -> tuple[Tape, Id]:
    return (tape, y) if was.ndim == 4 else _shape.reshape(tape, y, y.shape[1:])


@takes_tape
def conv2d(tape: Tape, x: Id, w: Id, b: Id | None = None, stride: Pair = 1, padding: Pair = 0
           ) -> tuple[Tape, Id]:
    """2-D cross-correlation as PyTorch's `F.conv2d` (no groups, no dilation).

    x: (N, C, H, W), or (C, H, W) unbatched; w: (O, C, kh, kw); b: (O,) or None. stride and
    padding are an int or a pair (rows, columns); padding adds zeros on both sides. The output
    is (N, O, OH, OW) with OH = (H + 2*ph - kh) // sh + 1, likewise OW.
    """
    op = "conv2d"
    _check_input(op, tape, x)
    tape.node(w, op, "w")
    _check_float(op, "w", w)
    if w.ndim != 4:
        raise ShapeError(at_site(f"{op}: w must be 4-D (out, in, kh, kw), got shape {w.shape}"))
    if w.dtype != x.dtype:
        raise DTypeError(at_site(f"{op}: x is {dtype_name(x.dtype)} but w is "
                                 f"{dtype_name(w.dtype)}; convert one with tg.astype"))
    c = x.shape[-3]
    o, wc, kh, kw = w.shape
    if c != wc:
        raise ShapeError(at_site(f"{op}: x has {c} channels (x.shape[{x.ndim - 3}]) but w "
                                 f"expects {wc} (w.shape[1]); w is (out, in, kh, kw)"))
    if b is not None:
        tape.node(b, op, "b")
        if b.dtype != x.dtype:
            raise DTypeError(at_site(f"{op}: x is {dtype_name(x.dtype)} but b is "
                                     f"{dtype_name(b.dtype)}; convert one with tg.astype"))
        if b.shape != (o,):
            raise ShapeError(at_site(f"{op}: b must have shape ({o},) (one bias per output "
                                     f"channel of w), got {b.shape}"))
    if min(kh, kw) < 1:
        raise ShapeError(at_site(f"{op}: w has an empty kernel, shape {w.shape}"))
    win = _window(op, x, (kh, kw), _pair(op, "stride", stride, 1),
                  _pair(op, "padding", padding, 0))
    tape, x4 = _batched(tape, x)
    tape, y = record(tape, CONV, [x4, w] if b is None else [x4, w, b],
                     ConvParams(win, b is not None))
    return _unbatched(tape, y, x)


def _pool_window(op: str, tape: Tape, x: Id, kernel_size: Pair, stride: Pair | None,
                 padding: Pair) -> Window:
    _check_input(op, tape, x)
    kernel = _pair(op, "kernel_size", kernel_size, 1)
    steps = kernel if stride is None else _pair(op, "stride", stride, 1)
    pads = _pair(op, "padding", padding, 0)
    if pads[0] > kernel[0] // 2 or pads[1] > kernel[1] // 2:
        raise ShapeError(at_site(f"{op}: padding {pads} must be at most half the kernel size "
                                 f"{kernel} (as in PyTorch)"))
    return _window(op, x, kernel, steps, pads)


@takes_tape
def max_pool2d(tape: Tape, x: Id, kernel_size: Pair, stride: Pair | None = None,
               padding: Pair = 0) -> tuple[Tape, Id]:
    """Window maxima of (N, C, H, W) or (C, H, W) input, as PyTorch's `F.max_pool2d`.

    kernel_size, stride (default: kernel_size) and padding are an int or a pair; padding is
    -inf and at most half the kernel. The gradient goes to the first maximum of each window in
    window order (rows, then columns), as PyTorch; a NaN in a window is its maximum (the last
    NaN, as PyTorch's CPU kernel takes it). Records
    the window positions as an int64 node, then the values; one kernel writes both.
    """
    win = _pool_window("max_pool2d", tape, x, kernel_size, stride, padding)
    tape, x4 = _batched(tape, x)
    tape, at = record(tape, MAX_POOL_ARGMAX, [x4], win)
    tape, y = record(tape, POOL_GATHER, [x4, at], win)
    return _unbatched(tape, y, x)


@takes_tape
def avg_pool2d(tape: Tape, x: Id, kernel_size: Pair, stride: Pair | None = None,
               padding: Pair = 0) -> tuple[Tape, Id]:
    """Window means of (N, C, H, W) or (C, H, W) input, as PyTorch's `F.avg_pool2d`.

    kernel_size, stride (default: kernel_size) and padding are an int or a pair; padding is
    zeros, at most half the kernel, and counts in the divisor (count_include_pad=True: every
    window divides by kh*kw).
    """
    win = _pool_window("avg_pool2d", tape, x, kernel_size, stride, padding)
    tape, x4 = _batched(tape, x)
    tape, y = record(tape, AVG_POOL, [x4], win)
    return _unbatched(tape, y, x)

