"""Matrix products.

The primitive is `matmul_t(a, b, ta, tb) = op(a) @ op(b)` on 2-D or equally batched operands,
or (..., m, k) @ (k, n) as one product of the stacked rows (a linear layer over a sequence),
where op transposes when its flag is set. Transposes are strides, so the backward
products (g @ b^T, a^T @ g) record no transpose node; inside one product the kernels pack
operands as BLAS does (B into zero-padded 16-column panels, a transposed A row-major), an
O(kn) or O(mk) copy against the product's O(mnk). The public `matmul` follows numpy's rules
(1-D operands, broadcast batch dims) by reshapes and explicit broadcasts where the operands
are not already one of those forms.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from .._device import LOCAL, Device, current_observer, fp64_pragma, register_family
from .._errors import DTypeError, ShapeError, at_site, call_site
from .._fusion import take_of
from .._kernels import VEC8, VEC16, fill_into, launch_size, strided_gather
from .._primitive import Aval, Emitter, Primitive, register
from .._tape import Id, Tape, record, record_known, takes_tape
from .._tensor import C_TYPES, FLOATS, AnyTensor, DType, dtype_name, empty, is_float
from .broadcast import SUM, ReduceParams, broadcast_shapes, broadcast_to
from .shape import RESHAPE, TRANSPOSE, ReshapeParams, TransposeParams, reshape

# Rows of C per register tile in the panel kernel: 6 x 16 floats (12 vectors of 8) fill AVX2's
# 16 registers; doubles are twice as wide, so they take 3 rows.
ROWS = {np.dtype(np.float32): 6, np.dtype(np.float64): 3}
LOCAL_MM = 8  # work-items per group along columns (fixed: PoCL compiles per local size)
SMALL_TILE_ROWS = 4  # rows of C per mm_small work-item (B's vector loaded once for them)
SMALL_GROUP = 8  # mm_small's work-items per group, down one column of tiles
PACK_MIN_ROWS = 24  # from this many rows of C on, B is packed into panels (see `_product`)
FAR_ROWS = 32 << 10  # ... or from three row blocks on where B's rows are this many bytes apart
PACK_MIN_K = 64  # ... if k is at least this or b's full panels cannot be read in place
# ... unless b's panels can be read in place within one chunk of k and b is at most this: it
# stays in cache, so packing it costs a launch and saves little, and the sums are the same
# (one chunk either way).
PACK_MIN_BYTES = 64 << 10
KC = {np.dtype(np.float32): 256, np.dtype(np.float64): 128}  # k per chunk: 16 KiB of a panel
RB_MAX = 8  # row blocks per work-item in the packed path
MIN_GROUPS = 8  # work-groups wanted at least (2 cores), before row blocks are merged
SMALL_PRODUCT = 1 << 16  # multiply-adds up to which tail columns are computed at any strides
# A^T over k > KC is packed row-major from this many elements on: below, read in place is
# faster (64 x 512: 152 against 194 us, 256 x 2048: 2178 against 2470; BENCHMARKS session 17).
AT_PACK_MIN = 1 << 20
A_BLOCKS_MIN_K = 128  # k from which the wide tiles read A^T as blocks of 8 rows (`mm_pack_a`)
A_BLOCKS_MIN_STRIDE = 512  # ... where A^T's k steps are this many bytes apart or more


def panel_tiles(rm: int, chunk: str, b_chunk: str, b_step: str, half: int = 8,
                a_block: str = "", b_loads: str = "") -> str:
    """The part of the panel kernels after their setup: for each chunk of k (`kc`), the code
    `chunk` (nothing for mm_panel; conv2d's kernel gathers the chunk's patches there), then the
    work-item's RM-row blocks of C over that chunk, B's chunk read from `bp` (`b_chunk` declares
    it, `b_step` moves it one k on). C's halves of 8 columns are added to a tile's registers
    and written through the kernel's macros `TG_HADD(acc, h, o)` and `TG_HSTORE(v, h, o)`, o
    the row's offset.

    The kernel's setup declares rstart, rend, M, K, kc, rs, sam, sak, A, bias, bmode, the
    tile's registers (`tile_registers`) and bc0/bc1, the tile's start without a row bias.
    `half`: the columns of each of a row's two registers (8: panels of 16; 16: `mm_panel32`'s
    panels of 32). `a_block`: the name of the stride between A's blocks of RM rows (row r0 + r
    at A + (r0 / RM) * a_block + r * sam, for A copied into blocks by `mm_pack_a`); without
    it, row i at A + i * sam. `b_loads`, where given, declares b0 and b1 (a row's two
    registers of B at this k) in place of their loads from `bp`."""
    rows = range(rm)
    v = f"T{half}"
    b_loads = b_loads or f"const {v} b0 = TG_LOAD{half}(bp), b1 = TG_LOAD{half}(bp + {half});"
    ptrs = "\n".join(
        f"      __global const T* a{r} = A + (long)(r0 / {rm}) * {a_block} "
        f"+ (long)min({r}, M - 1 - r0) * sam + k0 * sak;" if a_block else
        f"      __global const T* a{r} = A + (long)min(r0 + {r}, M - 1) * sam + k0 * sak;"
        for r in rows)
    col_init = " ".join(f"c{r}0 = bc0; c{r}1 = bc1;" for r in rows)
    row_init = " ".join(
        f"{{ const {v} x = ({v})(bias[min(r0 + {r}, M - 1)]); c{r}0 = x; c{r}1 = x; }}"
        for r in rows)
    zeros = " ".join(f"c{r}0 = ({v})0; c{r}1 = ({v})0;" for r in rows)
    loads = "\n".join(
        f"        {{ const long o = (long)(r0 + min({r}, nr - 1)) * rs; "
        f"TG_HADD(c{r}0, 0, o); TG_HADD(c{r}1, 1, o); }}" for r in rows)
    fmas = tile_fmas(rm, half)
    stores = "\n".join(
        f"      if (nr > {r}) {{ const long o = (long)(r0 + {r}) * rs; "
        f"TG_HSTORE(c{r}0, 0, o); TG_HSTORE(c{r}1, 1, o); }}" for r in rows)
    return f"""
  for (int k0 = 0; k0 < K; k0 += kc) {{
    const int kn = min(kc, K - k0);
{chunk}
    for (int r0 = rstart; r0 < rend; r0 += {rm}) {{
      const int nr = min({rm}, M - r0);
      if (k0 == 0) {{
        if (bmode == 2) {{ {row_init} }} else {{ {col_init} }}
      }} else {{
        {zeros}
      }}
{ptrs}
      {b_chunk};
      for (int k = 0; k < kn; ++k) {{
        {b_loads}
        const long ka = k * sak;
        {b_step};
{fmas}
      }}
      if (k0 != 0) {{  // this chunk's sums, then C's: blocked, as BLAS accumulates
{loads}
      }}
{stores}
    }}
  }}
"""


def tile_fmas(rm: int, half: int = 8) -> str:
    """One k of a panel kernel's tile: row r's broadcast a{r}[ka] times B's 2 * half values
    (b0, b1) added to the tile's row (c{r}0, c{r}1)."""
    v = f"T{half}"
    return "\n".join(
        f"        {{ const {v} x = ({v})(a{r}[ka]); c{r}0 += x * b0; c{r}1 += x * b1; }}"
        for r in range(rm))


def tile_registers(rm: int, half: int = 8) -> str:
    """The declaration of a panel kernel's RM x 2 * half tile of C, as RM pairs of T{half}."""
    return f"T{half} " + ", ".join(f"c{r}0, c{r}1" for r in range(rm)) + ";"


def _panel_kernel(rm: int, half: int = 8) -> str:
    """C = A @ B for A at strides (sam, sak), either way round, and B read as panels of 16
    columns.

    A^T (sam = 1, sak = lda) is read in place when k is at most one chunk (KC) or A^T is below
    AT_PACK_MIN elements: at each k the RM broadcasts come from RM adjacent elements of one row
    of A, where a transposing copy cost ~0.1 ms per 256 x 512 operand (the dW = H^T g products
    of an MLP). Over a longer k of a large A the packed copy wins (1024^3: 87-104 against 78-87
    GFLOP/s in place). A runtime stride costs nothing in the loop: the offset k * sak is one
    induction variable shared by the RM loads. The wide tiles (`mm_panel32`) read A^T from
    k = A_BLOCKS_MIN_K on, its k steps A_BLOCKS_MIN_STRIDE bytes apart or more, as
    `mm_pack_a`'s blocks of 8 rows (sak = 8; `sblk` is the blocks' stride, RM * sam for A in
    place).

    Panel p holds columns 16p..16p+15 of B; element (k, j) of it is at B[p * sbp + k * sbk + j].
    A packed panel (`mm_pack`: sbp = 16 K, sbk = 16) is one contiguous K x 16 block, zero-padded
    past N, so its loads are sequential and a chunk of KC rows of it (16 KiB) stays in L1 while
    the work-item runs down its rows; read in place (sbp = 16, sbk = ldb) only full panels may
    be launched. C's rows are N apart and every panel is stored whole, so N is a multiple of 16
    (`_product` pads C otherwise): no masked loads or stores, whose branches made PoCL's first
    compile of this kernel take 0.8 s instead of 0.2.

    Each work-item owns MR = RM * rb rows of one panel: per chunk of k it walks its RM-row
    blocks, keeping the block's RM x 16 tile of C in registers (per k: two 8-wide loads of B, RM
    broadcasts of A, 2 RM FMAs) and adding the chunk's sums to C between chunks. Summed from 0
    per chunk rather than continuing C's running sum, a float32 product's error grows with the
    chunks, not with k: 64 x 4096 @ 4096 x 64 of data around 10 erred 3.3e-6, now 2.8e-7
    (PyTorch 3.4e-7). Rows past M read row M-1 (valid memory) and are never stored, so the k
    loop has no branch.

    `half` 16 makes `mm_panel32`, the same over panels of 32 columns (`mm_pack32`), each row
    of the tile two 16-wide registers: on a CPU whose vectors hold 16 floats (AVX-512) a k
    step is then two loads of B, RM broadcasts and 2 RM full-width FMAs for twice the columns
    (BENCHMARKS, session 22). The same sums in the same order: the same bits. Launched with
    S = 0 only (a half of 16 columns may straddle a block of a split C).
    """
    width = 2 * half
    lanes = ", ".join(f"bias[min(col0 + {j}, nb - 1)]" for j in range(half))
    lanes_hi = ", ".join(f"bias[min(col0 + {j + half}, nb - 1)]" for j in range(half))
    v = f"T{half}"
    name = panel_name("mm_panel", width)
    return f"""
#define TG_HADD(acc, h, o) acc += TG_LOAD{half}((h ? h1 : h0) + (o))
#define TG_HSTORE(v, h, o) TG_STORE{half}(v, (h ? h1 : h0) + (o))
__kernel void {name}(__global T* C, __global const T* A, __global const T* B,
                       const int M, const int N, const int K, const int ncols, const int mr,
                       const int kc, const long sam, const long sak, const long sab,
                       const long sbb, const long sbp, const long sbk,
                       __global const T* bias, const int bmode, const int nb, const int S,
                       const long aoff, const long sblk) {{
  const int p = get_global_id(0), col0 = p * {width}, rstart = get_global_id(1) * mr;
  if (col0 >= ncols || rstart >= M) return;
  const int rend = min(M, rstart + mr);
  const long bat = get_global_id(2);
  A += aoff + bat * sab;
  B += bat * sbb + p * sbp;
  C += bat * (long)M * N;
  // Element (i, j) of C is at C[i * N + j], or with S (a multiple of 8) at
  // C[(j / S) * M * S + i * S + j % S]: each half of the panel, 8 columns, is contiguous.
  const long rs = S ? S : N;
  __global T* h0 = C + (S ? (long)(col0 / S) * M * S + col0 % S : col0);
  __global T* h1 = C + (S ? (long)((col0 + {half}) / S) * M * S + (col0 + {half}) % S
                          : col0 + {half});
  {tile_registers(rm, half)}
  // The tile starts from the bias (none: 0): per column (bmode 1, nb entries, clamped past
  // the last for a padded C) or per row (bmode 2).
  {v} bc0 = 0, bc1 = 0;
  if (bmode == 1) {{ bc0 = ({v})({lanes}); bc1 = ({v})({lanes_hi}); }}
{panel_tiles(rm, "", "__global const T* bp = B + k0 * sbk", "bp += sbk", half, "sblk")}}}
#undef TG_HADD
#undef TG_HSTORE
"""


def _source(dtype: DType) -> str:
    """Barrier-free kernels: each work-item keeps a tile of C in vector registers.

    PoCL runs local-memory tiles with barriers poorly on CPUs; register tiles over contiguous
    vector loads let it emit wide FMAs. From `PACK_MIN_ROWS` rows of C on, op(B) is first packed
    into contiguous zero-padded panels (`mm_pack`), as BLAS packs: read in place, a 16-column
    strip of B is K rows at a stride of N (4 KiB at N = 1024, so its lines collide in L1) and is
    streamed again for every RM rows of C. Fewer rows read B in place, picking the kernel by
    which operand is contiguous along which axis (see `_product`); transposes are only strides.

    The `vload8`/`vstore8`/`fma` builtins are out-of-line calls in PoCL's CPU kernel library, and
    a call in the inner loop spills every accumulator to the stack (measured: 9 against 40-80
    GFLOP/s at 512^3). Vectors are therefore built from scalar loads, which LLVM merges into one
    unaligned vector load, and `c += a * b` is contracted to an FMA (FP_CONTRACT ON).
    """
    t = C_TYPES[dtype]
    types = "".join(f"typedef {t}{w} T{w};\n" for w in ("", "2", "4", "8"))
    return (fp64_pragma(dtype) + types + """
#pragma OPENCL FP_CONTRACT ON
""" + VEC8 + _panel_kernel(ROWS[dtype]) + """
""" + _pack_kernel(16) + _wide_kernels(dtype) + """
// The sum of v's lanes, halving: (lo + hi), then again, in this order. A macro: a function
// taking a double8 by value makes clang warn that the call's ABI changes without AVX-512.
#define TG_HSUM8(v) \\
  ((((v).s0 + (v).s4) + ((v).s2 + (v).s6)) + (((v).s1 + (v).s5) + ((v).s3 + (v).s7)))

// A loop kept rolled (clang's pragma; another compiler, a GPU driver's, would warn of it).
#ifdef __clang__
#define TG_ROLLED _Pragma("clang loop unroll(disable)")
#else
#define TG_ROLLED
#endif
// C's element (row, col), batch-major in blocks of S columns where S is set (see `split`).
#define TG_SMALL_STORE(row, col, value) \\
  C[S ? (long)((col) / S) * M * S + (long)(row) * S + (col) % S \\
      : bat * (long)M * N + (long)(row) * N + (col)] = (value)
""" + _small_kernel(8) + _small_kernel(4) + """
#undef TG_SMALL_STORE
#undef TG_ROLLED
""" + _dot_kernel("mm_dot", 2, 8) + (
        "#ifdef TG_WIDE\n" + _dot_kernel("mm_dot16", DOT16_ROWS, 16) + "#endif\n"
        if dtype == np.float32 else "") + """
""")


def _small_kernel(width: int) -> str:
    """`mm_small8` or `mm_small4`: columns col_base.. of C = A @ B at any strides, a tile of
    SMALL_TILE_ROWS rows by `width` adjacent columns per work-item, for products too small to
    pay for a transposing copy of an operand (a launch) before mm_dot. Each element sums k in
    order from its bias, as one work-item per element would: where B's row is contiguous the
    tile takes a vector FMA per row (the same rounding per lane; B's vector is loaded once for
    the rows, rows past M read row M - 1 and are not stored), else (strided columns, the last
    partial tile) an element at a time."""
    rows = SMALL_TILE_ROWS
    vec = f"T{width}"
    lanes = ", ".join(f"bk[{j}]" for j in range(width))
    a_rows = "".join(f"  __global const T* a{r} = A + aoff + bat * sab + "
                     f"(long)min(row0 + {r}, M - 1) * sam;\n" for r in range(rows))
    bias_lanes = ", ".join(f"bias[col0 + {j}]" for j in range(width))
    starts = (f"    {vec} start = ({vec})0;\n"
              f"    if (bmode == 1) start = ({vec})({bias_lanes});\n" + "".join(
                  f"    {vec} v{r} = bmode == 2 ? ({vec})bias[min(row0 + {r}, M - 1)] : start;\n"
                  for r in range(rows)))
    steps = "".join(f"      v{r} += a{r}[k * sak] * b_k;\n" for r in range(rows))
    # The tile through a private array, stored by loops kept rolled: unrolled, the stores'
    # address arithmetic (a split C's divisions) made the kernel slower to compile.
    tile = "".join(f"    tile[{r}][{j}] = v{r}.s{j:x};\n"
                   for r in range(rows) for j in range(width))
    stores = (f"    T tile[{rows}][{width}];\n{tile}"
              f"TG_ROLLED\n    for (int r = 0; r < {rows} && row0 + r < M; ++r)\n"
              f"TG_ROLLED\n      for (int j = 0; j < {width}; ++j)\n"
              "        TG_SMALL_STORE(row0 + r, col0 + j, tile[r][j]);\n")
    return f"""
__kernel void mm_small{width}(__global T* C, __global const T* A, __global const T* B,
                        const int M, const int N, const int K, const long sab, const long sam,
                        const long sak, const long sbb, const long sbk, const long sbn,
                        const int col_base, __global const T* bias, const int bmode,
                        const int S, const long aoff) {{
  const int col0 = col_base + get_global_id(0) * {width}, row0 = get_global_id(1) * {rows};
  if (col0 >= N || row0 >= M) return;
  const long bat = get_global_id(2);
  __global const T* b = B + bat * sbb + (long)col0 * sbn;
  const int nc = min({width}, N - col0);
{a_rows}  if (nc == {width} && sbn == 1) {{
{starts}    for (int k = 0; k < K; ++k) {{
      __global const T* bk = b + k * sbk;
      const {vec} b_k = ({vec})({lanes});
{steps}    }}
{stores}  }} else {{
    for (int r = 0; r < {rows} && row0 + r < M; ++r) {{
      __global const T* a = A + aoff + bat * sab + (long)(row0 + r) * sam;
      for (int j = 0; j < nc; ++j) {{
        __global const T* bj = b + j * sbn;
        T s = bmode == 1 ? bias[col0 + j] : bmode == 2 ? bias[row0 + r] : (T)0;
        for (int k = 0; k < K; ++k) s += a[k * sak] * bj[k * sbk];
        TG_SMALL_STORE(row0 + r, col0 + j, s);
      }}
    }}
  }}
}}
"""


def _pack_kernel(width: int) -> str:
    """`mm_pack` (width 16) or `mm_pack32`: op(B) as panels of `width` columns, each K x
    `width` contiguous, zero past N; a work-item per (row of a panel, panel), launched LOCAL
    wide, dimension 1 the batch."""
    name = panel_name("mm_pack", width)
    stores = " ".join(f"TG_STORE8(TG_LOAD8(s + {h}), d + {h});" for h in range(0, width, 8))
    return f"""
// Work-items in turn read B in order, so its reads stream as a copy's: along a row (panels
// fastest) where B's rows are contiguous (sbn 1), each then one {width}-value copy; down the
// columns (rows fastest) else, as for B^T (BENCHMARKS, session 24).
__kernel void {name}(__global T* restrict P, __global const T* restrict B, const int K,
                      const int N,
                      const long sbb, const long sbk, const long sbn) {{
  const long g = get_global_id(0);
  const int panels = (N + {width - 1}) / {width};
  const int p = (int)(sbn == 1 ? g % panels : g / K);
  const long k = sbn == 1 ? g / panels : g % K;
  if (k >= K || p >= panels) return;
  const long bat = get_global_id(1);
  __global const T* s = B + bat * sbb + k * sbk + (long)p * {width} * sbn;
  __global T* d = P + ((bat * panels + p) * K + k) * {width};
  const int nc = min({width}, N - p * {width});
  if (nc == {width} && sbn == 1) {{ {stores} }}
  else for (int j = 0; j < {width}; ++j) d[j] = j < nc ? s[j * sbn] : 0;
}}
"""


def _pack_a_kernel() -> str:
    """`mm_pack_a`: op(A) (m x k) whose rows are contiguous along m (A^T read in place, sam 1)
    as blocks of 8 rows, each K x 8 contiguous, zero past m: block b holds rows 8b..8b+7, row
    i's k-th element at [b * K * 8 + k * 8 + i % 8]. A work-item moves 64 consecutive
    elements of one k (8 blocks' pieces), dimension 1 the batch."""
    stores = " ".join(f"TG_STORE8(TG_LOAD8(s + {8 * j}), d + {j} * step);" for j in range(8))
    return f"""
__kernel void mm_pack_a(__global T* restrict P, __global const T* restrict A, const int K,
                        const int M, const long sab, const long sak) {{
  const int g = get_global_id(0), blocks = (M + 7) / 8, groups = (blocks + 7) / 8;
  const int grp = g / K, k = g % K;
  if (grp >= groups) return;
  const long bat = get_global_id(1), step = (long)K * 8;
  __global const T* s = A + bat * sab + k * sak + grp * 64;
  __global T* d = P + (bat * blocks + grp * 8) * step + (long)k * 8;
  if (grp * 64 + 64 <= M) {{ {stores} }}
  else for (int j = 0; j < min(8, blocks - grp * 8); ++j)
    for (int i = 0; i < 8; ++i) d[j * step + i] = grp * 64 + j * 8 + i < M ? s[j * 8 + i] : 0;
}}
"""


# Rows of a wide tile (`mm_panel32`: RM x 32 as 2 RM float16 registers of the 32 an AVX-512
# core has).
WIDE_ROWS = 8
DOT16_ROWS = 4  # rows of C per work-item of mm_dot16 (2 x 4 columns of 16 lanes were load-bound)


def panel_name(base: str, width: int) -> str:
    """A panel kernel's name at `width` columns: `base` at 16 (mm_panel), base + "32" at 32."""
    return base if width == 16 else f"{base}{width}"


def tile_rows(dtype: DType, width: int) -> int:
    """Rows of C in a panel kernel's tile at `width` columns."""
    return ROWS[dtype] if width == 16 else WIDE_ROWS


def _dot_kernel(name: str, rows: int, lanes: int) -> str:
    """`mm_dot` (8 lanes, 2 rows) or `mm_dot16` (16 lanes, DOT16_ROWS rows, float32 where
    vectors hold 16 floats: built with TG_WIDE only): C = A @ B where A's rows and B's columns
    are contiguous along k (sak == 1, sbk == 1), as in g @ W^T or the tail columns of other
    products (copied so), as dot products `lanes` k at a time. One work-item:
    `rows` rows x 4 columns; 16 lanes are folded to 8 (lo + hi) before the last 8 k, then
    summed as eight."""
    rs, cs = range(rows), range(4)
    acc = [f"s{r}{c}" for r in rs for c in cs]
    a_ptrs = "\n".join(f"  __global const T* a{r} = A + (long)min(row0 + {r}, M - 1) * sam;"
                       for r in rs)
    loads = "\n    ".join([f"const T{lanes} x{r} = TG_LOAD{lanes}(a{r} + k);" for r in rs]
                          + [f"const T{lanes} y{c} = TG_LOAD{lanes}(b{c} + k);" for c in cs])

    def products(acc: str) -> str:  # each accumulator acc{r}{c} += row r times column c
        return "\n    ".join(" ".join(f"{acc}{r}{c} += x{r} * y{c};" for c in cs) for r in rs)

    fmas = products("s")
    loads8 = loads.replace(f"T{lanes}", "T8").replace(f"TG_LOAD{lanes}", "TG_LOAD8")
    fmas8 = products("e")
    fold = (" ".join(f"T8 e{r}{c} = s{r}{c}.lo + s{r}{c}.hi;" for r in rs for c in cs)
            if lanes == 16 else " ".join(f"T8 e{r}{c} = s{r}{c};" for r in rs for c in cs))
    eight = (f"""
  for (; k + 8 <= K; k += 8) {{
    {loads8}
    {fmas8}
  }}""" if lanes == 16 else "")
    sums = ", ".join(f"TG_HSUM8(e{r}{c})" for r in rs for c in cs)
    tail = (" ".join(f"const T x{r} = a{r}[k];" for r in rs) + " "
            + " ".join(f"const T y{c} = b{c}[k];" for c in cs) + " "
            + " ".join(f"r[{r * 4 + c}] += x{r} * y{c};" for r in rs for c in cs))
    return f"""
__kernel void {name}(__global T* C, __global const T* A, __global const T* B,
                     const int M, const int N, const int K,
                     const long sab, const long sam, const long sbb, const long sbn,
                     const int col_base, __global const T* bias, const int bmode,
                     const long aoff) {{
  const int col0 = col_base + get_global_id(0) * 4, row0 = get_global_id(1) * {rows};
  if (col0 >= N || row0 >= M) return;
  const long bat = get_global_id(2);
  A += aoff + bat * sab;
  B += bat * sbb;
  C += bat * (long)M * N;
{a_ptrs}
  // B holds B^T rows from column col_base on: row j of it is column col_base + j of op(B).
  __global const T* b0 = B + (long)(col0 - col_base) * sbn;
  __global const T* b1 = B + (long)(min(col0 + 1, N - 1) - col_base) * sbn;
  __global const T* b2 = B + (long)(min(col0 + 2, N - 1) - col_base) * sbn;
  __global const T* b3 = B + (long)(min(col0 + 3, N - 1) - col_base) * sbn;
  T{lanes} {" = 0, ".join(acc)} = 0;
  int k = 0;
  for (; k + {lanes} <= K; k += {lanes}) {{
    {loads}
    {fmas}
  }}
  {fold}{eight}
  T r[{rows * 4}] = {{{sums}}};
  for (; k < K; ++k) {{ {tail} }}
  const int rows = min({rows}, M - row0), cols = min(4, N - col0);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) {{
      const T v = r[i * 4 + j];
      C[(long)(row0 + i) * N + col0 + j] =
          bmode == 1 ? v + bias[col0 + j] : bmode == 2 ? v + bias[row0 + i] : v;
    }}
}}
"""


def _wide_kernels(dtype: DType) -> str:
    """`mm_panel32` and `mm_pack32` (see `_panel_kernel`), float32's only, in the program of
    the other product kernels: a program of their own cost a cold first step a build, where
    these add a fraction of one to the program built anyway (BENCHMARKS, session 22)."""
    if dtype != np.float32:
        return ""
    return VEC16 + _panel_kernel(WIDE_ROWS, 16) + _pack_kernel(32) + _pack_a_kernel()


def wide_panels(dev: Device, dtype: DType) -> bool:
    """Whether products of `dtype` on `dev` take panels of 32 columns: float32 on a device
    whose native vectors hold 16 floats (a CPU with AVX-512)."""
    return dtype == np.float32 and not dev.is_gpu and dev.native_floats >= 16


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# How a third operand, the bias, is added to the product (`MatmulParams.bias`): none, one per
# column of C (a linear layer's, shape (n,)) or one per row (a convolution's, shape (m,)).
NO_BIAS, COLUMN_BIAS, ROW_BIAS = 0, 1, 2


@dataclass(frozen=True, slots=True)
class MatmulParams:
    """Flags of one product: `ta`/`tb` transpose a/b; `bias` (see NO_BIAS...); `split` S > 0
    (2-D only) writes C (m, n) batch-major as (n // S, m, S): a convolution's W @ cols lands in
    NCHW with no transposing copy."""

    ta: bool
    tb: bool
    bias: int = NO_BIAS
    split: int = 0


def _dims(shape: tuple[int, ...], transposed: bool) -> tuple[int, int]:
    rows, cols = shape[-2], shape[-1]
    return (cols, rows) if transposed else (rows, cols)


def stacks_rows(a_ndim: int, b_ndim: int, p: MatmulParams) -> bool:
    """Whether a product is (..., m, k) @ (k, n) with a of 3 or more dims: its rows stacked
    into one 2-D product (a linear layer over a sequence), no broadcast copy of b."""
    return b_ndim == 2 and a_ndim > 2 and not p.ta


def _rule(args: Sequence[Any], p: MatmulParams) -> Aval:
    if len(args) != (3 if p.bias else 2):
        raise ShapeError(f"matmul_t: takes {3 if p.bias else 2} operands, got {len(args)}")
    a, b = args[0], args[1]
    rows = stacks_rows(a.ndim, b.ndim, p)
    if not rows and (a.ndim != b.ndim or a.ndim < 2 or a.shape[:-2] != b.shape[:-2]):
        raise ShapeError(f"matmul_t: operands {a.shape} and {b.shape} must be 2-D, equally "
                         "batched, or (..., m, k) and 2-D")
    m, k = _dims(a.shape, p.ta)
    k2, n = _dims(b.shape, p.tb)
    if k != k2:
        raise ShapeError(at_site(f"matmul: inner sizes differ: {k} vs {k2}"))
    if p.bias:
        want = (n if p.bias == COLUMN_BIAS else m,)
        bias = args[2]
        if ((a.ndim != 2 and not (rows and p.bias == COLUMN_BIAS))
                or tuple(bias.shape) != want or bias.dtype != a.dtype):
            raise ShapeError(f"matmul_t: a bias of a 2-D product must be {want} "
                             f"{dtype_name(a.dtype)}, got {bias.shape} {dtype_name(bias.dtype)}")
    if p.split:
        if a.ndim != 2 or n % p.split:
            raise ShapeError(f"matmul_t: split {p.split} needs a 2-D product with n a multiple "
                             f"of it, got n = {n}")
        return Aval((n // p.split, m, p.split), a.dtype)
    return Aval((*a.shape[:-2], m, n), a.dtype)


def _strides(shape: tuple[int, ...], transposed: bool) -> tuple[int, int, int]:
    rows, cols = shape[-2], shape[-1]
    batch = rows * cols if len(shape) == 3 else 0
    return (batch, 1, cols) if transposed else (batch, cols, 1)


def _in_place(a: AnyTensor, transposed: bool) -> tuple[AnyTensor, int, tuple[int, int, int]]:
    """Where op(a)'s elements are read: the tensor, the offset of the first element, and the
    strides (batch, row, k). A pending take of a computed tensor's rows (x[t], a split's
    piece, see `_fusion.pending_view`) is read in place in its source, else a itself."""
    strides = _strides(a.shape, transposed)
    take = take_of(a)
    if take is not None and take[0].pending is None:
        src, w, row, at = take
        if w == row:  # a contiguous run
            return src, at, strides
        if a.shape[-1] == w:  # a's rows are the take's
            return src, at, cast(tuple[int, int, int],
                                 tuple(s if s == 1 else s // w * row for s in strides))
    return a, 0, strides


def _forward(dev: Device, args: Sequence[AnyTensor], p: MatmulParams, aval: Aval) -> AnyTensor:
    if p.split:
        return _split_forward(dev, args, p, aval)
    a, b = args[0], args[1]
    if a.ndim == 2 or (a.ndim == 3 and b.ndim == 3):
        return _product(dev, args, p, aval)
    # Stacked rows, or batches over several dims: the kernels' 2-D or 3-D product over the
    # same data under another shape (no copy).
    if b.ndim == 2:
        rows = math.prod(a.shape[:-1])
        flat = (a.with_shape((rows, a.shape[-1])), b, *args[2:])
        flat_aval = Aval((rows, aval.shape[-1]), aval.dtype)
    else:
        batches = math.prod(a.shape[:-2])
        flat = (a.with_shape((batches, *a.shape[-2:])), b.with_shape((batches, *b.shape[-2:])))
        flat_aval = Aval((batches, *aval.shape[-2:]), aval.dtype)
    return _product(dev, flat, p, flat_aval).with_shape(aval.shape)


def _product(dev: Device, args: Sequence[AnyTensor], p: MatmulParams, aval: Aval,
             split: int = 0) -> AnyTensor:
    """C = op(a) @ op(b) (+ bias) by the kernels below; with `split`, C's layout is the
    batch-major one of MatmulParams.split (only where `_split_forward` sends it)."""
    a, b = args[0], args[1]
    m, k = _dims(a.shape, p.ta)
    n = aval.shape[-1]
    batches = a.shape[0] if a.ndim == 3 else 1
    # The bias is added by the kernels (their tiles start from it): no broadcast copy, no
    # separate add, one launch fewer per layer.
    bias = (args[2].buffer, p.bias) if p.bias else (None, NO_BIAS)
    out = empty(aval.shape, aval.dtype, dev)
    if out.size == 0:
        return out
    if k == 0:
        if p.bias:  # the product is zero: the bias, broadcast
            return strided_gather(args[2], aval.shape,
                                  [0, 1] if p.bias == COLUMN_BIAS else [1, 0])
        fill_into(out, 0.0)
        return out
    a, aoff, (sab, sam, sak) = _in_place(a, p.ta)
    sbb, sbn, sbk = _strides(b.shape, not p.tb)
    if dev.is_gpu:
        _gpu_product(dev, aval.dtype, out, a, b, (m, n, k, batches),
                     (sab, sam, sak, sbb, sbk, sbn), bias, split, aoff)
        return out
    src = lambda: _source(aval.dtype)  # noqa: E731
    rm = ROWS[aval.dtype]
    in_place = sbn == 1 and n % 16 == 0  # full panels of b can be read where they are
    # Rows of B 32 KiB or more apart collide in the caches, so that in place each panel comes
    # from memory again for every RM rows of C: from three such blocks on, B is packed.
    far = sbk * aval.dtype.itemsize >= FAR_ROWS and m > 2 * rm
    cached = (in_place and k <= KC[aval.dtype]
              and batches * k * n * aval.dtype.itemsize <= PACK_MIN_BYTES)
    small = m * n * k * batches <= SMALL_PRODUCT
    # The dot products read A's rows and B's columns in place where both run along k (g W^T):
    # a small product takes them rather than a pack and the panel kernel.
    dots = not split and sak == 1 and sbk == 1 and (sbn != 1 or n < 16)
    pack_b = ((m >= PACK_MIN_ROWS or far) and (k >= PACK_MIN_K or not in_place) and not cached
              and not (small and dots))
    # Panels of 32 columns where the device's vectors hold 16 floats, unless the padding past
    # n would add more than an eighth of the work (or C is split, see mm_panel32).
    wide = pack_b and not split and -n % 32 <= n // 8 and wide_panels(dev, aval.dtype)
    # A^T read in place steps a whole row of A per k, and over a long k of wide rows its lines
    # collide in L1: copied into blocks of 8 rows (`mm_pack_a`, O(mk) at a copy's speed), the
    # tile reads one stream. The same sums in the same order.
    a_blocks = (wide and sam == 1 and sak != 1 and not aoff and k >= A_BLOCKS_MIN_K
                and sak * aval.dtype.itemsize >= A_BLOCKS_MIN_STRIDE)
    pack_a = sak != 1 and k > KC[aval.dtype] and m * k >= AT_PACK_MIN and not a_blocks
    # One launch of the panel kernel (B's whole panels in place; a split C only in blocks of
    # whole halves of 8, see `_split_forward`) or of the dot products, nothing copied first.
    direct = not pack_a and not pack_b and (
        (in_place and split % 8 == 0) or dots)
    if small and not direct:
        # Tiny (a small model's layer, its gradients) and the other kernels would first copy
        # or pack an operand: one launch reading both in place. A pack, a padded C cut to size
        # or a transposing copy would each be a launch, which costs more than the product on
        # an idle device (the CNN's dense layer: 8 launches for its three products, against
        # 3). Where they take it in one launch they win: mm_small sums each column's k in a
        # chain (BENCHMARKS, sessions 20 and 37).
        _small(dev, aval.dtype, out, a, b, (m, n, k, batches), (sab, sam, sak, sbb, sbk, sbn), 0,
               bias, split, aoff)
        return out
    if pack_a:
        # A large A^T over a long k: pack it row-major (O(mk) against the product's O(mnk)), as
        # BLAS packs panels. Within one chunk of k, or smaller, the kernels read it in place
        # (see _panel_kernel).
        a = strided_gather(a, (batches, m, k), [sab, sam, sak], aoff)
        sab, sam, sak, aoff = m * k, k, 1, 0
    if pack_b:
        # Pack op(b) as zero-padded panels (O(kn), read once against m/RM times in place); for
        # short k its re-reads are cheap and the extra launch is not worth it.
        width = 32 if wide else 16
        panels = -(-n // width)
        bp = pack_panels(b, (batches, k, n), (sbb, sbk, sbn), width)
        npad = panels * width  # C with whole panels; the columns past n are cut off after
        cp = out if npad == n else empty((batches, m, npad), aval.dtype, dev)
        a_block = None
        if a_blocks:
            a = pack_a_blocks(a, (batches, k, m), (sab, sak))
            sab, sak, a_block = -(-m // WIDE_ROWS) * k * WIDE_ROWS, WIDE_ROWS, k * WIDE_ROWS
        _panel_rows(dev, cp, a, (sam, sak, sab), bp, (panels * k * width, k * width, width),
                    (m, npad, k, batches), bias, n, split, aoff, width, a_block)
        if cp is not out:
            cut = strided_gather(cp, (batches, m, n), [m * npad, npad, 1])
            return cut.with_shape(aval.shape)
        return out
    # Few rows: B is read in place (panels where its rows are contiguous, dot products else).
    n16 = n // 16 * 16 if sbn == 1 else 0
    if n16:
        # Whole panels of 32 in place (see mm_panel32) where no tail is left to other kernels.
        width = 32 if not split and n % 32 == 0 and wide_panels(dev, aval.dtype) else 16
        rows = tile_rows(aval.dtype, width)
        kernel = dev.kernel("matmul", dtype_name(aval.dtype), panel_name("mm_panel", width), src)
        # Many rows (B cached, see `cached`) take several row blocks a work-item, as the
        # packed path does: B's chunk is then read once per RB blocks, not per block.
        rb = row_blocks(-(-m // rows), -(-(n16 // width) // LOCAL_MM) * batches)
        size = (round_up(n16 // width, LOCAL_MM), -(-m // (rows * rb)), batches)
        dev.launch(kernel, size, (LOCAL_MM, 1, 1), out.buffer, a.buffer, b.buffer, m, n, k, n16,
                   rows * rb, k, sam, sak, sab, sbb, width, sbk, *bias, n, split, aoff,
                   rows * sam)
    rest = n - n16
    if rest and (sak != 1 or sbk != 1) and m * rest * k <= SMALL_PRODUCT:
        # Small, with an operand the wrong way round for dot products: read both in place.
        _small(dev, aval.dtype, out, a, b, (m, n, k, batches), (sab, sam, sak, sbb, sbk, sbn),
               n16, bias, split, aoff)
    elif rest:
        # Narrow outputs and tail columns: dot products over rows of B^T contiguous along k.
        if sak != 1:  # A^T: dot products read A's rows along k
            a = strided_gather(a, (batches, m, k), [sab, sam, sak], aoff)
            sab, sam, aoff = m * k, k, 0
        if sbk != 1:
            b = strided_gather(b, (batches, rest, k), [sbb, sbn, sbk], base=n16 * sbn)
            sbb, sbn = rest * k, k
        elif n16:
            b = strided_gather(b, (batches, rest, k), [sbb, sbn, 1], base=n16 * sbn)
            sbb, sbn = rest * k, k
        assert not split, "a split product never reaches mm_dot (see _split_forward)"
        sixteen = wide_panels(dev, aval.dtype)  # float32 where vectors hold 16 floats
        kernel = dev.kernel("matmul", dtype_name(aval.dtype),
                            "mm_dot16" if sixteen else "mm_dot", src)
        size = (round_up(-(-rest // 4), LOCAL_MM), -(-m // (DOT16_ROWS if sixteen else 2)),
                batches)
        dev.launch(kernel, size, (LOCAL_MM, 1, 1), out.buffer, a.buffer, b.buffer, m, n, k, sab,
                   sam, sbb, sbn, n16, *bias, aoff)
    return out


# Panels of operands packed more than once in one layout (an RNN's recurrent weight, at every
# time step and again in the backward): from the second packing on they are kept while the
# operand lives (tensors never change), a pack being a launch reading the whole operand. By
# the operand's id: a weak reference to it and, per owner (0
# outside a tg.jit recording, else the recording's id), a weak reference to the recording and
# the panels per (dims, strides), None where packed once. A recording's own are used only
# within it (a pack made outside would be a constant of the program, stale once the weight
# changes) and let go when it ends; eager ones are apart from them, so a thread's eager work
# on a weight leaves another thread's recording over it as it would be alone.
Panels = dict[tuple[Any, ...], AnyTensor | None]
_PACKED: dict[int, tuple[weakref.ref[AnyTensor],
                         dict[int, tuple[weakref.ref[Any] | None, Panels]]]] = {}


def _kept_panels(b: AnyTensor) -> Panels:
    """The panels kept for `b` in this thread's owner (see _PACKED)."""
    b_id = id(b)
    entry = _PACKED.get(b_id)
    if entry is None or entry[0]() is not b:
        fresh: dict[int, tuple[weakref.ref[Any] | None, Panels]] = {}
        entry = (weakref.ref(b, lambda _: _PACKED.pop(b_id, None)), fresh)
        _PACKED[b_id] = entry
    owners = entry[1]
    owner = current_observer()
    owner_id = 0 if owner is None else id(owner)
    found = owners.get(owner_id)
    if found is not None and (found[0] is None or found[0]() is owner):
        return found[1]
    ref = None if owner is None else weakref.ref(owner, lambda _: owners.pop(owner_id, None))
    kept: Panels = {}
    owners[owner_id] = (ref, kept)
    return kept


def pack_panels(b: AnyTensor, dims: tuple[int, int, int], strides: tuple[int, int, int],
                width: int = 16) -> AnyTensor:
    """op(b), `dims` (batches, k, n) at `strides` (sbb, sbk, sbn), packed by `mm_pack` as
    panels of 16 columns: (batches, ceil(n / 16), k, 16), each panel contiguous, zeros past n
    (those of an earlier call where `b` was packed so before, see _PACKED); `width` 32: by
    `mm_pack32` as panels of 32."""
    key = (dims, strides, width)
    kept = _kept_panels(b)
    found = kept.get(key)
    if found is not None:
        return found
    again = key in kept
    batches, k, n = dims
    panels = -(-n // width)
    out = empty((batches, panels, k, width), b.dtype, b.device)
    pack = b.device.kernel("matmul", dtype_name(b.dtype), panel_name("mm_pack", width),
                           lambda: _source(b.dtype))
    b.device.launch(pack, (round_up(k * panels, LOCAL), batches), (LOCAL, 1), out.buffer,
                    b.buffer, k, n, *strides)
    kept[key] = out if again else None
    return out


def pack_a_blocks(a: AnyTensor, dims: tuple[int, int, int], strides: tuple[int, int]
                  ) -> AnyTensor:
    """op(a) (m x k), given as `dims` (batches, k, m) with m contiguous at `strides` (sab,
    sak), as `mm_pack_a`'s blocks of 8 rows: (batches, ceil(m / 8), k, 8), zeros past m."""
    batches, k, m = dims
    blocks = -(-m // WIDE_ROWS)
    out = empty((batches, blocks, k, WIDE_ROWS), a.dtype, a.device)
    kernel = a.device.kernel("matmul", dtype_name(a.dtype), "mm_pack_a",
                             lambda: _source(a.dtype))
    a.device.launch(kernel, (round_up(k * -(-blocks // 8), LOCAL), batches), (LOCAL, 1),
                    out.buffer, a.buffer, k, m, *strides)
    return out


def _split_forward(dev: Device, args: Sequence[AnyTensor], p: MatmulParams, aval: Aval
                   ) -> AnyTensor:
    """C written batch-major (see MatmulParams.split) by the kernels where they can: mm_small
    always; mm_panel when every column goes through it (op(b) not transposed, n a multiple of
    16: no padded C, no tail) and each 8-column half of a panel stays in one block (S a
    multiple of 8). Else the plain product, then one transposing copy."""
    a = args[0]
    m, k = _dims(a.shape, p.ta)
    split = p.split
    n = aval.shape[0] * split
    plain = MatmulParams(p.ta, p.tb, p.bias)
    if k and (m * n * k <= SMALL_PRODUCT or (split % 8 == 0 and n % 16 == 0 and not p.tb)):
        c = _product(dev, args, plain, Aval((m, n), aval.dtype), split)
        return c.with_shape(aval.shape)
    c = _product(dev, args, plain, Aval((m, n), aval.dtype))
    return strided_gather(c, aval.shape, [split, n, 1])


# GPU products: a work-group of GPU_THREADS x GPU_THREADS work-items owns a GPU_TILE x GPU_TILE
# tile of C, each work-item a 4 x 4 block of it, over chunks of GPU_K of k staged in local
# memory. The panel kernels above are a CPU core's (a tile of C in one work-item's vector
# registers, work-groups of 8), too few work-items for a GPU (BENCHMARKS, session 24).
GPU_TILE, GPU_K, GPU_THREADS = 64, 16, 16
# A product with fewer tiles of C than this (a convolution's weight gradient: C of 16 x 144
# summed over k = 16384) would leave most of a GPU idle while a few work-groups walk all of k:
# its blocks of k run as work-groups of their own (`mm_tiled`'s split mode, `mm_parts`), where
# their (batch, block) pairs fit a launch's third dimension (CUDA's grid takes 65535) and their
# sums take no more memory than A and B.
GPU_MIN_GROUPS = 264
GPU_MAX_Z = 65535


def _gpu_source(dtype: DType) -> str:
    """`mm_tiled`: C = A @ B (+ bias) at any strides and batches, in mm_small's arguments (C
    written plainly or, with S, batch-major as MatmulParams.split says). Each chunk's loads
    are spread over the work-group so that neighbouring work-items read neighbouring elements
    whichever of A's (and B's) strides is 1.

    With `parts` > 0 a work-group sums one block of BLOCK_K of k for one batch (dimension 2
    counts batch * parts + block) and writes that block's sum to P; `mm_parts` then adds the
    blocks in order to the bias, the very additions the whole walk makes: the same bits."""
    return f"""{fp64_pragma(dtype)}typedef {C_TYPES[dtype]} T;
#pragma OPENCL FP_CONTRACT ON
#define TILE {GPU_TILE}
#define STEP {GPU_K}
#define THREADS {GPU_THREADS}
#define BLOCK_K {KC[dtype]}
__kernel void mm_tiled(__global T* C, __global const T* A, __global const T* B,
                       const int M, const int N, const int K, const long sab, const long sam,
                       const long sak, const long sbb, const long sbk, const long sbn,
                       __global const T* bias, const int bmode, const int S, const long aoff,
                       const int parts, __global T* P) {{
  __local T As[STEP][TILE + 1];
  __local T Bs[STEP][TILE + 1];
  const int tx = get_local_id(0), ty = get_local_id(1), t = ty * THREADS + tx;
  const int col0 = get_group_id(0) * TILE, row0 = get_group_id(1) * TILE;
  const long z = get_global_id(2), bat = parts ? z / parts : z;
  const int k_lo = parts ? (int)(z % parts) * BLOCK_K : 0;
  const int k_hi = parts ? min(K, k_lo + BLOCK_K) : K;
  A += aoff + bat * sab;
  B += bat * sbb;
  // acc: C's running sum, from the bias; part: this block of BLOCK_K of k, summed from 0 and
  // then added, so that a float32 sum's error grows with the blocks, not with k (as BLAS's).
  T acc[4][4], part[4][4];
  for (int i = 0; i < 4; ++i) {{
    const int row = min(row0 + ty + THREADS * i, M - 1);
    for (int j = 0; j < 4; ++j) {{
      const int col = min(col0 + tx + THREADS * j, N - 1);
      acc[i][j] = parts ? (T)0 : bmode == 1 ? bias[col] : bmode == 2 ? bias[row] : (T)0;
      part[i][j] = (T)0;
    }}
  }}
  for (int k0 = k_lo; k0 < k_hi; k0 += STEP) {{
    if (k0 % BLOCK_K == 0 && k0 > k_lo) {{
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) {{ acc[i][j] += part[i][j]; part[i][j] = (T)0; }}
    }}
    for (int l = 0; l < TILE * STEP / (THREADS * THREADS); ++l) {{
      const int e = t + l * THREADS * THREADS;
      const int ar = sak == 1 ? e / STEP : e % TILE, ak = sak == 1 ? e % STEP : e / TILE;
      const int bc = sbn == 1 ? e % TILE : e / STEP, bk = sbn == 1 ? e / TILE : e % STEP;
      const int gr = row0 + ar, gka = k0 + ak, gc = col0 + bc, gkb = k0 + bk;
      As[ak][ar] = gr < M && gka < K ? A[gr * sam + gka * sak] : (T)0;
      Bs[bk][bc] = gc < N && gkb < K ? B[gkb * sbk + gc * sbn] : (T)0;
    }}
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = 0; k < STEP; ++k) {{
      T a[4], b[4];
      for (int i = 0; i < 4; ++i) a[i] = As[k][ty + THREADS * i];
      for (int j = 0; j < 4; ++j) b[j] = Bs[k][tx + THREADS * j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) part[i][j] += a[i] * b[j];
    }}
    barrier(CLK_LOCAL_MEM_FENCE);
  }}
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] += part[i][j];
  for (int i = 0; i < 4; ++i) {{
    const int row = row0 + ty + THREADS * i;
    if (row >= M) continue;
    for (int j = 0; j < 4; ++j) {{
      const int col = col0 + tx + THREADS * j;
      if (col >= N) continue;
      if (parts)  // the block's own sum, not 0 + it (which would turn a -0 into +0)
        P[z * M * N + (long)row * N + col] = part[i][j];
      else
        C[S ? (long)(col / S) * M * S + (long)row * S + col % S
            : bat * (long)M * N + (long)row * N + col] = acc[i][j];
    }}
  }}
}}

// C = the bias plus mm_tiled's block sums P (batch, block, M, N), blocks in order.
__kernel void mm_parts(__global T* C, __global const T* P, const int M, const int N,
                       const int parts, __global const T* bias, const int bmode, const int S,
                       const long n) {{
  const long i = get_global_id(0);
  if (i >= n) return;
  const long bat = i / ((long)M * N);
  const int rc = (int)(i - bat * M * N), row = rc / N, col = rc - row * N;
  T acc = bmode == 1 ? bias[col] : bmode == 2 ? bias[row] : (T)0;
  __global const T* p = P + bat * parts * M * N + rc;
  for (int b = 0; b < parts; ++b) acc += p[(long)b * M * N];
  C[S ? (long)(col / S) * M * S + (long)row * S + col % S : i] = acc;
}}
"""


def _gpu_product(dev: Device, dtype: DType, out: AnyTensor, a: AnyTensor, b: AnyTensor,
                 dims: tuple[int, int, int, int], strides: tuple[int, ...],
                 bias: tuple[Any, int], split: int, aoff: int) -> None:
    """out = A @ B (+ bias) by `mm_tiled` (a program of its own, built on GPUs only): both
    read in place at `strides` (sab, sam, sak, sbb, sbk, sbn), A from `aoff`; by blocks of k
    and `mm_parts` where C has fewer than GPU_MIN_GROUPS tiles."""
    m, n, k, batches = dims
    source = lambda: _gpu_source(dtype)  # noqa: E731
    kernel = dev.kernel("matmul_gpu", dtype_name(dtype), "mm_tiled", source)
    groups = (-(-n // GPU_TILE), -(-m // GPU_TILE))
    parts = -(-k // KC[dtype]) if groups[0] * groups[1] * batches < GPU_MIN_GROUPS else 1
    if batches * parts > GPU_MAX_Z or batches * parts * m * n > a.size + b.size:
        parts = 1
    sums = empty((batches * parts, m, n), dtype, dev) if parts > 1 else None
    dev.launch(kernel, (groups[0] * GPU_THREADS, groups[1] * GPU_THREADS, batches * parts),
               (GPU_THREADS, GPU_THREADS, 1), out.buffer, a.buffer, b.buffer, m, n, k, *strides,
               *bias, split, aoff, parts if sums is not None else 0,
               sums.buffer if sums is not None else out.buffer)
    if sums is not None:
        total = batches * m * n
        dev.launch(dev.kernel("matmul_gpu", dtype_name(dtype), "mm_parts", source),
                   launch_size(total), (LOCAL,), out.buffer, sums.buffer, m, n, parts, *bias,
                   split, total)


def _small(dev: Device, dtype: DType, out: AnyTensor, a: AnyTensor, b: AnyTensor,
           dims: tuple[int, int, int, int], strides: tuple[int, ...], col_base: int,
           bias: tuple[Any, int], split: int, aoff: int = 0) -> None:
    """Columns col_base.. of out = A @ B (+ bias: buffer and mode; `split`: C's layout) with
    `mm_small8` (or 4): both read in place at `strides` (sab, sam, sak, sbb, sbk, sbn), A from
    `aoff`, a tile of SMALL_TILE_ROWS rows per work-item, k summed in order."""
    m, n, k, batches = dims
    # Tiles of 4 where that leaves a shorter partial tile (n % 8 of 4-7: 12, 20, 6 columns).
    width = 4 if (n - col_base) % 8 >= 4 else 8
    kernel = dev.kernel("matmul", dtype_name(dtype), f"mm_small{width}",
                        lambda: _source(dtype))
    dev.launch(kernel, (-(-(n - col_base) // width),
                        round_up(-(-m // SMALL_TILE_ROWS), SMALL_GROUP), batches),
               (1, SMALL_GROUP, 1), out.buffer, a.buffer, b.buffer, m, n, k, *strides,
               col_base, *bias, split, aoff)


def row_blocks(tiles: int, groups: int) -> int:
    """RM-row blocks per work-item of the panel kernels: up to RB_MAX (B's chunk reused from
    L1), fewer where that would leave too few work-groups to share among the cores."""
    return max(1, min(RB_MAX, tiles * groups // MIN_GROUPS))


def _panel_rows(dev: Device, c: AnyTensor, a: AnyTensor, a_strides: tuple[int, int, int],
                b: AnyTensor, b_strides: tuple[int, int, int], dims: tuple[int, int, int, int],
                bias: tuple[Any, int], nb: int, split: int, aoff: int, width: int = 16,
                a_block: int | None = None) -> None:
    """C (dims: m, n, k, batches; n whole panels of `width`) = A @ B by mm_panel (mm_panel32)
    over row blocks (`row_blocks`) and chunks of KC: A at (sam, sak, sab), B's panels at (sbb,
    sbp, sbk)."""
    m, n, k, batches = dims
    panels = n // width
    rm = tile_rows(c.dtype, width)
    kernel = dev.kernel("matmul", dtype_name(c.dtype), panel_name("mm_panel", width),
                        lambda: _source(c.dtype))
    rb = row_blocks(-(-m // rm), -(-panels // LOCAL_MM) * batches)
    dev.launch(kernel, (round_up(panels, LOCAL_MM), -(-m // (rm * rb)), batches),
               (LOCAL_MM, 1, 1), c.buffer, a.buffer, b.buffer, m, n, k, n, rm * rb,
               KC[c.dtype], *a_strides, *b_strides, *bias, nb, split, aoff,
               rm * a_strides[0] if a_block is None else a_block)


def shared_a_product(dev: Device, out: AnyTensor, a: AnyTensor, a_strides: tuple[int, int],
                     b: AnyTensor, dims: tuple[int, int, int, int],
                     bias: tuple[Any, int] = (None, NO_BIAS)) -> None:
    """out[i] (m x n) = A @ B[i] for i < batches (dims: m, n, k, batches): one A (m x k at
    `a_strides`, (sam, sak)) for every batch, B's batches (k x n) contiguous, n a multiple of
    16 so its whole panels are read in place; row blocks and chunks of k as the packed path,
    so the sums are mm_panel's over packed panels (a 1x1 convolution's are conv_panel's)."""
    _, n, k, _ = dims
    _panel_rows(dev, out, a, (*a_strides, 0), b, (k * n, 16, n), dims, bias, n, 0, 0)


def _vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: MatmulParams,
         needs: Sequence[bool]) -> list[Any]:
    # With A = op(a), B = op(b): dA = g B^T and dB = A^T g; transposed operands take the
    # transpose of those, each again one matmul_t with flags. A bias takes g summed over the
    # axis it was broadcast along. A split C's cotangent comes in its layout, (n // S, m, S):
    # made (m, n) first, by one transposing copy.
    a, b = args[0], args[1]
    if p.split:
        g = e.apply(TRANSPOSE, [g], TransposeParams((1, 0, 2)))
        g = e.apply(RESHAPE, [g], ReshapeParams((g.shape[0], g.shape[1] * g.shape[2])))
    parts: list[Any] = [None, None]
    # Stacked rows: dA = g op(b)^T is stacked rows again; b's gradient and the bias's sum over
    # every row, as the 2-D product of the rows (the same sums as a reshape before the product).
    rows = stacks_rows(len(a.shape), len(b.shape), p)
    if rows and (needs[1] or (p.bias and needs[2])):
        flat_g = e.apply(RESHAPE, [g], ReshapeParams((math.prod(g.shape[:-1]), g.shape[-1])))
    else:
        flat_g = g
    # The bias's first, as when it was an add of its own: with it last, g stays alive longer
    # beside the two products' outputs, and the backward's peak memory grows.
    if p.bias:
        axis = 0 if p.bias == COLUMN_BIAS else 1
        parts.append(e.apply(SUM, [flat_g], ReduceParams((axis,), False)) if needs[2] else None)
    if needs[0]:
        parts[0] = (e.apply(MATMUL, [b, g], MatmulParams(p.tb, True)) if p.ta
                    else e.apply(MATMUL, [g, b], MatmulParams(False, not p.tb)))
    if needs[1] and rows:
        flat_a = e.apply(RESHAPE, [a], ReshapeParams((math.prod(a.shape[:-1]), a.shape[-1])))
        parts[1] = (e.apply(MATMUL, [flat_g, flat_a], MatmulParams(True, False)) if p.tb
                    else e.apply(MATMUL, [flat_a, flat_g], MatmulParams(True, False)))
    elif needs[1]:
        parts[1] = (e.apply(MATMUL, [g, a], MatmulParams(True, p.ta)) if p.tb
                    else e.apply(MATMUL, [a, g], MatmulParams(not p.ta, False)))
    return parts


_PLAIN = MatmulParams(False, False)
_OWN = 2  # the frames from a public op's body up to its caller: the op and `takes_tape`'s

MATMUL: Primitive[MatmulParams] = register(Primitive(
    "matmul", _rule, _forward, _vjp,
    doc="op(a) @ op(b) for 2-D or equally batched operands, or (..., m, k) @ (k, n) as one "
        "product of the stacked rows; op transposes by flag. A 2-D product (or stacked rows) "
        "may take a bias, added per column (or per row, 2-D) by the kernels."))


@takes_tape
def matmul(tape: Tape, a: Id, b: Id) -> tuple[Tape, Id]:
    """numpy's matmul: 1-D operands are promoted and squeezed, batch dims broadcast."""
    tape.node(a, "matmul", "a")
    tape.node(b, "matmul", "b")
    if (len(a.shape) == 2 and len(b.shape) == 2 and a.shape[1] == b.shape[0]
            and a.dtype == b.dtype and a.dtype in FLOATS):
        # Two float matrices that fit, the common case: the checks and reshapes below would
        # find nothing to do, nor would the rule.
        return record_known(tape, MATMUL, (a, b), _PLAIN, Aval((a.shape[0], b.shape[1]),
                                                                a.dtype), call_site(_OWN))
    for name, x in (("a", a), ("b", b)):
        if not is_float(x.dtype):
            raise DTypeError(at_site(
                f"matmul: argument {name!r} has dtype {dtype_name(x.dtype)}, expected float32 "
                "or float64"))
        if x.ndim == 0:
            raise ShapeError(at_site(
                f"matmul: argument {name!r} is a scalar (shape ()); use tg.mul for scaling"))
    if a.dtype != b.dtype:
        raise DTypeError(at_site(
            f"matmul: a is {dtype_name(a.dtype)} but b is {dtype_name(b.dtype)}; convert one "
            "with tg.astype"))
    a_shape = (1, *a.shape) if a.ndim == 1 else a.shape
    b_shape = (*b.shape, 1) if b.ndim == 1 else b.shape
    if a_shape[-1] != b_shape[-2]:
        raise ShapeError(at_site(
            f"matmul: a has shape {a.shape} and b has shape {b.shape}: a's last axis "
            f"({a_shape[-1]}) must equal b's {'only' if b.ndim == 1 else 'second-to-last'} "
            f"axis ({b_shape[-2]})"))
    m, n = a_shape[-2], b_shape[-1]
    batch = broadcast_shapes("matmul", [a_shape[:-2], b_shape[:-2]],
                             ["a's batch dims", "b's batch dims"])
    out_shape = (*batch, *([m] if a.ndim > 1 else []), *([n] if b.ndim > 1 else []))
    if (b.ndim == 2 and a.ndim > 1) or (b.ndim > 2 and a.shape[:-2] == b.shape[:-2]):
        # (..., m, k) @ (k, n), the stacked rows of one 2-D product (no broadcast copy of b),
        # or equally batched operands: one node, no reshapes.
        return record(tape, MATMUL, [a, b], _PLAIN)
    if len(b_shape) == 2:
        # (k,) @ (k, n), (..., m, k) @ (k,): one 2-D product over the stacked rows.
        rows = (math.prod(batch) * m, a_shape[-1])
        tape, a2 = (tape, a) if a.shape == rows else reshape(tape, a, rows)
        tape, b2 = reshape(tape, b, b_shape) if b.ndim == 1 else (tape, b)
        tape, c = record(tape, MATMUL, [a2, b2], _PLAIN)
    else:
        tape, a3 = _batched(tape, a, a_shape, batch)
        tape, b3 = _batched(tape, b, b_shape, batch)
        tape, c = record(tape, MATMUL, [a3, b3], MatmulParams(False, False))
    if c.shape != out_shape:
        tape, c = reshape(tape, c, out_shape)
    return tape, c


def _batched(tape: Tape, x: Id, shape: tuple[int, ...], batch: tuple[int, ...]
             ) -> tuple[Tape, Id]:
    """x promoted to `shape`, broadcast over `batch`, as 3-D (prod(batch), rows, cols). Each
    step only where it changes the shape: a batch of matrices (attention's) needs none."""
    if x.shape != shape:
        tape, x = reshape(tape, x, shape)
    if x.shape[:-2] != batch:
        tape, x = broadcast_to(tape, x, (*batch, *shape[-2:]))
    if len(x.shape) != 3:
        tape, x = reshape(tape, x, (math.prod(batch), *shape[-2:]))
    return tape, x


register_family("matmul", _source)
