"""Imports run one way, from the command line down to the ops (STYLE.md point 10).

Every module under swiftwrite/ is parsed (imports inside functions included) and its imports of other swiftwrite
modules are checked against LAYERS: a module imports from its own layer or a lower one, the graph has no cycle,
and an import inside a function is rare (a heavy optional dependency only) and says why in a comment.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "swiftwrite"

# Bottom to top. A module may import from its own layer and the layers before it.
LAYERS = [
    # foundations: the errors a user sees, where files live ($SWIFTWRITE_HOME), the lazy transformers gateway, files
    # that survive a kill, the reader of the user's files, the machine's kept measurements
    ["errors", "paths", "hf", "durable", "userfiles", "measurements"],
    # configuration: the table of the run's options (options), the run's configuration (config), the model's shape
    ["options", "config", "modelconfig"],
    # ops: arithmetic, KV caches, attention kernels, quantized kernels, weights on disk, exactness, the forward interface
    ["ops", "kvcache", "draftcache", "attention", "quant", "weightfiles", "exact", "forward"],
    # models: the implementations of forward.Forward, and the wrappers around the lean one
    ["model", "hfmodel", "ggmlmodel", "graphs", "parallel", "modelfiles"],
    # decoding pieces: sampling and penalties, draft trees and sources, the context window, the cost curve and the
    # automatic budget that prices trees with it
    ["repetition", "bans", "sampling", "tree", "drafting", "ngram", "recycling", "heads", "window", "budget",
     "autobudget", "vocab"],
    # the engine: token ids in, token ids and step statistics out
    ["engine", "curves"],
    # run I/O the loader and the writer share: prompts to ids, the run directory (its files, and the RunDir that keeps
    # them), the panel, statistics
    ["rounds", "prompt", "runfiles", "rundir", "ui", "metrics"],
    # loading: the model store, device and threads, ranks, model + engine assembled; training heads
    ["store", "devices", "threads", "ranks", "backends", "peers", "records", "headdata", "train_heads"],
    # the writer (and the bench harness beside it): outlines and the schedule that places their sections,
    # interruptions, a session of the run loop and its statistics, the assembly, prompt in, document out
    ["outline", "schedule", "interrupts", "runstats", "session", "assembly", "edits", "writer", "bench"],
    # the command line
    ["cli", "__main__", "__init__"],
]
MAX_FUNCTION_IMPORTS = 10
# Owned by another change in progress: its imports inside functions are still to be moved to its top (issue 37).
# Its imports still count for cycles and layers.
NOT_COUNTED_YET: set[str] = set()


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PACKAGE.glob("*.py"))}


def _imports(name: str, path: Path, known: set[str]):
    """(imported swiftwrite module, line, inside a function) for every import in the module."""
    found = []

    def targets(node) -> list[str]:
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                return [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            if node.level == 0 and node.module and node.module.split(".")[0] == "swiftwrite":
                parts = node.module.split(".")
                return [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            return []
        return [a.name.split(".")[1] for a in node.names if a.name.startswith("swiftwrite.")]

    def walk(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                mods = [m for m in targets(child) if m in known and m != name]
                found.append((mods, child.lineno, in_function))
            walk(child, inside)

    walk(ast.parse(path.read_text()), False)
    return found


def _graph():
    mods = _modules()
    return mods, {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_module_has_a_layer():
    listed = [m for layer in LAYERS for m in layer]
    assert len(listed) == len(set(listed)), "a module is listed twice in LAYERS"
    missing = sorted(set(_modules()) - set(listed))
    assert not missing, f"place these modules in a layer of tests/test_imports.py: {missing}"


def test_modules_import_only_from_their_layer_or_below():
    level = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    mods, graph = _graph()
    upward = [f"{name}:{line} imports {m} ({LAYERS[level[m]][0]}'s layer, above {LAYERS[level[name]][0]}'s)"
              for name, found in graph.items() for targets, line, _ in found for m in targets
              if name in level and m in level and level[m] > level[name]]
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


def test_imports_inside_functions_are_few_and_say_why():
    """Only a heavy optional dependency (transformers, triton, a CPU backend) is imported inside a function, never
    to get around a cycle; each says so in a comment on its line or the line above."""
    counted, silent = [], []
    for name, path in _modules().items():
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)) and name not in NOT_COUNTED_YET:
                    where = f"{name}:{inner.lineno}"
                    if where in counted:
                        continue  # a nested function's import, seen from its enclosing one too
                    counted.append(where)
                    above = lines[inner.lineno - 2].strip() if inner.lineno > 1 else ""
                    if "#" not in lines[inner.lineno - 1] and not above.startswith("#"):
                        silent.append(where)
    assert len(counted) <= MAX_FUNCTION_IMPORTS, f"{len(counted)} imports inside functions: {counted}"
    assert not silent, f"imports inside functions without a comment saying why: {silent}"
