"""Pending elementwise values: a chain of elementwise ops runs as one generated kernel.

Why: on PoCL a kernel launch costs 5-20 us, and each elementwise kernel streams its operands
through memory; op by op, a chain pays both for every op. So an elementwise primitive returns a
*pending* tensor: a recipe (expression, operands) with no buffer yet (all but the heavy ones,
which call a transcendental and are computed when made: see `elementwise`). The first read of
its `buffer` (any other kernel, `numpy()`, the end of `backward`) realises it:

- The pending nodes it depends on form a DAG. Making a node deeper than FUSE_DEPTH realises
  its deepest operand first, so a kernel never grows without bound.
- A DAG whose structure has been realised `fuse_after()` times runs as one kernel generated for
  that structure, built once per device and kept. It writes only the tensor asked for; the nodes
  inside stay pending, and are recomputed in registers if they are needed again, but for
  a node that other DAGs read too, which is realised first (`_planned`): else every later
  DAG that reaches it walks and computes it again.
- A structure seen fewer times, or a single node, runs node by node with the prebuilt kernels of
  the core program: a one-off graph never pays a 0.3-1 s program build.
- A row sum (`sum_rows`) or a strided gather (`gather`) of a pending tensor evaluates its DAG
  inside their own generated kernel: the tensor is never written.
- Views of rows (`pending_view`: a split's piece, x[t], and their VJPs into zeros) are pending
  too; their source's DAG is evaluated at the view's indices by the kernel that reads them.
- The DAG's structure is found by a walk (`_Plan`), or by replaying the first walk of the same
  structure (`plan_of`, `_Skeleton`), with every difference checked.

The structure is the ops and how they connect, not the sizes or the scalar values, so one kernel
serves every step of a training loop. Both paths evaluate the same expressions in the same order
and type, so results do not depend on which one ran. `TAPEGRAD_FUSE=0` turns fusion off (every
elementwise op runs at once); `TAPEGRAD_FUSE=N` builds a structure's kernel on its N-th sighting
(default 3: a structure repeated inside one step, like two equal layers, is not built during the
first step, which keeps a cold start short).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import weakref
from collections.abc import Callable, Generator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ._device import LOCAL, Device, fp64_pragma, observed
from ._kernels import (
    CONTRACT_OFF,
    DENSE_CHUNK,
    DENSE_PRELUDE,
    KAHAN,
    Expression,
    add_puts_into,
    dense_size,
    expression_prelude,
    fill_into,
    gather_into,
    gather_loop,
    gather_shape,
    launch_size,
    put_rows,
    row_sum,
    run_expression,
    run_over_view,
    strided_gather,
)
from ._tensor import (
    C_TYPES,
    AnyTensor,
    DType,
    Shape,
    _TensorFields,
    check_fits,
    empty,
    force,
    tensor,
)

# The longest chain of pending nodes: a longer one ends in a buffer first. It bounds the source
# of a generated kernel, the recursion of a plan's walk, and the recomputation when nodes inside
# a DAG are needed again later. A backward DAG inherits the depth of the forward values it
# reads (relu_grad(g, x) is as deep as x), so the depth leaves room for both: a smaller one cut
# a long chain's backward often, each cut walking the forward nodes again (the measurements are
# in docs/BENCHMARKS.md, "Figures that were comments"). A walk recurses only at branches (see
# `_Plan`), never deeper than this, within Python's limit of 1000 frames.
FUSE_DEPTH = 512
# Nodes of one generated kernel; a larger DAG (a wide one, or a backward DAG with the forward
# one inside) runs node by node.
MAX_NODES = 1024
# Buffers and scalars of one generated kernel: OpenCL promises 1024 bytes of arguments.
MAX_ARGS = 96


def _setting() -> int:
    text = os.environ.get("TAPEGRAD_FUSE", "3").strip()
    try:
        return max(int(text), 0)
    except ValueError:
        return 3


# The setting: the sighting that builds a structure's kernel, 0 for fusion off. Read in place
# by the elementwise primitives' recorder (`record_elementwise`); changed only by
# `set_fuse_after`.
build_on_sighting = _setting()


# A survey (`surveying`): the structures a run would build kernels for, run unfused meanwhile,
# then built together by `build_surveyed` (one program: PoCL's cost of a build is mostly per
# program, so twenty kernels build far faster in one than one by one).
_survey: ContextVar[dict[Any, tuple[Device, DType, list[str], str]] | None] = ContextVar(
    "tapegrad_fuse_survey", default=None)
_SURVEY_GET = _survey.get


@contextlib.contextmanager
def surveying() -> Generator[dict[Any, tuple[Device, DType, list[str], str]]]:
    """Within the block, structures without a kernel run unfused and are noted (by key: their
    device, dtype, shared source parts and own part) for `build_surveyed`."""
    found: dict[Any, tuple[Device, DType, list[str], str]] = {}
    token = _survey.set(found)
    try:
        yield found
    finally:
        _survey.reset(token)


class _Kernels:
    """Fusion's kernels on one device, by structure, and how often each structure was seen
    (a structure's kernel is built on its `build_on_sighting`-th sighting). `waiting`: the
    structures seen but not yet hot, by key as a survey notes them, at most WAITING_MAX: the
    first to turn hot builds them all as one program (`build_surveyed`), as a step's
    structures turn hot together, at the same run of it."""

    __slots__ = ("built", "seen", "waiting")

    def __init__(self) -> None:
        self.built: dict[Any, Any] = {}
        self.seen: dict[Any, int] = {}
        self.waiting: dict[Any, tuple[Device, DType, list[str], str]] = {}


# PoCL's build of a program costs ~0.15 s before its source's own share: a cold eager step's
# fused kernels cost one such build together, not one each. A structure seen once and never
# again costs the batch its source's front end only (code is generated at a kernel's first
# launch); bounded, so a long run's one-off structures do not accumulate.
WAITING_MAX = 64


# Kept here: fusion is the backend's concern behind realisation, not the device's.
_KERNELS: weakref.WeakKeyDictionary[Device, _Kernels] = weakref.WeakKeyDictionary()


def kernels_on(device: Device) -> _Kernels:
    found = _KERNELS.get(device)
    if found is None:
        with device.lock:
            found = _KERNELS.setdefault(device, _Kernels())
    return found


def build_surveyed(found: dict[Any, tuple[Device, DType, list[str], str]]) -> None:
    """Build the surveyed structures' kernels, one program per device and dtype."""
    groups: dict[tuple[Device, DType], list[tuple[Any, list[str], str]]] = {}
    for key, (device, dtype, shared, own) in found.items():
        if key not in kernels_on(device).built:
            groups.setdefault((device, dtype), []).append((key, shared, own))
    for (device, dtype), items in groups.items():
        with device.lock:
            shared_parts = list(dict.fromkeys(part for _, shared, _ in items for part in shared))
            owns = [own.replace("tgf_eval", f"tgf_eval_{i}").replace(
                "__kernel void fused(", f"__kernel void fused_{i}(")
                for i, (_, _, own) in enumerate(items)]
            source = _source_of("".join(shared_parts) + "".join(owns))
            built = kernels_on(device).built
            variant = f"{dtype}#batch{len(built)}"
            for i, (key, _, _) in enumerate(items):
                built[key] = device.kernel("fused", variant, f"fused_{i}", source)


def _source_of(text: str) -> Callable[[], str]:
    return lambda: text


def fuse_after() -> int:
    """The sighting of a structure that builds its kernel (0: fusion is off)."""
    return build_on_sighting


def set_fuse_after(n: int) -> int:
    """Change the setting (tests); returns the old value."""
    global build_on_sighting
    old, build_on_sighting = build_on_sighting, n
    return old


class Pending:
    """The recipe of a pending tensor: `expr` over `operands` (tensors and Python floats), or
    with `expr` None, a copy of `operands[0]` (a buffer): with `view` (kind, w, row, at), a
    block of it (see `pending_view`), else a broadcast of it: its one element repeated (a splat,
    `repeat` None), or with `repeat` (n, inner), element i of the result is element
    (i // inner) % n of it (see `pending_broadcast`).

    `depth` is the longest chain of pending nodes down from this one: it bounds the kernel's
    length without walking the DAG. `uses` counts the operand slots of pending recipes that
    read this one (a node made by `elementwise` or `record_elementwise`, less those resolved
    since): a plan compares it with the reads inside its DAG to find the nodes that
    another DAG may read again; `seen` says an earlier plan found this one so (see `_shared`).
    `puts` counts the puts of a sum of them (1 for a put, see `pending_view`; an add's of a put
    to anything, one more than its first operand's): a hint that `_realise_puts` may take it.
    """

    __slots__ = ("depth", "expr", "operands", "puts", "repeat", "seen", "uses", "value", "view")

    def __init__(self, expr: Expression | None, operands: tuple[Any, ...], depth: int,
                 repeat: tuple[int, int] | None = None,
                 view: tuple[str, int, int, int] | None = None) -> None:
        self.expr = expr
        self.operands = operands
        self.depth = depth
        self.repeat = repeat
        self.view = view
        self.uses = 0
        self.seen = False
        self.puts = 1 if view is not None and view[0] == "put" else 0
        # Computed on the node-by-node path while the node stays pending (see `_by_node`), or
        # the root's value after a fused realisation, for a reshape sharing this recipe.
        self.value: AnyTensor | None = None


def elementwise(expr: Expression, args: Sequence[AnyTensor | float], shape: Shape,
                dtype: DType, device: Device) -> AnyTensor:
    """`expr` over equal-shape tensors and scalars: a pending tensor, or a tensor computed at
    once for a heavy expression, with fusion off, or with no elements."""
    for a in args:  # a pending recipe never holds a deferred operand (see `_tensor`)
        if type(a) is AnyTensor and a.thunk is not None:
            force((a,))
    if not (expr.fuses and build_on_sighting) or 0 in shape:
        # Custom ops (a family of their own) run at once: a C expression that does not build
        # is reported at the call that uses it, and their kernels never join a fused one. So
        # do heavy expressions, by their own kernel (eight lanes at a time in float32:
        # `_kernels._vectorized`), their operands first: left pending, a transcendental was
        # computed again by every kernel that read it, the VJPs' first (tanh_grad reads tanh's
        # output), so a fused chain of transcendentals was slower than running it node by node.
        return _now(expr, args, shape, dtype, device)
    while True:  # written for speed, as this runs per op: no isinstance, no `tensor(...)` call
        depth = 0
        deepest: Any = None
        for a in args:
            if type(a) is AnyTensor:
                p: Pending | None = a.pending
                if p is not None:
                    p.uses += 1
                    if p.depth > depth:
                        depth, deepest = p.depth, a
        if depth < FUSE_DEPTH:
            break
        for a in args:  # counted again on the next pass
            if type(a) is AnyTensor and a.pending is not None:
                a.pending.uses -= 1
        realise(deepest)  # the chain is long enough: end it in a buffer
    made = Pending(expr, tuple(args), depth + 1)
    last = args[-1]
    # One more put in a sum of them (a sweep adding the VJPs of pieces): see `_realise_puts`.
    if (type(last) is AnyTensor and last.pending is not None and last.pending.view is not None
            and last.pending.puts and expr.name == "add"):
        first: Any = args[0]
        made.puts = 1 + (first.pending.puts if type(first) is AnyTensor and first.pending else 0)
    t: Any = _TensorFields(None, shape, dtype, device, made)
    t.__class__ = AnyTensor
    return t


# A row of a length other than a multiple of DENSE_CHUNK is read per element (`_Plan.parts`,
# "@rowmod": an index per element, slower than a contiguous run), so only over small results,
# where the copy's launch costs more: a small model's bias.
ROW_MOD_MAX = 1 << 14


def pending_broadcast(src: AnyTensor, shape: Shape) -> AnyTensor | None:
    """`src` broadcast to `shape` as a pending tensor that fused kernels read in place, or None
    where they cannot (the caller copies). Either src's one element repeated (a splat, read
    once: the VJP of a full sum, say), or src repeated as one block that a fused kernel reads
    in place: a row over leading axes (a linear layer's bias: with a multiple of 256 elements
    (`DENSE_CHUNK`) each chunk of the kernel reads a contiguous run of it, else, over at most
    ROW_MOD_MAX elements, each element its own), or each element of src over a run of a
    multiple of 256 (a per-channel bias: the chunk reads one number)."""
    if not build_on_sighting or 0 in shape:
        return None
    repeat: tuple[int, int] | None = None  # None: a splat
    if src.size != 1:
        repeat = _block(src.shape, shape)
        if repeat is None:
            return None
        n, inner = repeat
        if not (inner % DENSE_CHUNK == 0 or (inner == 1 and (
                n % DENSE_CHUNK == 0 or math.prod(shape) <= ROW_MOD_MAX))):
            return None
    check_fits(shape, src.dtype, src.device)
    src.buffer  # noqa: B018 - realised: a generated kernel reads its elements
    return tensor(None, shape, src.dtype, src.device, Pending(None, (src,), 1, repeat))


def pending_view(kind: str, src: AnyTensor, shape: Shape, w: int, row: int, at: int
                 ) -> AnyTensor | None:
    """A block of `src` (or `src` put into zeros) as a pending tensor of `shape` that fused
    kernels read in place, or None where fusion is off (the caller copies). With src's rows of
    w elements placed `row` apart from `at` on (`block_view`), element i is, for

    - "take": src[(i // w) * row + at + i % w], those rows out of src (a split's piece, x[t]);
    - "put": src[(c // row) * w + c % row] where c = i - at lies on one of them (0 <= c,
      c % row < w, within src's rows), else 0: src's rows written into zeros (a piece's VJP).
      The pieces' VJPs and their sum are then one kernel, where each piece was a launch
      writing a whole tensor of zeros and the adds another.

    A pending src stays pending: a kernel evaluates its DAG at the view's indices. `w` and `row`
    are part of the structure (the kernel divides by constants), `at` is an argument.
    """
    if not build_on_sighting or 0 in shape or src.size == 0:
        return None
    check_fits(shape, src.dtype, src.device)
    if src.thunk is not None:
        force((src,))
    depth = 0
    p = src.pending
    if p is not None:
        if p.depth + 1 >= FUSE_DEPTH:
            realise(src)  # the chain is long enough: end it in a buffer
        else:
            p.uses += 1
            depth = p.depth
    return tensor(None, shape, src.dtype, src.device,
                  Pending(None, (src,), depth + 1, None, (kind, w, row, at)))


def take_of(t: AnyTensor) -> tuple[AnyTensor, int, int, int] | None:
    """The source and (w, row, at) of `t` where it is a pending take (see `pending_view`),
    for a kernel that reads the take in place; else None."""
    p = t.pending
    if p is None or p.view is None or p.view[0] != "take":
        return None
    _, w, row, at = p.view
    return p.operands[0], w, row, at


def block_view(shape: Shape, strides: Sequence[int], base: int) -> tuple[int, int, int] | None:
    """(w, row, at) where the strided view (`shape`, `strides` in elements, from `base`) of a
    C-order tensor reads rows of w contiguous elements placed `row` apart from `at` on (see
    `pending_view`), else None."""
    if 0 in shape:
        return None
    dims: list[tuple[int, int]] = []  # (size, stride) with adjacent contiguous dims merged
    for n, step in zip(shape, strides, strict=True):
        if n == 1:
            continue
        if dims and dims[-1][1] == step * n:
            dims[-1] = (dims[-1][0] * n, step)
        else:
            dims.append((n, step))
    if not dims or dims[-1][1] != 1 or len(dims) > 2:
        return None
    w = dims[-1][0]
    row = dims[0][1] if len(dims) == 2 else w
    if base % row + w > row and row != w:  # a row that runs into the next: not a block
        return None
    return w, row, base


def _view_copy(src: AnyTensor, shape: Shape, view: tuple[str, int, int, int]) -> AnyTensor:
    """`pending_view`'s value as copy kernels, for the node-by-node path."""
    kind, w, row, at = view
    if kind == "take":
        return strided_gather(src, (math.prod(shape) // w, w), [row, 1], at).with_shape(shape)
    return put_rows(src, shape, w, row, at)


def _leaf(p: Pending) -> tuple[str, tuple[int, ...]]:
    """A copy node's kind, part of a plan's structure ("" a splat, "@row" or "@each" a repeated
    block, "@take:w:row" or "@put:w:row" a view), and its sizes, arguments of the kernel (a
    put's also where its source's rows end)."""
    if p.view is not None:
        kind, w, row, at = p.view
        if kind == "take":
            return f"@take:{w}:{row}", (at,)
        size = p.operands[0].size
        if w == row:  # a run of src's size from at
            return f"@put:{w}:{row}", (at, size)
        return f"@put:{w}:{row}", (at % row, at // row, at // row + size // w)
    if p.repeat is None:
        return "", ()
    n, inner = p.repeat
    if inner != 1:
        return "@each", p.repeat
    return ("@row" if n % DENSE_CHUNK == 0 else "@rowmod"), p.repeat


def splat_source(t: AnyTensor) -> AnyTensor | None:
    """The one-element tensor that a pending splat `t` repeats (a kernel may read it with
    stride 0 instead of realising t), else None."""
    p = t.pending
    if p is None or p.expr is not None or p.repeat is not None or p.view is not None:
        return None
    src: AnyTensor = p.operands[0]
    return src


def _block(src: Shape, shape: Shape) -> tuple[int, int] | None:
    """(n, inner) where broadcasting `src` to `shape` makes element i that of src at
    (i // inner) % n: src's axes of size above 1 are adjacent and kept. Else None."""
    padded = (1,) * (len(shape) - len(src)) + tuple(src)
    kept = [d for d, size in enumerate(padded) if size != 1]
    if not kept:
        return None
    lo, hi = kept[0], kept[-1] + 1
    if any(padded[d] != shape[d] for d in range(lo, hi)):
        return None
    return math.prod(shape[lo:hi]), math.prod(shape[hi:])


# --- realising ----------------------------------------------------------------------------------


def realise(t: AnyTensor) -> Any:
    """Compute a pending tensor: in one generated kernel if its structure is hot, else node by
    node. The pending nodes it depends on stay pending, but for those that other pending
    recipes outside its DAG read (see `_planned`)."""
    with t.device.lock:  # one thread realises a DAG; the others then find it done
        if t.pending is None:
            return t.buffer
        return _realise(t)


def _realise(t: AnyTensor) -> Any:
    p: Any = t.pending
    done = p.value
    if done is not None:  # computed already, inside an earlier node-by-node run
        _resolve(t, done.buffer)
        return done.buffer
    for a in p.operands:
        if a.__class__ is AnyTensor and a.pending is not None:
            break
    else:  # one node over buffers (an add before a sigmoid, say): what `_by_node` runs
        p.value = _now(p.expr, p.operands, t.shape, t.dtype, t.device, p.repeat, p.view)
        buffer = p.value.buffer
        _resolve(t, buffer)
        return buffer
    if p.puts >= PUTS_MIN:
        buffer = _realise_puts(t)
        if buffer is not None:
            return buffer
    device = t.device
    plan = _planned(t)
    if len(plan.order) > 1 and build_on_sighting:
        kernel = _hot_kernel(plan, "map", t.dtype)
        if kernel is not None:
            out = empty(t.shape, t.dtype, device)
            # Each input is read at t's indices at most (a view's buffer may be larger): the
            # bytes that choose the launch's lane.
            device.launch(kernel, dense_size(t.size), (LOCAL,), out.buffer,
                          *[x.buffer for x in plan.inputs], *plan.scalars, *plan.sizes, t.size,
                          largest=out.nbytes)
            p = t.pending
            assert p is not None
            p.value = out  # for a reshape of t sharing its recipe (`with_shape`)
            _resolve(t, out.buffer)
            return out.buffer
    return _by_node(t, plan)


# A sum of at least this many puts is realised by `_realise_puts`: a fused kernel tests every put
# at every element, so its time grew with their number (an RNN's VJPs of x[:, t] for 30 steps:
# 1.3 ms, where its other kernels took 0.5); below, the fused kernel computes the puts' sources
# with the sum (a gate's VJP inside an LSTM's four), where this path realises each first.
PUTS_MIN = 8


def _realise_puts(t: AnyTensor) -> Any:
    """Realise pending `t` = ((base + put) + put) ... + put (`base` a put too, or anything) as
    base + 0 where no put lies and (base + x) + 0 where one puts x, as the sum of the puts and
    their zeros gives it bit for bit, when its puts number at least PUTS_MIN, of one (w, row)
    and not overlapping: `base` (or zeros), then the puts added into it in place, a launch per
    PUT_PARTS. Returns t's buffer, or None where t is not such a sum: its hints then cleared,
    a walk does not cut it out again (see `_Plan`)."""
    found = _puts_of(t)
    if found is None:
        node: Any = t  # down the chain as far as `_puts_of` walked: a sum read elsewhere
        while (node.__class__ is AnyTensor and node.pending is not None  # below is its own
               and node.pending.puts > 1 and (node is t or node.pending.uses == 1)):
            node.pending.puts = 0
            node = node.pending.operands[0]
        return None
    base, parts, w, row = found
    for src, _ in parts:
        src.buffer  # noqa: B018 - realised: the launch reads its elements
    device = t.device
    if base is None:
        out = empty(t.shape, t.dtype, device)
        fill_into(out, 0.0)
    else:
        out = elementwise(t.pending.expr, [base, 0.0], t.shape, t.dtype, device)
        out.buffer  # noqa: B018 - a fresh buffer, written once more below
    add_puts_into(out, parts, w, row)
    p = t.pending
    assert p is not None
    p.value = out  # for a reshape of t sharing its recipe (`with_shape`)
    _resolve(t, out.buffer)
    return out.buffer


def _puts_of(t: AnyTensor
             ) -> tuple[AnyTensor | None, list[tuple[AnyTensor, int]], int, int] | None:
    """(base, parts, w, row) where pending `t` is ((base + put) + put) ... + put over floats,
    its inner sums read by nothing else (base None where the first term is a put), with at
    least PUTS_MIN puts of one (w, row) that do not overlap: each put's (source, at); else
    None."""
    if t.dtype.kind != "f":
        return None
    puts: list[AnyTensor] = []
    node: Any = t
    base: Any = None
    while True:
        p = node.pending
        if p is None or p.value is not None or (node is not t and p.uses != 1):
            base = node
            break
        if p.view is not None:
            if p.view[0] != "put":
                base = node
            else:
                puts.append(node)
            break
        last: Any = p.operands[-1] if p.expr is not None and p.expr.name == "add" else None
        if (last.__class__ is not AnyTensor or last.pending is None or last.pending.view is None
                or not last.pending.puts):
            base = node
            break
        puts.append(last)
        node = p.operands[0]
        if node.__class__ is not AnyTensor:
            return None
    if len(puts) < PUTS_MIN:
        return None
    _, w, row, _ = puts[0].pending.view
    parts: list[tuple[AnyTensor, int]] = []
    spans: list[tuple[int, int, int]] = []  # (first column, first row, end row) of each
    for put in puts:
        _, w_put, row_put, at = put.pending.view
        if (w_put, row_put) != (w, row):
            return None
        src = put.pending.operands[0]
        parts.append((src, at))
        spans.append((0, at, at + src.size) if w == row else
                     (at % row, at // row, at // row + src.size // w))
    spans.sort()
    for (col, _, end), (next_col, start, _) in itertools.pairwise(spans):
        if (start < end) if next_col == col else (next_col - col < w):
            return None
    return base, parts, w, row


def _resolve(t: AnyTensor, buffer: Any) -> None:
    """Give `t` its buffer; its recipe no longer reads its pending operands."""
    p = t.pending
    assert p is not None
    for a in p.operands:
        if a.__class__ is AnyTensor and a.pending is not None:
            a.pending.uses -= 1
    t.resolve(buffer)


def _planned(t: AnyTensor) -> _Plan:
    """The plan of pending `t`, its shared nodes realised first (`_Plan.shared`): a node that a
    pending recipe outside t's DAG reads too would be walked, and computed, again by every
    later DAG that reaches it; in a buffer, it is computed once and later walks stop at it
    (an LSTM's cell-state gradient, read by four gates' gradients and by the step before, made
    the walks quadratic in the number of steps)."""
    plan = plan_of(t)
    first = True
    # Shared nodes once; nodes cut out of a view's space (see `_Plan`) until none is left,
    # each round realising some.
    while plan.shared and (first or plan.cut):
        for node in plan.shared:  # operands first: a later one's walk stops at the earlier
            if node.pending is not None:
                _realise(node)
        plan = plan_of(t)
        first = False
    # Too large for one kernel (a gradient summed over 320 steps reads 320 buffers): realise
    # a part that fits first, so it is one kernel rather than a launch per node.
    while build_on_sighting and not plan.fits():
        j = plan.part()
        if j < 1:
            break
        _realise(plan.order[j])
        plan = plan_of(t)
    return plan


def _by_node(t: AnyTensor, plan: _Plan) -> Any:
    """Realise `t` node by node with the core program's kernels; its buffer.

    Only `t` is resolved, as on the fused path, so the DAGs that later realisations see (and
    so their structures) do not depend on which path ran: a structure seen once is seen again
    the next step, and gets its kernel. The other nodes keep their values aside, so this path
    still computes each node once, like eager execution."""
    for node in plan.order:
        p = node.pending
        assert p is not None
        if p.value is None:
            p.value = _now(p.expr, [_computed(a) for a in p.operands], node.shape, node.dtype,
                           node.device, p.repeat, p.view)
    p = t.pending
    assert p is not None and p.value is not None
    buffer = p.value.buffer
    _resolve(t, buffer)
    return buffer


def _hot_kernel(plan: _Plan, sink: str, dtype: DType) -> Any:
    """The generated kernel of `plan` ending in `sink` ("map": write every element; "sum_rows":
    sum runs of them), if its structure is hot: counted here, built on the `fuse_after()`-th
    sighting, else None (in a survey: noted, see `surveying`)."""
    device = plan.order[-1].device
    key = (sink, dtype, plan.key)
    kernels = kernels_on(device)
    kernel = kernels.built.get(key)
    if kernel is None and plan.fits():
        survey = _SURVEY_GET()
        if survey is not None:
            if key not in survey:  # a structure repeated by every layer: its source once
                shared, own = plan.parts(dtype, sink)
                survey[key] = (device, dtype, shared, own)
            return None
        seen = kernels.seen.get(key, 0) + 1
        kernels.seen[key] = seen
        waiting = kernels.waiting
        # Inside tg.jit's recording (observed launches) a hot structure is built at its first
        # sighting: the recorded program then does not depend on how often it was seen before.
        if seen >= build_on_sighting or observed():
            if key not in waiting:
                waiting[key] = (device, dtype, *plan.parts(dtype, sink))
            batch = dict(waiting)
            waiting.clear()
            build_surveyed(batch)
            kernel = kernels.built[key]
        elif key not in waiting and len(waiting) < WAITING_MAX:
            waiting[key] = (device, dtype, *plan.parts(dtype, sink))
    return kernel


def _sink(x: AnyTensor, sink: str) -> tuple[_Plan, Any] | None:
    """The plan of a pending `x` and its kernel ending in `sink`, for a consumer that evaluates
    x's DAG inside its own kernel (`sum_rows`, `gather`); call with the device lock held. None
    if x is not pending, holds repeated blocks (they need the map's chunks), or its structure
    is not hot yet: x is then realised node by node here, without counting a sighting of its
    map kernel (the consumer reads its buffer), so no kernel gets built that the hot path would
    not use."""
    if not build_on_sighting or x.pending is None or x.pending.value is not None:
        return None
    if x.pending.puts >= PUTS_MIN and _realise_puts(x) is not None:
        return None
    plan = _planned(x)
    if plan.chunked:
        return None
    kernel = _hot_kernel(plan, sink, x.dtype)
    if kernel is None:
        _by_node(x, plan)
        return None
    return plan, kernel


def sum_rows(x: AnyTensor, out: AnyTensor, k: int, parts: int, chunk: int) -> bool:
    """Row sums of a pending `x` viewed as (rows, k), as `_reduction`'s reduce_sum_rows kernel
    computes them (`parts` chunks of `chunk` per row, same order), with x's DAG evaluated
    inside the sum, so x is never written. False (the caller sums x's buffer) where `_sink`
    gives no kernel."""
    with x.device.lock:
        found = _sink(x, "sum_rows")
        if found is None:
            return False
        plan, kernel = found
        x.device.launch(kernel, launch_size(out.size), (LOCAL,), out.buffer,
                        *[t.buffer for t in plan.inputs], *plan.scalars, *plan.sizes, k, parts,
                        chunk, out.size)
        return True


def pad_planes(x: AnyTensor, out: AnyTensor, pad: tuple[int, int, int, int], local: int
               ) -> bool:
    """`pad_planes` (the convolutions' zero padding: each (H, W) plane of a pending `x` into
    the middle of a (H + 2 PH, W + 2 PW) plane of `out`, `pad` = (H, W, PH, PW)) with x's DAG
    evaluated inside it, so x is never written: a relu between a norm and a convolution is no
    launch of its own. One work-item a plane, in groups of `local`, as the plain kernel. False
    (the caller pads x's buffer) where `_sink` gives no kernel."""
    with x.device.lock:
        found = _sink(x, "pad")
        if found is None:
            return False
        plan, kernel = found
        h, w, ph, pw = pad
        planes = out.size // ((h + 2 * ph) * (w + 2 * pw))
        x.device.launch(kernel, launch_size(planes, local), (local,), out.buffer,
                        *[t.buffer for t in plan.inputs], *plan.scalars, *plan.sizes, h, w, ph,
                        pw, planes)
        return True


def _through_take(sizes: Sequence[int], steps: Sequence[int], base: int, w: int, row: int,
                  at: int) -> tuple[list[int], int] | None:
    """The steps and base in a take's source (rows of w placed `row` apart from `at`, see
    `pending_view`) of a gather over the take, where they are linear: each dim steps whole
    rows (a multiple of w) or stays inside the row the gather starts in. A heads' transpose of
    a split's piece, say. Else None."""
    through: list[int] = []
    end = base % w  # the last column read in the start's row
    for n, step in zip(sizes, steps, strict=True):
        if step < 0:
            return None
        if n == 1:
            through.append(0)
        elif step % w == 0:
            through.append(step // w * row)
        else:
            through.append(step)
            end += (n - 1) * step
    if end >= w:
        return None
    return through, base // w * row + at + base % w


def gather(src: AnyTensor, out: AnyTensor, sizes: Sequence[int], steps: Sequence[int],
           base: int) -> bool:
    """`strided_gather` of a pending `src` with src's DAG evaluated at the gathered positions,
    so src is never written: out[idx] = src[base + sum(idx * steps)] over `sizes` (merged dims,
    at most CORE_DIMS), read as the copy kernels read. A transposed relu_grad, say, is one
    launch, not two. False (the caller gathers src's buffer) where `_sink` gives no kernel.
    A take of a computed tensor is gathered from its source by the copy kernels where the
    positions compose (`_through_take`)."""
    take = take_of(src)
    if take is not None and take[0].pending is None:
        through = _through_take(sizes, steps, base, *take[1:])
        if through is not None:  # a copy of the take's source: the copy kernels' loops
            gather_into(take[0], out, tuple(sizes), *through)
            return True
    with src.device.lock:
        found = _sink(src, f"gather{len(sizes)}")
        if found is None:
            return False
        plan, kernel = found
        size, counts, dims = gather_shape(sizes, steps, src.device, len(sizes))
        src.device.launch(kernel, size, (LOCAL,), out.buffer, *[t.buffer for t in plan.inputs],
                          *plan.scalars, *plan.sizes, *counts, base, *dims)
        return True


def _now(expr: Expression | None, operands: Sequence[AnyTensor | float], shape: Shape,
         dtype: DType, device: Device, repeat: tuple[int, int] | None = None,
         view: tuple[str, int, int, int] | None = None) -> AnyTensor:
    """One node computed at once with a prebuilt kernel: `expr` over the operands, or (expr
    None) the view or broadcast of operands[0], as one copy. The copy is read from its `view` or
    `repeat` (see Pending), not from `shape`: a pending tensor reshaped (`with_shape`) shares
    its recipe under another shape."""
    if expr is None:
        src = operands[0]
        assert isinstance(src, AnyTensor)
        if view is not None:
            return _view_copy(src, shape, view)
        if repeat is None:  # a splat
            return strided_gather(src, shape, [0] * len(shape))
        n, inner = repeat
        size = math.prod(shape)
        return strided_gather(src, (size // (n * inner), n, inner), [0, 1, 0]).with_shape(shape)
    out = empty(shape, dtype, device)
    if expr.heavy and len(operands) == 1 and isinstance(operands[0], AnyTensor):
        # A heavy op over a take (an LSTM's gate): its kernel reads the take's source in place.
        take = take_of(operands[0])
        if take is not None and run_over_view(expr, *take, out):
            return out
    run_expression(expr, operands, out)
    return out


def _computed(a: AnyTensor | float) -> AnyTensor | float:
    if isinstance(a, AnyTensor) and a.pending is not None:
        assert a.pending.value is not None
        return a.pending.value
    return a


# How a node of a plan refers to an operand: a pending node by its position j (0, 1, ...), an
# input buffer k as INPUT - k, a scalar argument k as SCALAR + k, a size argument k (the n and
# inner of a repeated block) as SIZE + k.
INPUT = -1
SCALAR = 1 << 20
SIZE = 2 << 20


# A node shallower than this is recomputed by every DAG that reads it, never cut out (see
# `_planned`): one op over buffers costs a later kernel a few loads and flops, less than a
# launch of its own.
SHARED_DEPTH = 2


def _shared(read_more: list[AnyTensor], top: AnyTensor, reads: list[int]) -> list[AnyTensor]:
    """Of `read_more`, nodes of top's DAG with more than one pending reader, those to cut out:
    SHARED_DEPTH deep, read also from outside the DAG (more readers than its `reads` of
    each), and found so by an earlier plan too. A reader outside may be done with (a forward
    node that a sum has read, whose input a backward DAG reads), so the first plan only notes
    it: a chain's forward and backward DAGs each stay one kernel, while a node that every
    step's DAGs reach is cut out by the second of them."""
    out: list[AnyTensor] = []
    for node, n in zip(read_more, reads, strict=True):
        p: Any = node.pending
        if p.uses > n and p.depth >= SHARED_DEPTH and node is not top:
            if p.seen:
                out.append(node)
            else:
                p.seen = True
    return out


# The kinds of copy node that a kernel reads by its map's chunks (see `pending_broadcast`).
_CHUNKED = ("@row", "@rowmod", "@each")


@dataclass
class _Spaces:
    """Index spaces of a plan's kernel: a view's pending source is evaluated at the view's
    indices, in a space of its own, whose index variable (i{j}, j the view's slot) is computed
    up front from its reader's; the DAG's is `i`. A view's source is placed just before it, its
    subtree contiguous below (see `_Plan`'s walk); a put's is evaluated only on its block.

    `space`: each node's index variable; `indices`: the lines that compute them, readers
    first; `opens`: slot -> the puts whose block opens there, outer first; `rows`: where the
    line computing an index's row and column (`r{idx}_{len}`, `c{idx}_{len}`) is, by its name;
    `passed`: the size arguments the lines read."""

    space: list[str]
    indices: list[str]
    opens: dict[int, list[int]]
    rows: dict[str, int]
    passed: list[tuple[str, str]]


def _index_spaces(nodes: Sequence[tuple[Any, ...]]) -> _Spaces:
    """Each node's index space, and the C that computes the spaces' indices (see `_Spaces`)."""
    n = len(nodes)
    space = ["i"] * n
    low = list(range(n))  # the first slot of each node's subtree
    for j, node in enumerate(nodes):
        for ref in node[:-1]:
            if 0 <= ref < SCALAR and low[ref] < low[j]:
                low[j] = low[ref]
    indices: list[str] = []
    opens: dict[int, list[int]] = {}  # slot -> the puts whose block opens there, outer first
    split_at: dict[str, int] = {}  # where each row-and-column line is, by its name
    passed: list[tuple[str, str]] = []

    def row_col(idx: str, length: int | str) -> str:
        """The name `on` of idx's row r{on} and column c{on} among rows of `length`, the line
        computing them written once for the views that share it."""
        on = f"{idx}_{length}"
        if on not in split_at:
            split_at[on] = len(indices)
            indices.append(f"  const long r{on} = {idx} / {length}L, c{on} = {idx} % {length}L;\n")
        return on

    for j in range(n - 1, -1, -1):  # readers first: a node's space is its reader's
        name, refs = nodes[j][-1], nodes[j][:-1]
        inner = space[j]
        if name[:2] in ("@t", "@p"):  # a view (see `pending_view`), w and row constants
            kind, w, row = name[1:].split(":")
            idx, at = space[j], f"z{refs[1] - SIZE}"
            passed.append(("long", at))
            if kind == "take" and w == row:
                indices.append(f"  const long i{j} = {idx} + {at};\n")
            elif kind == "take":  # idx's rows of w from src's rows of `row`
                on = row_col(idx, w)
                indices.append(f"  const long i{j} = r{on} * {row}L + {at} + c{on};\n")
            elif w == row:  # one run: c = idx - at on [0, size of src)
                end = f"z{refs[2] - SIZE}"
                passed.append(("long", end))
                indices.append(f"  const long i{j} = {idx} - {at};\n"
                               f"  const int in{j} = i{j} >= 0 && i{j} < {end};\n")
            else:  # rows [r0, r1) of idx's rows of `row`, columns [at, at + w) of them
                r0, r1 = f"z{refs[2] - SIZE}", f"z{refs[3] - SIZE}"
                passed += [("long", r0), ("long", r1)]
                on = row_col(idx, row)
                indices.append(
                    f"  const long k{j} = c{on} - {at};\n"
                    f"  const int in{j} = k{j} >= 0 && k{j} < {w}L && r{on} >= {r0} && "
                    f"r{on} < {r1};\n"
                    f"  const long i{j} = (r{on} - {r0}) * {w}L + k{j};\n")
            if kind != "take" and refs[0] >= 0:  # its source's DAG, only on its rows
                opens.setdefault(low[int(refs[0])], []).append(j)
            inner = f"i{j}"
        for ref in refs:
            if 0 <= ref < SCALAR:
                space[ref] = inner
    return _Spaces(space, indices, opens, split_at, passed)


class _Plan:
    """A pending DAG as a kernel: its nodes in order (operands first), its structure key, its
    input buffers and its scalar arguments, found in one walk.

    Equal scalars share one argument (compared with their sign, so -0.0 is not 0.0). The walk
    runs on every realisation, so it is kept lean: a chain is walked in a loop (the 200-op
    chain's forward: 139 -> 102 us), and recursion, at branches only, is bounded by FUSE_DEPTH.

    `shared`: the nodes below the top, operands first, that pending recipes outside the DAG
    read too (`Pending.uses` above the reads inside it), at least SHARED_DEPTH deep.
    """

    def __init__(self, t: AnyTensor) -> None:
        input_slots: dict[AnyTensor, int] = {}
        scalar_slots: dict[float | tuple[float, float], int] = {}
        inputs: list[AnyTensor] = []
        scalars: list[float] = []
        sizes: list[int] = []
        nodes: list[tuple[Any, ...]] = []
        order: list[AnyTensor] = []
        copysign = math.copysign
        input_of, scalar_of = input_slots.get, scalar_slots.get
        # Nodes with more than one pending reader, and their slots.
        read_more: list[tuple[AnyTensor, int]] = []
        chunked = False
        again: list[int] = []  # the slot of a node each time the DAG reads it after the first

        def visit(top: AnyTensor, slots: dict[AnyTensor, int], inner: bool) -> int:
            # Down the spine first (each node's first operand still to visit), in a loop: a
            # chain, the common DAG, costs no recursion. Then the spine's nodes bottom-up, each
            # after its other unvisited operands (recursively): the order a recursive walk
            # gives, one Python call per branch rather than per node. A spine node's slot is
            # known as `below` to the node above it, which needs no lookup for it.
            # `slots`: the nodes placed in this walk's index space. A view's pending source is
            # evaluated at other indices: a space of its own (see `parts`), walked apart
            # (`inner`). There, a node that another pending recipe reads too is cut out (a
            # buffer first): walked in every space that reaches it, nested views (a shifted
            # sum's pads) made the walk exponential in their depth.
            nonlocal chunked
            slot_of = slots.get
            spine = [top]
            node: Any = top
            while node.pending.view is None:
                for a in node.pending.operands:
                    if (a.__class__ is AnyTensor and a.pending is not None and a not in slots
                            and not (inner and a.pending.uses > 1)
                            and a.pending.puts < PUTS_MIN):
                        spine.append(a)
                        node = a
                        break
                else:
                    break
            child: Any = None
            below = -1
            for node in reversed(spine):
                p: Any = node.pending  # a Pending: only pending nodes are visited
                refs: list[Any] = []
                for a in p.operands:
                    if a is child:
                        refs.append(below)
                        child = None  # read twice (x * x): the second read is counted again
                    elif a.__class__ is AnyTensor:
                        if a.pending is not None:
                            if (((inner or p.view is not None) and a.pending.uses > 1)
                                    or a.pending.puts >= PUTS_MIN):  # see `_realise_puts`
                                cut.append(a)
                                refs.append(INPUT)  # replanned once `a` is a buffer
                                continue
                            j = None if p.view is not None else slot_of(a)
                            if j is None:
                                refs.append(visit(  # noqa: F821 - del'd below
                                    a, {} if p.view is not None else slots,
                                    inner or p.view is not None))
                            else:
                                refs.append(j)
                                again.append(j)
                            continue
                        k = input_of(a)
                        if k is None:
                            k = input_slots[a] = len(inputs)
                            inputs.append(a)
                        refs.append(INPUT - k)
                    else:
                        # Keyed by value; a zero also by its sign (0.0 == -0.0, but 1/x differs).
                        # A traced number of tg.jit keeps a slot of its own: its value may
                        # meet another's on one call only, and comparing it notes a guard.
                        if a.__class__ is float:
                            skey = a if a else (a, copysign(1.0, a))
                            k = scalar_of(skey)
                            if k is None or a != a:  # NaN: never equal, one slot each
                                k = scalar_slots[skey] = len(scalars)
                                scalars.append(a)
                        else:
                            k = len(scalars)
                            scalars.append(a)
                        refs.append(SCALAR + k)
                expr = p.expr
                if expr is None:  # a copy: its sizes are arguments, its kind is structure
                    kind, args = _leaf(p)
                    refs += [SIZE + len(sizes) + k for k in range(len(args))]
                    refs.append(kind)
                    sizes.extend(args)
                    if kind in _CHUNKED:
                        chunked = True
                else:
                    refs.append(expr.name)
                below = slots[node] = len(order)
                if p.uses > 1:
                    read_more.append((node, below))
                child = node
                nodes.append(tuple(refs))
                order.append(node)
            return len(order) - 1  # the top's slot: the last node placed

        slots: dict[AnyTensor, int] = {}
        cut: list[AnyTensor] = []  # see `visit`
        visit(t, slots, False)
        # `visit` refers to itself through its closure: a reference cycle that would keep every
        # tensor of the DAG (and their buffers) alive until the cyclic GC runs. Break it.
        del visit
        self.order = order
        self.inputs = inputs
        self.scalars = scalars
        self.sizes = sizes
        self.nodes = nodes
        self.chunked = chunked
        self.key = (tuple(nodes), len(inputs), len(scalars), len(sizes))
        self.shared: list[AnyTensor] = []
        if read_more:
            reads = dict.fromkeys(again, 1)
            for j in again:
                reads[j] += 1
            self.shared = _shared([n for n, _ in read_more], t,
                                  [reads.get(j, 1) for _, j in read_more])
        # Cut out of a view's space: realised first (`_planned`), then the DAG planned again.
        self.cut = bool(cut)
        self.shared = list(dict.fromkeys([*cut, *self.shared]))

    @classmethod
    def made(cls, order: list[AnyTensor], inputs: list[AnyTensor], scalars: list[float],
             sizes: list[int], skeleton: _Skeleton) -> _Plan:
        """A plan found by replaying `skeleton` (see `plan_of`), not by a walk."""
        plan = cls.__new__(cls)
        plan.order, plan.inputs, plan.scalars, plan.sizes = order, inputs, scalars, sizes
        plan.nodes, plan.key, plan.chunked = skeleton.nodes, skeleton.key, skeleton.chunked
        plan.shared, plan.cut = [], False
        return plan

    def fits(self) -> bool:
        """Whether one kernel may take it: its length and its arguments."""
        return (len(self.nodes) <= MAX_NODES
                and len(self.inputs) + len(self.scalars) + len(self.sizes) <= MAX_ARGS)

    def part(self) -> int:
        """The last node (by position, below the top) whose DAG fits one kernel: it lies
        within the nodes before it, whose arguments are at most those they number."""
        inputs = scalars = sizes = 0
        last = -1
        for j, refs in enumerate(self.nodes[: min(MAX_NODES, len(self.nodes) - 1)]):
            for ref in refs:
                if ref.__class__ is not int:
                    continue
                if ref >= SIZE:
                    sizes = max(sizes, ref - SIZE + 1)
                elif ref >= SCALAR:
                    scalars = max(scalars, ref - SCALAR + 1)
                elif ref < 0:
                    inputs = max(inputs, INPUT - ref + 1)
            if inputs + scalars + sizes > MAX_ARGS:
                break
            last = j
        return last

    def source(self, dtype: DType, sink: str = "map") -> str:
        """The kernel: every node per element, in registers (splats read once, up front); `sink`
        says what becomes of the last node's values (see `_hot_kernel`). Repeated blocks rely on
        the map's chunks of DENSE_CHUNK, so only "map" takes them."""
        shared, own = self.parts(dtype, sink)
        return "".join(shared) + own

    def parts(self, dtype: DType, sink: str = "map") -> tuple[list[str], str]:
        """`source` as the parts other kernels of the dtype may share (the prelude, the
        expressions' functions) and this kernel's own (`tgf_eval` and the kernel `fused`)."""
        assert sink == "map" or not self.chunked
        exprs: dict[str, Expression] = {}  # by name, in order of first use
        for node in self.order:
            expr = node.pending.expr if node.pending is not None else None
            if expr is not None:
                exprs.setdefault(expr.name, expr)
        helpers = dict.fromkeys(e.helpers for e in exprs.values())
        parts = [fp64_pragma(dtype), f"typedef {C_TYPES[dtype]} T;\n", CONTRACT_OFF,
                 DENSE_PRELUDE, expression_prelude(), *helpers]
        for e in exprs.values():
            params = ", ".join(f"const T {name}" for name in e.names[: e.arity])
            parts.append(f"inline T tgf_{e.name}({params}) {{ return ({e.expr}); }}\n")
        shared = parts
        parts: list[str] = []
        data = [f"__global const T* x{k}_" for k in range(len(self.inputs))]
        data += [f"const T s{k}" for k in range(len(self.scalars))]
        names = [f"x{k}_" for k in range(len(self.inputs))]
        names += [f"s{k}" for k in range(len(self.scalars))]
        nodes = self.nodes
        n = len(nodes)
        spaces = _index_spaces(nodes)
        space, indices, opens = spaces.space, spaces.indices, spaces.opens
        split_at, passed = spaces.rows, spaces.passed
        loaded: list[int] = []  # inputs read at `i`, up front
        loaded_at: set[tuple[int, str]] = set()  # inputs read in other spaces, where first used
        head: list[str] = []
        body: list[str] = []
        # What the kernel computes once, before its loop, and hands to every element: a
        # splat's or a per-chunk block's value, a row block's offset into its row; and the
        # sizes that views read.
        start = f"(get_global_id(0) * {DENSE_CHUNK})"  # of this work-item's chunk
        for j, node in enumerate(nodes):
            for v in opens.get(j, ()):
                body.append(f"  T v{v} = (T)0;\n  if (in{v}) {{\n")
            name, refs = node[-1], node[:-1]
            idx = space[j]
            if not name:  # a splat: its input's one element, read once by the kernel
                head.append(f"  const T v{j} = x{INPUT - refs[0]}_[0];\n")
                passed.append(("T", f"v{j}"))
                continue
            if name in _CHUNKED and idx != "i":  # per element, not per chunk, in a view
                src, zn = INPUT - refs[0], f"z{refs[1] - SIZE}"
                passed.append(("long", zn))
                if name == "@each":
                    zi = f"z{refs[2] - SIZE}"
                    passed.append(("long", zi))
                    body.append(f"  const T v{j} = x{src}_[({idx} / {zi}) % {zn}];\n")
                else:
                    body.append(f"  const T v{j} = x{src}_[{idx} % {zn}];\n")
                continue
            if name == "@each":  # element (i // inner) % n, one per chunk: inner % CHUNK == 0
                src, m, inner = INPUT - refs[0], refs[1] - SIZE, refs[2] - SIZE
                head.append(f"  const T v{j} = x{src}_[({start} / z{inner}) % z{m}];\n")
                passed.append(("T", f"v{j}"))
                continue
            if name == "@rowmod":
                # Element i % n (i below ROW_MOD_MAX): the chunk's first offset into its row
                # once, then per element a quotient estimated in float (off by at most one)
                # and corrected, which vectorizes where a division would not.
                src, m = INPUT - refs[0], refs[1] - SIZE
                head.append(f"  const long o{j} = {start} % z{m} - {start};\n"
                            f"  const float w{j} = 1.0f / (float)z{m};\n")
                passed += [("long", f"o{j}"), ("float", f"w{j}"), ("long", f"z{m}")]
                body.append(
                    f"  const int e{j} = (int)(i + o{j});\n"
                    f"  int r{j} = e{j} - (int)((float)e{j} * w{j}) * (int)z{m};\n"
                    f"  r{j} += r{j} < 0 ? (int)z{m} : 0;\n"
                    f"  r{j} -= r{j} >= (int)z{m} ? (int)z{m} : 0;\n"
                    f"  const T v{j} = x{src}_[r{j}];\n")
                continue
            if name == "@row":  # element i % n, a run per chunk: n % CHUNK == 0
                src, m = INPUT - refs[0], refs[1] - SIZE
                head.append(f"  const long o{j} = {start} % z{m} - {start};\n")
                passed.append(("long", f"o{j}"))
                body.append(f"  const T v{j} = x{src}_[i + o{j}];\n")
                continue
            if name[:2] in ("@t", "@p"):
                ref = refs[0]
                if ref >= 0 and name[1] == "p":  # its block, opened at its subtree's start
                    body.append(f"    v{j} = v{ref};\n  }}\n")
                elif ref >= 0:
                    body.append(f"  const T v{j} = v{ref};\n")
                elif name[1] == "p":
                    body.append(f"  const T v{j} = in{j} ? x{INPUT - ref}_[i{j}] : (T)0;\n")
                else:
                    body.append(f"  const T v{j} = x{INPUT - ref}_[i{j}];\n")
                continue
            args: list[str] = []
            for ref in refs:
                if ref >= SCALAR:
                    args.append(f"s{ref - SCALAR}")
                elif ref >= 0:
                    args.append(f"v{ref}")
                elif idx == "i":
                    if INPUT - ref not in loaded:
                        loaded.append(INPUT - ref)
                    args.append(f"x{INPUT - ref}")
                else:
                    k = INPUT - ref
                    if (k, idx) not in loaded_at:
                        loaded_at.add((k, idx))
                        body.append(f"  const T x{k}{idx} = x{k}_[{idx}];\n")
                    args.append(f"x{k}{idx}")
            body.append(f"  const T v{j} = tgf_{name}({', '.join(args)});\n")
        passed = list(dict.fromkeys(passed))
        loads = "".join(f"  const T x{k} = x{k}_[i];\n" for k in loaded)
        last = f"v{n - 1}"
        # One element as a function of its index (inlined). The splats come in as values read
        # before the loop: a load in the loop could alias the stores and stop vectorizing.
        params = ["const long i", *data, *(f"const {t} {v}" for t, v in passed)]
        # Views of the DAG's own index with one row length: the kernel's loop runs along the
        # rows and hands each element's row and column in, so that a view's reads are
        # consecutive within a row and the loop vectorizes (a put's: masked loads).
        rows = [rc for rc in split_at if rc.startswith("i_")]
        along = int(rows[0][2:]) if len(rows) == 1 else 0
        if along:
            indices[split_at[rows[0]]] = ""
            params += [f"const long r{rows[0]}", f"const long c{rows[0]}"]
        parts.append(f"inline T tgf_eval({', '.join(params)}) {{\n"
                     f"{''.join(indices)}{loads}{''.join(body)}  return {last};\n}}\n")
        at = ", ".join([*names, *(v for _, v in passed)])

        def rc(x: str) -> str:  # the row and column arguments at index x, if any
            return f", ({x}) / {along}L, ({x}) % {along}L" if along else ""

        data += [f"const long z{k}" for k in range(len(self.sizes))]
        # The output is a fresh buffer, never an input's (a jitted program's memory plan
        # places no output in a buffer its launch reads): `restrict` spares LLVM a runtime
        # overlap check per input, which kept many-input loops from vectorizing (the put of
        # an LSTM's four gates' gradients: eight inputs).
        out = "__global T* restrict out_"
        if sink == "map":
            params = [out, *data, "const long n"]
            loop = f"  TG_EACH(n) out_[i] = tgf_eval(i, {at});\n" if not along else (
                f"  long i = get_global_id(0) * {DENSE_CHUNK};\n"
                f"  const long i_end_ = min(n, i + {DENSE_CHUNK});\n"
                "  while (i < i_end_) {\n"
                f"    const long r_ = i / {along}L;\n    long c_ = i - r_ * {along}L;\n"
                f"    const long e_ = min(i_end_, i + ({along}L - c_));\n"
                f"    for (; i < e_; ++i, ++c_) out_[i] = tgf_eval(i, {at}, r_, c_);\n  }}\n")
            parts.append(
                f"__kernel void fused({', '.join(params)}) {{\n{''.join(head)}{loop}}}\n")
        elif sink.startswith("gather"):  # the copy kernels' gather over the values
            d = int(sink[len("gather"):])
            dims = [f"const long gs{i}, const long gt{i}" for i in range(d)]
            params = [out, *data, "const long rows", "const long chunks",
                      "const long per", "const long base", *dims]
            parts.append(
                f"__kernel void fused({', '.join(params)}) {{\n{''.join(head)}"
                + gather_loop(d, f"out_[dense + j] = tgf_eval(off + j, {at}{rc('off + j')});",
                              f"out_[dense + j] = tgf_eval(off + j * step, {at}"
                              f"{rc('off + j * step')});") + "}\n")
        elif sink == "pad":  # conv's pad_planes over the values (see `pad_planes`)
            params = [out, *data, "const long H", "const long W", "const long PH",
                      "const long PW", "const long n"]
            at_c = "b_ + yy_ * W + c_"
            parts.append(
                f"__kernel void fused({', '.join(params)}) {{\n{''.join(head)}"
                "  const long plane_ = get_global_id(0);\n  if (plane_ >= n) return;\n"
                "  const long Wp_ = W + 2 * PW, Hp_ = H + 2 * PH, b_ = plane_ * H * W;\n"
                "  __global T* po_ = out_ + plane_ * Hp_ * Wp_;\n"
                "  for (long y_ = 0; y_ < Hp_; ++y_, po_ += Wp_) {\n"
                "    const long yy_ = y_ - PH;\n"
                "    if (yy_ < 0 || yy_ >= H) {\n"
                "      for (long c_ = 0; c_ < Wp_; ++c_) po_[c_] = (T)0;\n      continue;\n    }\n"
                "    for (long c_ = 0; c_ < PW; ++c_) po_[c_] = (T)0;\n"
                f"    for (long c_ = 0; c_ < W; ++c_) po_[PW + c_] = tgf_eval({at_c}, {at}"
                f"{rc(at_c)});\n"
                "    for (long c_ = PW + W; c_ < Wp_; ++c_) po_[c_] = (T)0;\n  }\n}\n")
        else:  # "sum_rows": _reduction's reduce_sum_rows over the values, in its order
            params = [out, *data, "const long K", "const long P", "const long chunk",
                      "const long n"]
            shared.append(KAHAN)
            total = row_sum(lambda i: f"tgf_eval(base + {i}, {at}{rc(f'base + {i}')})")
            parts.append(
                f"__kernel void fused({', '.join(params)}) {{\n{''.join(head)}"
                "  const long gid = get_global_id(0);\n  if (gid >= n) return;\n"
                "  const long p = gid % P, base = (gid / P) * K;\n"
                "  const long k0 = p * chunk, k1 = min(K, k0 + chunk);\n"
                f"{total}  out_[gid] = total_;\n}}\n")
        return shared, "".join(parts)


# --- replaying a plan's walk ---------------------------------------------------------------------
# The walk costs ~0.37 us a node, and a training step realises the same structures every step:
# a 200-op chain's forward walked 200 nodes and its backward 331, 1 us of its ~6 an op. So the
# first walk of a structure is kept as a skeleton: for each node (top down) the operand of an
# already reached node through which to reach it, and where each input and scalar is read. The
# next DAG whose top has the same expression and depth replays it: it follows those steps and
# checks, at every node, that it is pending with the skeleton's expression, that every shared
# node, input and scalar the skeleton merged is the same one again (equal scalars, with the
# sign of a zero), and that inputs are computed tensors. Any difference and it walks instead
# (and keeps that walk's skeleton). A DAG that passes has the skeleton's structure, but for
# what the skeleton kept apart and the DAG shares (a node, an input or an equal scalar): it gets
# the skeleton's key and kernel, which evaluates such a node twice or reads such an argument
# twice, the same values. Skeletons hold no tensors.
SKELETON_MIN = 8  # nodes: smaller DAGs walk as fast as they replay
SKELETONS_MAX = 512  # keys kept at most (top expression and depth); then they start over
# Skeletons kept per key: DAGs of different structures may share one (an LSTM step's gate
# gradients and its cell state's, both an add at one depth), and with one skeleton a key
# each evicted the other's, so both were walked every step.
SKELETONS_PER_KEY = 4
_skeletons: dict[tuple[Any, int], list[_Skeleton]] = {}


class _Skeleton:
    """A walk to replay (see above). `steps`: (j, (i, k)), node j is operand k of node i
    (i > j), top down; `merged`: (i, k, j), operand k of node i is node j again; `inputs` and
    `scalars`: (i, k) of each argument's first read; `same_inputs`/`same_scalars`: (i, k, s),
    a later read of argument s; `copies`: (i, kind) for each copy node, in node order, its
    kind as `_leaf` names it (its sizes are arguments)."""

    __slots__ = ("chunked", "copies", "exprs", "inputs", "key", "merged", "nodes", "reads",
                 "same_inputs", "same_scalars", "scalars", "steps")

    def __init__(self, plan: _Plan) -> None:
        n = len(plan.order)
        exprs: list[Any] = []
        for node in plan.order:
            p: Any = node.pending
            exprs.append(p.expr)
        steps: list[tuple[int, int] | None] = [None] * n
        merged: list[tuple[int, int, int]] = []
        inputs: list[tuple[int, int] | None] = [None] * len(plan.inputs)
        scalars: list[tuple[int, int] | None] = [None] * len(plan.scalars)
        same_inputs: list[tuple[int, int, int]] = []
        same_scalars: list[tuple[int, int, int]] = []
        copies: list[tuple[int, str]] = []
        for i in range(n - 1, -1, -1):  # top down: every node is reached from a later one
            refs: tuple[Any, ...] = plan.nodes[i]
            if exprs[i] is None:  # a copy: its input, then its sizes and its kind
                copies.append((i, str(refs[-1])))
                refs = refs[:1]
            else:
                refs = refs[:-1]
            for k, ref in enumerate(refs):
                if ref >= SCALAR:
                    s = ref - SCALAR
                    if scalars[s] is None:
                        scalars[s] = (i, k)
                    else:
                        same_scalars.append((i, k, s))
                elif ref >= 0:
                    if steps[ref] is None:
                        steps[ref] = (i, k)
                    else:
                        merged.append((i, k, ref))
                else:
                    s = INPUT - ref
                    if inputs[s] is None:
                        inputs[s] = (i, k)
                    else:
                        same_inputs.append((i, k, s))
        self.exprs = exprs
        self.steps = [(j, step) for j, step in enumerate(steps) if step is not None][::-1]
        self.merged = merged
        self.reads = [1] * n  # how often the DAG reads each node (for `_Plan.shared`)
        for _, _, j in merged:
            self.reads[j] += 1
        self.inputs = [at for at in inputs if at is not None]
        self.scalars = [at for at in scalars if at is not None]
        self.same_inputs = same_inputs
        self.same_scalars = same_scalars
        self.copies = sorted(copies)  # in node order, as the walk lists their sizes
        self.chunked = plan.chunked
        self.nodes = plan.nodes
        self.key = plan.key

    def replay(self, top: AnyTensor) -> _Plan | None:
        """The plan of `top`'s DAG if it has this structure, else None."""
        exprs = self.exprs
        order: list[Any] = [None] * len(exprs)
        order[-1] = top
        read_more: list[int] = []
        for j, (i, k) in self.steps:
            node = order[i].pending.operands[k]
            if node.__class__ is not AnyTensor:
                return None
            p = node.pending
            if p is None or p.expr is not exprs[j] or p.puts >= PUTS_MIN:
                return None
            order[j] = node
            if p.uses > 1:
                read_more.append(j)
        for i, k, j in self.merged:
            if order[i].pending.operands[k] is not order[j]:
                return None
        inputs: list[Any] = []
        for i, k in self.inputs:
            a = order[i].pending.operands[k]
            if a.__class__ is not AnyTensor or a.pending is not None:
                return None
            inputs.append(a)
        for i, k, s in self.same_inputs:
            if order[i].pending.operands[k] is not inputs[s]:
                return None
        scalars: list[Any] = []
        for i, k in self.scalars:
            v = order[i].pending.operands[k]
            if v.__class__ is not float or v != v:  # NaN: the walk gives each its own slot
                return None
            scalars.append(v)
        for i, k, s in self.same_scalars:  # merged by the walk: equal, a zero's sign too
            v, w = order[i].pending.operands[k], scalars[s]
            if v.__class__ is not float or v != w or (
                    not v and math.copysign(1.0, v) != math.copysign(1.0, w)):
                return None
        sizes: list[int] = []
        for i, kind in self.copies:
            found, args = _leaf(order[i].pending)
            if found != kind:
                return None
            sizes.extend(args)
        plan = _Plan.made(order, inputs, scalars, sizes, self)
        if read_more:
            read_more.reverse()  # operands first
            reads = self.reads
            plan.shared = _shared([order[j] for j in read_more], top, [reads[j] for j in read_more])
        return plan


def plan_of(t: AnyTensor) -> _Plan:
    """The plan of pending `t`'s DAG: a replayed skeleton where one fits, else a walk."""
    p: Any = t.pending
    key = (p.expr if p.expr is not None else _leaf(p)[0], p.depth)
    kept = _skeletons.get(key)
    if kept is not None:
        for n, skeleton in enumerate(kept):
            plan = skeleton.replay(t)
            if plan is not None:
                if n:  # the one that fits first next time
                    kept.insert(0, kept.pop(n))
                return plan
    plan = _Plan(t)
    # A DAG with shared nodes is planned again once they are cut out (`_planned`): the next
    # step replays both plans (a replay finds the shared nodes as a walk does).
    if len(plan.order) >= SKELETON_MIN and plan.fits() and not plan.cut:
        if kept is None:
            if len(_skeletons) >= SKELETONS_MAX:
                _skeletons.clear()
            kept = _skeletons[key] = []
        kept.insert(0, _Skeleton(plan))
        del kept[SKELETONS_PER_KEY:]
    return plan

