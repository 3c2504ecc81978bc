"""Import hygiene, read from the sources with `ast` (nothing is imported): the packages' import graph, counting imports
inside functions too, has no cycles; cpu_ext is a leaf that imports nothing from jaxinfer; no module imports a CLI
module (the `python -m` entry points), so that each CLI can change without reaching the library."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxinfer", "cpu_ext", "pallas_kernels")
CLI_MODULES = frozenset(f"jaxinfer.{name}" for name in ("generate", "perplexity", "profile", "calibrate",
                                                        "train_predictor", "server", "inspect"))


def module_names() -> dict[str, pathlib.Path]:
    names = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The modules of `known` that `path` (module `name`) imports anywhere in its body: `import a.b`, `from a import
    b` (b a module or a name in a), relative imports resolved against `name`'s package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for candidate in candidates:
            # `import a.b.c` also runs a and a.b; the closest known module stands for what was named.
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                found.add(candidate)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    names = module_names()
    return {name: imported_modules(path, name, set(names)) for name, path in names.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state = {}  # name -> "open" while on the DFS stack, "done" after

    def visit(name, stack):
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target, stack)):
                return cycle
        stack.pop()
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [])):
            return cycle
    return None


def test_the_graph_sees_module_and_function_level_imports(graph):
    assert "jaxinfer.config" in graph["jaxinfer.model"]  # module level
    assert "jaxinfer.engine" in graph["jaxinfer.generate"]  # inside main()
    assert "cpu_ext" in graph["jaxinfer.quant"]  # inside cpu_kernels()
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cpu_ext_imports_nothing_from_jaxinfer(graph):
    leaks = {f"{name} imports {target}" for name, targets in graph.items() if name.split(".")[0] == "cpu_ext"
             for target in targets if target.split(".")[0] != "cpu_ext"}
    assert not leaks, sorted(leaks)


def test_no_module_imports_a_cli_module(graph):
    assert CLI_MODULES <= set(graph)
    leaks = {f"{name} imports {target}" for name, targets in graph.items() for target in targets & CLI_MODULES}
    assert not leaks, sorted(leaks)
