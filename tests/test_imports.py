"""Imports run one way, from the command line down to the tensors (STYLE.md point 10).

The layers are the folders of swiftwrite/, listed in LAYERS from the bottom; each folder's __init__.py says what
its layer is for. Every module is parsed (imports inside functions included) and its imports of other swiftwrite
modules are checked: a module imports from its own folder or a folder below it, the command line at the top of
the package (cli.py) from any, the graph has no cycle, and an import inside a function is rare (a heavy optional
dependency only) and says why in a comment.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "swiftwrite"

# The folders of swiftwrite/, bottom to top. A module may import from its own folder and the folders before it.
LAYERS = ["base", "tensors", "models", "decoding", "io", "run", "batch", "bench", "training"]
TOP = "."  # the command line: swiftwrite/cli.py, __main__.py, __init__.py, above every folder
DATA = {"heads", "templates", "kernels", "__pycache__"}  # folders of data (or installed from the checkout's top)
MAX_FUNCTION_IMPORTS = 10


def _modules() -> dict[str, Path]:
    """Every module by its dotted name under the package: "decoding.engine", "cli", "base.__init__"."""
    found = {p.stem: p for p in sorted(PACKAGE.glob("*.py"))}
    for folder in sorted(p for p in PACKAGE.iterdir() if p.is_dir() and p.name not in DATA):
        found.update({f"{folder.name}.{p.stem}": p for p in sorted(folder.glob("*.py"))})
    return found


def _layer(name: str) -> str:
    return name.split(".")[0] if "." in name else TOP


def _level(name: str) -> int:
    return len(LAYERS) if _layer(name) == TOP else LAYERS.index(_layer(name))


def _resolve(name: str, node: ast.ImportFrom | ast.Import, known: set[str]) -> list[str]:
    """The swiftwrite modules an import statement in module `name` names."""
    if isinstance(node, ast.Import):
        dotted = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("swiftwrite.")]
        return [d for d in dotted if d in known]
    if node.level == 0:
        if not node.module or node.module.split(".")[0] != "swiftwrite":
            return []
        base = node.module.split(".")[1:]
    else:
        here = [] if _layer(name) == TOP else [_layer(name)]
        up = node.level - 1  # `from .` is the module's own folder, `from ..` the package
        if up > len(here):
            return []
        base = here[:len(here) - up] + (node.module.split(".") if node.module else [])
    whole = ".".join(base)
    if whole in known:
        return [whole]
    return [m for m in (".".join(base + [a.name]) for a in node.names) if m in known]


def _imports(name: str, path: Path, known: set[str]):
    """(imported swiftwrite modules, line, inside a function) for every import in the module."""
    found = []

    def walk(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                mods = [m for m in _resolve(name, child, known) if m != name]
                found.append((mods, child.lineno, in_function))
            walk(child, inside)

    walk(ast.parse(path.read_text()), False)
    return found


def _graph():
    mods = _modules()
    return mods, {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_module_is_in_a_layer_folder_that_says_what_it_is_for():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name not in DATA)
    assert folders == sorted(LAYERS), f"the folders of swiftwrite/ and LAYERS differ: {folders} against {LAYERS}"
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top == ["__init__", "__main__", "cli"], f"only the command line sits at the package's top: {top}"
    silent = [f for f in LAYERS if not ast.get_docstring(ast.parse((PACKAGE / f / "__init__.py").read_text()))]
    assert not silent, f"these layers' __init__.py have no docstring saying what the layer is for: {silent}"


def test_modules_import_only_from_their_layer_or_below():
    mods, graph = _graph()
    upward = [f"{name}:{line} imports {m} ({_layer(m)}, above {_layer(name)})"
              for name, found in graph.items() for targets, line, _ in found for m in targets
              if _level(m) > _level(name)]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    mods, graph = _graph()
    edges = {name: sorted({m for targets, _, _ in found for m in targets}) for name, found in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for m in edges[name]:
            assert state.get(m) != 1, "import cycle: " + " -> ".join(path[path.index(m):] + [m])
            if m not in state:
                visit(m, path + [m])
        state[name] = 2

    for name in edges:
        if name not in state:
            visit(name, [name])


def test_the_import_check_sees_imports_across_folders():
    """The checks above are only as good as the resolution of relative imports: the engine's own imports are
    found, in its folder and below it."""
    mods, graph = _graph()
    engine = {m for targets, _, _ in graph["decoding.engine"] for m in targets}
    assert {"decoding.tree", "decoding.sampling", "models.forward"} <= engine, engine
    assert {"run.writer", "base.options"} <= {m for targets, _, _ in graph["cli"] for m in targets}


def test_imports_inside_functions_are_few_and_say_why():
    """Only a heavy optional dependency (transformers, triton, a CPU backend) is imported inside a function, never
    to get around a cycle; each says so in a comment on its line or above its group of imports. The functions that import are
    counted (cli.heavy imports four modules from three folders, and counts once)."""
    functions, silent = set(), []
    for name, path in _modules().items():
        lines = path.read_text().splitlines()

        def walk(node, function: str | None) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    walk(child, f"{name}.{child.name}:{child.lineno}")
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)) and function:
                    functions.add(function)
                    above = child.lineno - 2  # the line above, or above the imports just before this one
                    while above > 0 and lines[above].strip().startswith(("from ", "import ")):
                        above -= 1
                    if "#" not in lines[child.lineno - 1] and not lines[above].strip().startswith("#"):
                        silent.append(f"{name}:{child.lineno}")
                walk(child, function)

        walk(ast.parse(path.read_text()), None)
    assert len(functions) <= MAX_FUNCTION_IMPORTS, f"{len(functions)} functions import: {sorted(functions)}"
    assert not silent, f"imports inside functions without a comment saying why: {silent}"


def test_a_cpu_run_imports_no_gpu_kernel_library():
    """Every module a command runs with (cli.heavy) imports neither triton (0.3 s and a 66 MB library at every start)
    nor the kernels that need it, on a machine without a GPU and without Triton's interpreter asked for."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys, torch, swiftwrite.cli as c; c.heavy(); assert torch.cuda.is_available() or not "
            "[m for m in sys.modules if m.split('.')[0] == 'triton' or m.startswith('swiftwrite.kernels')], "
            "sorted(m for m in sys.modules if 'triton' in m or 'kernels' in m)[:5]")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
