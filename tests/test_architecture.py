"""The package's shape: each wing imports only the wings below it, and no module imports itself
through others (no cycle, function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "seq2seq"
# Bottom to top, as data flows: a wing may import its own modules and those of the wings before it.
WINGS = [
    "ground",
    "data",
    "model",
    "checkpoint",
    "inference",
    "evaluation",
    "training",
    "deploy",
    "distillation",
    "cli",
]
GROUND = {
    "errors",
    "schema",
    "decoding",
    "config",
    "config_changes",
    "config_files",
    "config_reference",
    "files",
    "mapped_libraries",
    "progress",
}


def wing_of(module: str) -> str:
    first = module.split(".")[1] if "." in module else "top"
    if first in GROUND:
        return "ground"
    return "top" if first in ("top", "__init__", "__main__") else first


def module_imports() -> dict[str, set[str]]:
    """Every seq2seq module and the seq2seq modules it imports anywhere in its body."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("seq2seq"):
                for alias in node.names:  # `from seq2seq.x import y`: y may be a module or a name in x
                    candidate = f"{node.module}.{alias.name}"
                    is_module = (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                    found.add(candidate if is_module else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith("seq2seq"))
        modules[name] = found - {name}
    return modules


def test_every_wing_imports_only_the_wings_below_it():
    modules = module_imports()
    assert {wing_of(m) for m in modules} - {"top"} == set(WINGS)  # every module sits in a known wing
    upward = [f"{m} ({wing_of(m)}) imports {i} ({wing_of(i)})" for m, imports in modules.items()
              if wing_of(m) != "top" for i in imports
              if wing_of(i) == "top" or WINGS.index(wing_of(i)) > WINGS.index(wing_of(m))]  # fmt: skip
    assert upward == []


def test_no_module_imports_itself_through_others():
    modules = module_imports()
    graph = {m: {i for i in imports if i in modules} for m, imports in modules.items()}
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append(" -> ".join(path[path.index(imported) :] + [imported]))
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
