"""Seeing the tape: a table of its nodes, Graphviz DOT source, and a rendered drawing.

- `describe(tape)` returns the table as a string (`print(tg.describe(tape))`): one row per node
  with id, op, name, shape, dtype, parents, requires_grad and the user's file:line.
- `to_dot(tape, highlight=None)` returns DOT source: one graph node per tape node, labelled
  with its id, op, name, shape and dtype, and an edge from each parent to its child. With
  `highlight` (an id or ids, e.g. a loss), the gradient path is drawn in red: the nodes that lie
  between a requires_grad leaf and a highlighted id, the ones a backward of it visits.
- `render(tape, path, highlight=None)` writes `.svg`, `.png` or `.pdf` (by suffix) with the
  Graphviz `dot` program, or raises `TapegradError` saying how to install it.

All three read only ids, shapes, dtypes and call sites: no device data is read to the host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ._errors import DTypeError, NotAnIdError, ShapeError, TapegradError, at_site
from ._tape import Id, Node, Tape, takes_tape
from ._tensor import is_float

_COLUMNS = ("id", "op", "name", "shape", "dtype", "parents", "requires_grad", "site")
_FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf"}
_PATH_COLOR = "red"


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def _row(node: Node) -> tuple[str, ...]:
    return (
        str(node.id.index),
        node.op,
        repr(node.name)[1:-1] if node.name else "",  # escaped: a newline would break the row
        _shape(node.id.shape),
        str(node.id.dtype),
        ", ".join(str(p.index) for p in node.parents) or "-",
        "yes" if node.requires_grad else "no",
        node.site,
    )


@takes_tape
def describe(tape: Tape) -> str:
    """The tape as a table, one row per node, in id order; `print(tg.describe(tape))`.

    Columns: id, op (`leaf` for inputs), name (as given to `leaf`), shape, dtype, parents (the
    ids of its operands, `-` for a leaf), requires_grad, and site (the user's file:line that
    recorded it). The first line says how many nodes and which device.
    """
    rows = [_COLUMNS, *(_row(node) for node in tape)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(_COLUMNS))]
    right = {0}  # numbers align right
    lines = [f"{tape!r}"]
    for row in rows:
        cells = [cell.rjust(w) if c in right else cell.ljust(w)
                 for c, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


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
def to_dot(tape: Tape, highlight: Id | Sequence[Id] | None = None) -> str:
    """Graphviz DOT source of the tape: nodes labelled with op and shape, parent -> child edges.

    Graph node `n{i}` is tape node `i`; its label is `#i op 'name'` over `shape dtype`, its
    tooltip the call site. Leaves are ellipses (filled when they require grad), other nodes
    boxes. `highlight` (an id or a list of ids on this tape) draws in red the nodes and edges
    between requires_grad leaves and those ids, and gives the highlighted ids a double border.
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
    for node in tape:
        i = node.id.index
        head = f"#{i} {node.op}" + (f" {node.name!r}" if node.name else "")
        attrs = [
            f"label={_quote(head + chr(10) + _shape(node.id.shape) + ' ' + str(node.id.dtype))}",
            f"tooltip={_quote(node.site)}",
        ]
        if node.prim is None:
            attrs.append("shape=ellipse")
            if node.requires_grad:
                attrs.append('style=filled, fillcolor="lightblue"')
        if i in on_path:
            attrs.append(f'color="{_PATH_COLOR}", penwidth=2')
        if i in marked:
            attrs.append("peripheries=2")
        lines.append(f"  n{i} [{', '.join(attrs)}];")
    for node in tape:
        i = node.id.index
        seen: set[int] = set()
        for p in node.parents:
            if p.index in seen:  # an op using one operand twice (x * x) draws one edge
                continue
            seen.add(p.index)
            style = f' [color="{_PATH_COLOR}", penwidth=2]' if (
                i in on_path and p.index in on_path) else ""
            lines.append(f"  n{p.index} -> n{i}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"


@takes_tape
def render(
    tape: Tape, path: str | os.PathLike[str], highlight: Id | Sequence[Id] | None = None
) -> Path:
    """Draw the tape to `path` (`.svg`, `.png` or `.pdf`) with Graphviz; returns the path.

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
    source = to_dot(tape, highlight)
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
