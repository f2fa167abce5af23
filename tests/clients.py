"""Clients whose own pins conflict with the platform's, tried against it unchanged.

``make test`` installs them, without their dependencies, into ``.venv/pinned-clients``
(instructor pins an older jiter and rich than openai and the CLI use; lm-eval's OpenAI-API
models need none of its evaluation dependencies): :func:`pinned` imports one from there, and
:data:`PINNED` is the folder, for a subprocess's ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

PINNED = Path(sys.executable).parent.parent / "pinned-clients"
SGLANG_FRONTEND = Path(sys.executable).parent.parent / "sglang-frontend"
"""SGLang's front-end language, without its server runtime (``make test`` installs it)."""


def pinned(name: str) -> ModuleType:
    """Module ``name`` from :data:`PINNED` (an assertion naming ``make test`` if absent)."""
    assert (PINNED / name).is_dir(), f"{name} is not in {PINNED}: run make test (or setup)"
    if str(PINNED) not in sys.path:
        sys.path.append(str(PINNED))
    return importlib.import_module(name)


def run_sglang_program(base_url: str) -> dict[str, Any]:
    """``tests/daemon/sglang_program.py`` against ``base_url`` in its own process, with SGLang's
    front-end on its path: what its programs produced."""
    assert (SGLANG_FRONTEND / "sglang").is_dir(), f"SGLang's front-end is not in {SGLANG_FRONTEND}"
    env = {**os.environ, "PYTHONPATH": str(SGLANG_FRONTEND)}
    program = Path(__file__).parent / "daemon" / "sglang_program.py"
    proc = subprocess.run([sys.executable, str(program), base_url], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
