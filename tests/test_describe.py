"""Seeing the tape: the table, the DOT graph and its gradient-path highlight, rendering."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import tapegrad as tg
from tapegrad._describe import gradient_path

HERE = Path(__file__).name


def _net() -> tuple[tg.Tape, dict[str, tg.Id]]:
    """x (constant) @ w (variable) -> relu -> * c -> sum; plus an unrelated branch."""
    tape, x = tg.leaf(tg.Tape(), np.ones((4, 3), np.float32), name="x")
    tape, w = tg.leaf(tape, np.ones((3, 2), np.float32), requires_grad=True, name="w")
    tape, h = tg.matmul(tape, x, w)
    tape, r = tg.relu(tape, h)
    tape, c = tg.leaf(tape, np.full((4, 2), 2.0, np.float32))
    tape, m = tg.mul(tape, r, c)
    tape, loss = tg.sum(tape, m)
    tape, v = tg.leaf(tape, np.ones(2, np.float32), requires_grad=True, name="v")
    tape, other = tg.exp(tape, v)  # not on the loss's path
    return tape, {"x": x, "w": w, "h": h, "r": r, "c": c, "m": m, "loss": loss, "v": v,
                  "other": other}


def _rows(table: str) -> list[list[str]]:
    return [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()[2:]]


def test_describe_table_has_every_node_and_column() -> None:
    tape, ids = _net()
    table = tg.describe(tape)
    lines = table.splitlines()
    assert lines[0] == repr(tape)
    assert lines[1].split() == ["id", "op", "name", "shape", "dtype", "parents",
                                "requires_grad", "site"]
    rows = table.splitlines()[2:]
    assert len(rows) == len(tape) == 9
    by_id = {int(line.split()[0]): line for line in rows}
    assert by_id[ids["w"].index].split()[:4] == ["1", "leaf", "w", "(3,"]
    mm = by_id[ids["h"].index]
    assert " matmul " in mm and "(4, 2)" in mm and "float32" in mm and " 0, 1 " in mm
    assert re.search(rf"yes\s+\S*{HERE}:\d+$", mm)
    constant = by_id[ids["c"].index]
    assert " leaf " in constant and " - " in constant and " no " in constant
    assert "(2,)" in by_id[ids["v"].index]  # 1-tuples keep their comma


def test_describe_site_is_the_user_line() -> None:
    line = sys._getframe().f_lineno + 1
    tape, x = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    tape, _ = tg.exp(tape, x)
    rows = _rows(tg.describe(tape))
    assert rows[0][-1].endswith(f"{HERE}:{line}")
    assert rows[1][-1].endswith(f"{HERE}:{line + 1}")


def test_describe_reads_no_device_data(monkeypatch: pytest.MonkeyPatch) -> None:
    tape, _ = _net()

    def refuse(self: tg.AnyTensor) -> None:
        raise AssertionError("describe read a value to the host")

    monkeypatch.setattr(tg.AnyTensor, "numpy", refuse)
    tg.describe(tape)
    tg.to_dot(tape)


def _dot_nodes(dot: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^  n(\d+) \[(.*)\];$", dot, re.M)}


def _dot_edges(dot: str) -> dict[tuple[int, int], str]:
    return {(int(m[1]), int(m[2])): m[3] or "" for m in
            re.finditer(r"^  n(\d+) -> n(\d+)(?: \[(.*)\])?;$", dot, re.M)}


def test_to_dot_structure() -> None:
    tape, ids = _net()
    dot = tg.to_dot(tape)
    assert dot.startswith("digraph tape {") and dot.rstrip().endswith("}")
    nodes = _dot_nodes(dot)
    assert sorted(nodes) == list(range(len(tape)))
    edges = _dot_edges(dot)
    want = {(p.index, node.id.index) for node in tape for p in node.parents}
    assert set(edges) == want
    assert r'label="#2 matmul\n(4, 2) float32"' in nodes[ids["h"].index]
    assert "label=\"#1 leaf 'w'\\n(3, 2) float32\"" in nodes[ids["w"].index]
    assert "shape=ellipse" in nodes[ids["x"].index]
    assert "fillcolor" in nodes[ids["w"].index] and "fillcolor" not in nodes[ids["x"].index]
    assert 'tooltip="' in nodes[0] and HERE in nodes[0]
    assert "red" not in dot  # nothing highlighted unless asked


def test_to_dot_highlights_the_gradient_path() -> None:
    tape, ids = _net()
    dot = tg.to_dot(tape, highlight=ids["loss"])
    nodes, edges = _dot_nodes(dot), _dot_edges(dot)
    path = {ids[k].index for k in ("w", "h", "r", "m", "loss")}
    assert {i for i, attrs in nodes.items() if "red" in attrs} == path
    assert {e for e, attrs in edges.items() if "red" in attrs} == {
        (ids["w"].index, ids["h"].index), (ids["h"].index, ids["r"].index),
        (ids["r"].index, ids["m"].index), (ids["m"].index, ids["loss"].index)}
    assert "peripheries=2" in nodes[ids["loss"].index]
    assert sum("peripheries=2" in a for a in nodes.values()) == 1
    # a list of targets: the union of their paths
    dot2 = tg.to_dot(tape, highlight=[ids["loss"], ids["other"]])
    red = {i for i, attrs in _dot_nodes(dot2).items() if "red" in attrs}
    assert red == path | {ids["v"].index, ids["other"].index}


def test_gradient_path_skips_constants_and_later_nodes() -> None:
    tape, ids = _net()
    assert gradient_path(tape, [ids["h"]]) == {ids["w"].index, ids["h"].index}
    assert gradient_path(tape, [ids["c"]]) == set()  # a constant has no gradient path
    assert gradient_path(tape, []) == set()


def test_to_dot_escapes_names_and_checks_ids() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(2, np.float32), name='say "hi"\\')
    dot = tg.to_dot(tape)
    assert r"""#0 leaf 'say \"hi\"\\\\'""" in dot
    _, foreign = tg.leaf(tg.Tape(), np.ones(2, np.float32))
    tape2, _ = tg.exp(tape, x)
    with pytest.raises(tg.TapeError, match="to_dot: argument 'highlight'"):
        tg.to_dot(tape2, highlight=foreign)
    with pytest.raises(tg.TapeError, match=r"highlight\[1\]"):
        tg.to_dot(tape2, highlight=[x, foreign])
    with pytest.raises(tg.TapeError, match="highlight must be an Id or a list of Ids"):
        tg.to_dot(tape2, highlight=0)  # type: ignore[arg-type]


def test_describe_keeps_one_line_per_node_whatever_the_name() -> None:
    tape, _ = tg.leaf(tg.Tape(), np.ones(2, np.float32), name="two\nlines")
    tape, _ = tg.leaf(tape, np.ones(2, np.float32), name="tab\there")
    lines = tg.describe(tape).splitlines()
    assert len(lines) == 4  # the header, the columns, one row per node
    assert "two\\nlines" in lines[2] and "tab\\there" in lines[3]


def test_render_refuses_an_unknown_suffix(tmp_path: Path) -> None:
    tape, _ = _net()
    with pytest.raises(tg.TapegradError, match=r"\.svg, \.png, \.pdf"):
        tg.render(tape, tmp_path / "graph.jpg")


def test_render_without_graphviz_says_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tape, _ = _net()

    def no_program(name: str) -> str | None:
        return None

    monkeypatch.setattr(shutil, "which", no_program)
    with pytest.raises(tg.TapegradError, match="install Graphviz") as info:
        tg.render(tape, tmp_path / "graph.svg")
    assert HERE in str(info.value)
    assert not (tmp_path / "graph.svg").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")
@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_render_writes_the_image(tmp_path: Path, suffix: str) -> None:
    tape, ids = _net()
    out = tg.render(tape, str(tmp_path / f"graph{suffix}"), highlight=ids["loss"])
    assert out == tmp_path / f"graph{suffix}"
    data = out.read_bytes()
    if suffix == ".svg":
        text = data.decode()
        assert "<svg" in text and "matmul" in text and "red" in text
    else:
        assert data.startswith(b"\x89PNG")
