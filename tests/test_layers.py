"""The import rule of ``docs/architecture.md``: each unit of ``src/kunlun`` (a package, or a
module at the top) imports only from the layers below its own, so the layering cannot drift.

Checked on the source's syntax trees, every import counted: at module level, inside
functions (a lazy import is still a dependency) and under ``TYPE_CHECKING``. An import that
must break the rule carries a comment with ``layering:`` and the reason on its line or the
line above. Modules of the bottom layer may import each other; no module imports itself
back through others (no cycle of module-level imports, file by file)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kunlun"
DOC = ROOT / "docs" / "architecture.md"
BLOCK = re.compile(r"<!-- layers -->\s*```text\n(.*?)```", re.S)


def layers() -> dict[str, int]:
    """Unit -> layer (0 at the bottom) from the doc's block, written top layer first."""
    found = BLOCK.search(DOC.read_text())
    assert found, f"{DOC}: no ```text block after <!-- layers -->"
    lines = [line.split("#")[0].split() for line in found.group(1).splitlines()]
    lines = [line for line in lines if line]
    return {unit: n for n, line in enumerate(reversed(lines)) for unit in line}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """``kunlun.serving.gateway`` -> ``serving``; a name from ``kunlun``'s own ``__init__``
    (``from kunlun import __version__``) -> ``kunlun``."""
    parts = module.split(".")
    if len(parts) > 1 and ((SRC / parts[1]).is_dir() or (SRC / f"{parts[1]}.py").is_file()):
        return parts[1]
    return "kunlun"


class Import:
    def __init__(self, path: Path, line: int, target: str, top: bool) -> None:
        self.path, self.line, self.target, self.top = path, line, target, top

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} imports {self.target}"


def imports_of(path: Path) -> list[Import]:
    """Every ``kunlun`` import of ``path``; ``top``: run when the module is imported."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(path, child.lineno, a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found.append(Import(path, child.lineno, base, top))
                found.extend(Import(path, child.lineno, f"{base}.{a.name}", top)
                             for a in child.names)  # fmt: skip
            elif (
                isinstance(child, ast.If)
                and "TYPE_CHECKING" in ast.unparse(child.test)
                or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            ):
                visit(child, False)
            else:
                visit(child, top)

    visit(ast.parse(path.read_text(), str(path)), True)
    return [i for i in found if i.target == "kunlun" or i.target.startswith("kunlun.")]


def sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_unit_has_one_layer() -> None:
    units = {unit_of(module_name(p)) for p in sources()}
    placed = layers()
    text = DOC.read_text()
    block = BLOCK.search(text)
    assert block
    listed = [u for line in block.group(1).splitlines() for u in line.split("#")[0].split()]
    assert len(listed) == len(set(listed)), f"{DOC}: a unit is listed twice: {listed}"
    assert units - placed.keys() == set(), f"units without a layer in {DOC}"
    assert placed.keys() - units == set(), "layers name units src/kunlun does not have"


def test_imports_go_down_the_layers() -> None:
    placed = layers()
    bottom = min(placed.values())
    wrong = []
    for path in sources():
        source = path.read_text().splitlines()
        own = unit_of(module_name(path))
        for imp in imports_of(path):
            target = unit_of(imp.target)
            if target == own or (placed[own] == placed[target] == bottom):
                continue
            if placed[target] < placed[own]:
                continue
            reason = " ".join(source[max(0, imp.line - 2) : imp.line])
            if "layering:" in reason:
                continue
            wrong.append(f"{imp}: layer {placed[target]} ({target}) from layer {placed[own]} "
                         f"({own})")  # fmt: skip
    assert wrong == [], "imports up or across the layers:\n" + "\n".join(sorted(set(wrong)))


def test_no_cycle_of_module_imports() -> None:
    """Module-level imports, file by file: a cycle is found by a depth-first walk."""
    known = {module_name(p): p for p in sources()}
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        for imp in imports_of(path):
            own_package = module.startswith(imp.target + ".")
            if imp.top and imp.target in known and imp.target != module and not own_package:
                edges[module].add(imp.target)
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def walk(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for nxt in sorted(edges[module]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[module] = 2

    for module in sorted(known):
        if module not in state:
            walk(module)
    assert cycles == [], "module import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def test_modules_and_functions_stay_short() -> None:
    """No module of ``src/kunlun`` over 450 lines, no function over 80 (from its ``def`` to
    its last line; a nested function counts within its parent too)."""
    long = []
    for path in sources():
        text = path.read_text()
        where = path.relative_to(ROOT)
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            long.append(f"{where}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert long == []
