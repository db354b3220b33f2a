"""The import graph of tapegrad: no cycles, and an autograd layer free of the backend.

import-linter's contracts (in `make test`) keep the layers; these tests say what it cannot:
that no two modules import each other, even through function-level imports.
"""

from __future__ import annotations

import grimp

AUTOGRAD = ("tapegrad._primitive", "tapegrad._tape", "tapegrad._sweep", "tapegrad._tree")


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("tapegrad", include_external_packages=True,
                             exclude_type_checking_imports=True)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    modules = sorted(m for m in graph.modules if m.startswith("tapegrad"))
    edges = {m: sorted(n for n in graph.find_modules_directly_imported_by(m)
                       if n.startswith("tapegrad")) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in edges[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component: list[str] = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return found


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle() -> None:
    """The finder itself, on a graph with one cycle of three and one module outside it."""
    graph = grimp.ImportGraph()
    for name in ("tapegrad.a", "tapegrad.b", "tapegrad.c", "tapegrad.d"):
        graph.add_module(name)
    for importer, imported in [("tapegrad.a", "tapegrad.b"), ("tapegrad.b", "tapegrad.c"),
                               ("tapegrad.c", "tapegrad.a"), ("tapegrad.d", "tapegrad.a")]:
        graph.add_import(importer=importer, imported=imported)
    assert _cycles(graph) == [["tapegrad.a", "tapegrad.b", "tapegrad.c"]]


def test_autograd_layer_imports_no_backend() -> None:
    """The tape, primitives, sweep and pytree helpers reach neither pyopencl nor the kernel,
    fusion and device modules, directly or through another module."""
    graph = _graph()
    backend = {"pyopencl", "tapegrad._device", "tapegrad._kernels", "tapegrad._fusion",
               "tapegrad._opencl", "tapegrad._reduction"}
    for module in AUTOGRAD:
        upstream = graph.find_upstream_modules(module)
        assert not upstream & backend, (module, sorted(upstream & backend))
        assert not any(m.startswith("tapegrad._ops") for m in upstream), module
