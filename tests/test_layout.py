"""The package's shape: imports point one way (no cycles), and no import hides inside a function."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import udnn_lab as ul

PACKAGE = Path(ul.__file__).resolve().parent
# optional or heavy third-party packages that may be imported where they are used
LATE_IMPORTS_ALLOWED = {"altair", "ipywidgets", "timm", "transformers", "peft", "vl_convert", "papermill",
                        "nbformat", "nbconvert", "jinja2", "pynvml", "torchvision", "IPython", "anywidget",
                        "jupyter_client", "traitlets", "highspy"}
LATE_MODULES_ALLOWED = {"udnn_lab.widgets"}  # the app: it imports altair and ipywidgets
# Modules that may import more inside functions (still with a comment): the shell command loads torch and the
# stage a command needs when that command runs, so that 'udnn-lab --help' answers at once (startup time).
# A trace loads the one-rank tracer (DTensor and FSDP2: most of a second) only when a parallel trace is asked for.
LATE_IMPORTS_BY_MODULE = {"udnn_lab.cli": {"torch", "udnn_lab"}, "udnn_lab.analysis.tracing": {"udnn_lab"}}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(tree: ast.Module):
    """Imports run when the module is imported (module body, try/if blocks), not TYPE_CHECKING ones."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]


def _targets(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level or not node.module or not node.module.startswith("udnn_lab"):
        return set()
    found = set()
    for alias in node.names:
        submodule = f"{node.module}.{alias.name}"
        found.add(submodule if submodule in modules else node.module)
    return found


def _every_import(tree: ast.Module):
    """Every import of a module: its body's, TYPE_CHECKING's and those inside functions."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def import_graph(every_import: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports when it is imported (``every_import``: at any time, for types too)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in (_every_import if every_import else _top_level_imports)(tree):
            edges |= _targets(node, modules)
        edges.discard("udnn_lab")  # every module's parent: the root's re-exports are not a dependency
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _package_of(module: str, modules: dict[str, Path]) -> str:
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


@pytest.mark.parametrize("every_import", [False, True], ids=["on import", "any import, for types too"])
def test_the_package_has_no_import_cycle(every_import):
    graph = import_graph(every_import)
    modules = _modules()
    # a package's __init__ re-exports its own modules: that edge is the package's face, not a dependency
    for name in graph:
        if modules[name].name == "__init__.py":
            graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_import_inside_a_function_but_optional_heavy_packages_with_a_comment():
    offenders = []
    for name, path in _modules().items():
        source = path.read_text()
        lines = source.splitlines()
        for function in ast.walk(ast.parse(source)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                modules = {alias.name for alias in node.names} if isinstance(node, ast.Import) else {node.module or ""}
                allowed = all(m.split(".")[0] in LATE_IMPORTS_ALLOWED | LATE_IMPORTS_BY_MODULE.get(name, set())
                              or m in LATE_MODULES_ALLOWED for m in modules)
                commented = any("#" in line for line in lines[max(0, node.lineno - 3):node.lineno])  # said why
                if not (allowed and commented):
                    offenders.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, "imports inside functions:\n" + "\n".join(offenders)


BASICS = {"errors", "units", "vocabulary", "devices", "workload", "parallel", "collector"}
ABOVE = {  # what each subpackage may import besides BASICS: the table in udnn_lab/README.md
    "graph": set(), "hardware": set(), "zoo": set(), "analysis": {"graph"},
    "cost": {"graph", "hardware", "analysis"}, "simulation": {"graph", "hardware", "cost"},
    "planning": {"graph", "hardware", "cost", "simulation", "allocator"},
    "runtime": {"graph", "analysis", "hardware"},
    "measurement": {"graph", "analysis", "runtime"}, "allocator": {"graph", "simulation"},
    "frames": {"graph", "hardware", "cost", "simulation", "measurement"}, "charts": set(),
    "report": {"hardware", "planning", "zoo"},
    "fitting": {"graph", "analysis", "hardware", "simulation", "planning", "zoo"},
}


def test_each_stage_imports_only_the_stages_above_it():
    found = {}
    for module, targets in import_graph().items():
        stage = module.split(".")[1] if module.count(".") else "udnn_lab"
        for target in targets:
            other = target.split(".")[1]
            if other != stage and stage in ABOVE and other not in ABOVE[stage] | BASICS:
                found.setdefault(f"{module} -> {target}", 1)
    assert not found, "imports against the flow (see udnn_lab/README.md): " + ", ".join(sorted(found))


def _private_part(target: str, stage: str) -> str | None:
    """The first underscored part of a path into another stage ('udnn_lab.analysis._recorder' -> '_recorder')."""
    parts = target.split(".")
    if len(parts) < 3 or parts[0] != "udnn_lab" or parts[1] == stage:
        return None
    return next((part for part in parts[2:] if part.startswith("_") and part != "__init__"), None)


def test_no_stage_imports_another_stages_private_modules():
    """A name another stage needs is on that stage's public face (its __init__ or a module without '_')."""
    offenders = []
    for name, path in _modules().items():
        stage = name.split(".")[1] if name.count(".") else ""
        for node in _every_import(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.level or not node.module:
                continue
            else:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            if any(_private_part(target, stage) for target in targets):
                offenders.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, "imports of another stage's private modules:\n" + "\n".join(offenders)


def test_the_private_import_rule_reads_paths_as_meant():
    assert _private_part("udnn_lab.analysis._recorder", "runtime") == "_recorder"
    assert _private_part("udnn_lab.analysis._fake.memo", "runtime") == "_fake"
    assert _private_part("udnn_lab.analysis._recorder", "analysis") is None
    assert _private_part("udnn_lab.analysis.recording", "runtime") is None
    assert _private_part("udnn_lab.graph.__init__", "planning") is None


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_flat_prefixed_modules_are_left():
    flat = [p.name for p in PACKAGE.glob("*.py") if p.stem.split("_")[0] in
            ("sharing", "charts", "frames", "allocator", "widgets", "hardware", "fake", "plan")]
    assert not flat


def test_dir_lists_every_public_name():
    listed = set(dir(ul))
    assert set(ul.__all__) <= listed and "MemoryLab" in listed
    for name in ul.__all__:
        assert getattr(ul, name) is not None


def test_importing_the_package_loads_no_stage_until_a_name_is_used():
    code = ("import sys, udnn_lab as ul; assert 'torch' not in sys.modules; ul.trace; "
            "assert 'torch' in sys.modules and 'altair' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})


LONG_FUNCTIONS_ALLOWED = {"udnn_lab.cli._parser"}  # one argparse call per option: a list, read top to bottom


def test_functions_are_short_and_private_ones_take_few_parameters():
    """At most 60 lines a function; a private one takes fewer than ten parameters (group them into a record).
    Public entry points keep their keyword options, as PyTorch's do."""
    long, crowded = [], []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > 60 and f"{name}.{node.name}" not in LONG_FUNCTIONS_ALLOWED:
                long.append(f"{name}.{node.name}: {lines} lines")
            arguments = node.args
            count = len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs)
            count -= bool(arguments.args) and arguments.args[0].arg in ("self", "cls")
            if count >= 10 and node.name.startswith("_") and not node.name.startswith("__"):
                crowded.append(f"{name}.{node.name}: {count} parameters")
    assert not long and not crowded, "\n".join(long + crowded)
