"""The package's import graph: no cycles, and layers that import only layers below.

The graph is read from the source (no import runs): an edge for every `import` and
`from ... import` of a pagedmla module anywhere in a module, inside functions and
`if TYPE_CHECKING:` blocks included. `from pagedmla.ops import Backend` is an edge to
the package `pagedmla.ops` (its __init__), `from pagedmla import ops` one to the
module `pagedmla.ops`.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"

# Bottom to top. A module belongs to the layer of the longest prefix that names it; the
# package itself (its __init__, the command line, `check`, `testing`) is the top layer.
LAYERS: list[tuple[str, ...]] = [
    # Plain values and host-side planning: no tensors of the model.
    ("pagedmla.device", "pagedmla.dims", "pagedmla.validation", "pagedmla.planner",
     "pagedmla.tokenizer", "pagedmla.host_arrays", "pagedmla.version"),
    # The paged cache and the path cost model.
    ("pagedmla.cache", "pagedmla.routing"),
    # Kernels: know nothing of metadata classes, layers, models or the engine.
    ("pagedmla.ops",),
    # Per-step attention metadata, planned on the host.
    ("pagedmla.metadata",),
    # The attention layer (and the public merge op over it).
    ("pagedmla.attention", "pagedmla.merge"),
    ("pagedmla.models",),
    # Tensor, decode and prefill context parallelism: nothing of the engine above it.
    ("pagedmla.distributed",),
    ("pagedmla.engine",),
    # The HTTP server over the online engine.
    ("pagedmla.server",),
    ("pagedmla",),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in (SOURCE / "pagedmla").rglob("*.py")}


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The pagedmla modules that `module` imports, and the other imports' top names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            for alias in node.names:
                submodule = f"{name}.{alias.name}"
                found.add(submodule if submodule in modules else name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _internal(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {name: {target for target in targets if target in graph}
            for name, targets in graph.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of graph as [a, b, .., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def _layer(module: str) -> int:
    best, best_len = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best >= 0, f"{module} is outside the package"
    return best


def test_the_graph_is_read() -> None:
    graph = _internal(_graph())
    assert "pagedmla.engine.llm" in graph and "pagedmla.ops.reference" in graph
    assert "pagedmla.distributed.runtime" in graph["pagedmla.engine.llm"]  # in a function
    assert "pagedmla.ops" in graph["pagedmla.ops.triton"]  # `from pagedmla.ops import ..`


def test_the_cycle_finder_finds_cycles() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles() -> None:
    cycle = _find_cycle(_internal(_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_layers_import_only_layers_below() -> None:
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in sorted(_internal(_graph()).items())
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_the_package_never_imports_the_benchmarks() -> None:
    # benchmarks/ lives beside the package in the repository, not in the installed wheel.
    users = sorted(module for module, targets in _graph().items()
                   if any(t == "benchmarks" or t.startswith("benchmarks.") for t in targets))
    assert not users, users
