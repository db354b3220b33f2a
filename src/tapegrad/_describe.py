"""Seeing the tape: a table of its nodes, Graphviz DOT source, and a rendered drawing.

- `describe(tape)` returns the table as a string (`print(tg.describe(tape))`): one row per op
  the user called (a call that recorded several primitive nodes, `layer_norm`'s, is one row,
  `expand` shows them) with id, op, name, shape, dtype, parents, requires_grad and the user's
  file:line.
- `to_dot(tape, highlight=None, expand=False)` returns DOT source: one graph node per row of
  `describe`, labelled with its id, op, name, shape and dtype, and an edge from each parent to
  its child. With `highlight` (an id or ids, e.g. a loss), the gradient path is drawn in red:
  the nodes that lie between a requires_grad leaf and a highlighted id, the ones a backward of
  it visits.
- `render(tape, path, highlight=None)` writes `.svg`, `.png` or `.pdf` (by suffix) with the
  Graphviz `dot` program, or raises `TapegradError` saying how to install it.

All three read only ids, shapes, dtypes and call sites: no device data is read to the host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from ._errors import DTypeError, NotAnIdError, ShapeError, TapegradError, at_site
from ._tape import Call, Id, Node, Tape, takes_tape
from ._tensor import is_float

_COLUMNS = ("id", "op", "name", "shape", "dtype", "parents", "requires_grad", "site")
_FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf"}
_PATH_COLOR = "red"


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def _row(node: Node, op: str, parents: Sequence[int] | None = None) -> tuple[str, ...]:
    return (
        str(node.id.index),
        op,
        repr(node.name)[1:-1] if node.name else "",  # escaped: a newline would break the row
        _shape(node.id.shape),
        str(node.id.dtype),
        ", ".join(str(p) for p in (parents if parents is not None else
                                   [p.index for p in node.parents])) or "-",
        "yes" if node.requires_grad else "no",
        node.site,
    )


@takes_tape
def describe(tape: Tape, expand: bool | Sequence[Id] = False) -> str:
    """The tape as a table in id order, one row per op the user called; `print(tg.describe(tape))`.

    Columns: id, op (`leaf` for inputs), name (as given to `leaf`), shape, dtype, parents (the
    ids of its operands, `-` for a leaf), requires_grad, and site (the user's file:line that
    recorded it). The first line says how many nodes and which device.

    A public op that recorded several primitive nodes (`layer_norm`: a mean, a sub, a mul...)
    is one row, `layer_norm (nodes 5-15)`, with the id, shape and dtype of the node it returned
    and the parents from outside it. `expand=True` shows every node instead, each step of a call
    as `layer_norm/mul`; `expand=[ids]` expands only the calls that returned those ids.
    """
    rows: list[tuple[str, ...]] = [_COLUMNS]
    for node, call, members in _entries(tape, _expanded(tape, expand, "describe")):
        if call is None or members is None:
            prefix = f"{call.op}/" if call is not None else ""
            rows.append(_row(node, f"{prefix}{node.op}"))
        else:
            outside = {p.index for m in members for p in m.parents if p.index < call.first}
            rows.append(_row(node, _label(call, members), sorted(outside)))
    widths = [max(len(row[c]) for row in rows) for c in range(len(_COLUMNS))]
    right = {0}  # numbers align right
    lines = [f"{tape!r}"]
    for row in rows:
        cells = [cell.rjust(w) if c in right else cell.ljust(w)
                 for c, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _label(call: Call, members: list[Node]) -> str:
    """A collapsed call: `layer_norm (nodes 5-15)`, or `linear (matmul)` for one node."""
    if len(members) == 1:
        return f"{call.op} ({members[0].op})"
    return f"{call.op} (nodes {call.first}-{call.last})"


def _expanded(tape: Tape, expand: bool | Sequence[Id], op: str) -> set[int] | bool:
    """`expand` as True/False or the set of call outputs to expand."""
    if expand is True or expand is False:
        return expand
    if not isinstance(expand, list | tuple):
        raise DTypeError(at_site(
            f"{op}: expand must be True, False or a list of Ids, not {type(expand).__name__}"))
    for k, i in enumerate(expand):
        tape.node(i, op, f"expand[{k}]")
    return {i.index for i in expand}


def _entries(tape: Tape, expand: set[int] | bool
             ) -> Iterator[tuple[Node, Call | None, list[Node] | None]]:
    """The table's entries in id order: (node, None, None) for a node outside any call,
    (output node, call, its nodes) for a collapsed call, (node, call, None) for a step of an
    expanded one."""
    nodes = list(tape)
    calls = {c.first: c for c in tape.calls()}
    i = 0
    while i < len(nodes):
        call = calls.get(i)
        if call is None:
            yield nodes[i], None, None
            i += 1
        elif expand is True or (expand is not False and call.out in expand):
            for node in nodes[call.first: call.last + 1]:
                yield node, call, None
            i = call.last + 1
        else:
            yield nodes[call.out], call, nodes[call.first: call.last + 1]
            i = call.last + 1


def _ids(tape: Tape, highlight: Id | Sequence[Id] | None, op: str) -> list[Id]:
    if highlight is None:
        return []
    if not isinstance(highlight, Id | list | tuple):
        raise NotAnIdError(at_site(
            f"{op}: highlight must be an Id or a list of Ids on this tape, not "
            f"{type(highlight).__name__}"))
    ids = [highlight] if isinstance(highlight, Id) else list(highlight)
    for k, i in enumerate(ids):
        tape.node(i, op, f"highlight[{k}]" if not isinstance(highlight, Id) else "highlight")
    return ids


def gradient_path(tape: Tape, targets: Sequence[Id]) -> set[int]:
    """Indices of the nodes between a requires_grad leaf and one of `targets` (inclusive)."""
    if not targets:
        return set()
    top = max(t.index for t in targets)
    ancestor = [False] * (top + 1)
    for t in targets:
        ancestor[t.index] = True
    for i in range(top, -1, -1):
        if ancestor[i]:
            for p in tape[i].parents:
                ancestor[p.index] = True
    # A node requires grad exactly when it is, or descends from, a requires_grad leaf.
    return {i for i in range(top + 1)
            if ancestor[i] and tape[i].requires_grad and is_float(tape[i].id.dtype)}


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


@takes_tape
def to_dot(tape: Tape, highlight: Id | Sequence[Id] | None = None,
           expand: bool | Sequence[Id] = False) -> str:
    """Graphviz DOT source of the tape: nodes labelled with op and shape, parent -> child edges.

    Graph node `n{i}` is tape node `i`; its label is `#i op 'name'` over `shape dtype`, its
    tooltip the call site. Leaves are ellipses (filled when they require grad), other nodes
    boxes. A public op that recorded several nodes is one box, `layer_norm (nodes 5-15)`, named
    by the node it returned; with `expand` (True, or the ids such calls returned) its nodes are
    drawn inside a box labelled with the op instead. `highlight` (an id or a list of ids on this
    tape) draws in red the nodes and edges between requires_grad leaves and those ids, and
    gives the highlighted ids a double border.
    """
    targets = _ids(tape, highlight, "to_dot")
    on_path = gradient_path(tape, targets)
    marked = {t.index for t in targets}
    lines = [
        "digraph tape {",
        "  rankdir=TB;",
        '  node [shape=box, fontname="monospace", fontsize=10];',
        '  edge [color="gray40"];',
    ]
    drawn_as: dict[int, int] = {}  # tape node -> the graph node that draws it
    cluster: Call | None = None
    for node, call, members in _entries(tape, _expanded(tape, expand, "to_dot")):
        if call is not cluster and cluster is not None:
            lines.append("  }")
        if call is not None and members is None and call is not cluster:
            lines += [f"  subgraph cluster_{call.first} {{",
                      f"    label={_quote(call.op)}; style=rounded; color=gray60;"]
        cluster = call if members is None else None
        i = node.id.index
        op = node.op if members is None or call is None else _label(call, members)
        for m in members or [node]:
            drawn_as[m.id.index] = i
        lines.append(("  " if cluster is not None else "") + _dot_node(
            node, op, i in on_path, i in marked))
    if cluster is not None:
        lines.append("  }")
    edges: dict[tuple[int, int], bool] = {}
    for node in tape:
        child = drawn_as[node.id.index]
        for p in node.parents:
            parent = drawn_as[p.index]
            if parent != child:  # an op using one operand twice (x * x) draws one edge
                on = node.id.index in on_path and p.index in on_path
                edges[parent, child] = edges.get((parent, child), False) or on
    for (parent, child), on in edges.items():
        style = f' [color="{_PATH_COLOR}", penwidth=2]' if on else ""
        lines.append(f"  n{parent} -> n{child}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_node(node: Node, op: str, on_path: bool, marked: bool) -> str:
    i = node.id.index
    head = f"#{i} {op}" + (f" {node.name!r}" if node.name else "")
    attrs = [
        f"label={_quote(head + chr(10) + _shape(node.id.shape) + ' ' + str(node.id.dtype))}",
        f"tooltip={_quote(node.site)}",
    ]
    if node.prim is None:
        attrs.append("shape=ellipse")
        if node.requires_grad:
            attrs.append('style=filled, fillcolor="lightblue"')
    if on_path:
        attrs.append(f'color="{_PATH_COLOR}", penwidth=2')
    if marked:
        attrs.append("peripheries=2")
    return f"  n{i} [{', '.join(attrs)}];"


@takes_tape
def render(
    tape: Tape, path: str | os.PathLike[str], highlight: Id | Sequence[Id] | None = None,
    expand: bool | Sequence[Id] = False,
) -> Path:
    """Draw the tape to `path` (`.svg`, `.png` or `.pdf`) with Graphviz; returns the path.
    `highlight` and `expand` are `to_dot`'s.

    Needs the `dot` program on PATH; without it, raises `TapegradError` saying how to install
    Graphviz (`tg.to_dot` needs nothing and its output can be rendered anywhere).
    """
    if not isinstance(path, str | os.PathLike):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise DTypeError(at_site(
            f"render: path must be a str or a path (ending in {', '.join(_FORMATS)}), not "
            f"{type(path).__name__}"))
    out = Path(path)
    fmt = _FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise ShapeError(at_site(
            f"render: cannot tell the image format from {str(out)!r}; end the path with "
            f"{', '.join(_FORMATS)}"))
    source = to_dot(tape, highlight, expand)
    dot = shutil.which("dot")
    if dot is None:
        raise TapegradError(at_site(
            "render: the Graphviz 'dot' program is not on PATH; install Graphviz (apt install "
            "graphviz, brew install graphviz, or conda install graphviz), or write "
            "tg.to_dot(tape) to a .dot file and render it elsewhere"))
    done = subprocess.run([dot, f"-T{fmt}", "-o", str(out)], input=source.encode(),
                          capture_output=True, check=False)
    if done.returncode != 0:
        raise TapegradError(at_site(
            f"render: dot failed with exit status {done.returncode} writing {str(out)!r}: "
            f"{done.stderr.decode(errors='replace').strip()}"))
    return out
