"""The benchmarks and scripts name only what exists: every ``from kunlun... import name``
and ``from tests... import name`` in ``benchmarks/`` and ``scripts/`` (at any depth of the
file) resolves. They run outside the suite, so a moved or renamed function would otherwise
break them unseen, as moving ``engine_launch`` to ``kunlun.planner.launch`` broke
``benchmarks/serving.py`` and the tests' refactor broke ``benchmarks/cluster.py``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_name_the_benchmarks_and_scripts_import_from_kunlun_or_tests_exists() -> None:
    missing = []
    files = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])
    assert len(files) > 20
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [(alias.name, ()) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [(node.module, tuple(alias.name for alias in node.names))]
            else:
                continue
            for module, names in modules:
                if module.split(".")[0] not in ("kunlun", "tests"):
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                try:
                    imported = importlib.import_module(module)
                except ImportError as exc:
                    missing.append(f"{where}: {module} ({exc})")
                    continue
                for name in names:
                    if not hasattr(imported, name):
                        try:
                            importlib.import_module(f"{module}.{name}")
                        except ImportError:
                            missing.append(f"{where}: {module}.{name}")
    assert missing == []
