"""Fixtures for device tests: fake vendor tools on PATH and replay directories.

``fake_tools`` writes small executable shell scripts that stand in for vendor tools
(``nvidia-smi``, ``npu-smi``, ...) and prepends their folder to ``PATH`` for the test::

    def test_lists(fake_tools):
        fake_tools.add("nvidia-smi", {"topo -m": TOPO, "--query-gpu=... --format=csv": CSV})
        fake_tools.add("cnmon", fake_tools.Output(exit_code=3, stderr="driver not loaded"))
        fake_tools.add("xpu-smi", {"": fake_tools.Output(sleep_s=60)})  # hangs

Keys are the tool's arguments joined by single spaces (``""`` for no arguments); a command
line with no key prints an error to stderr and exits 2, as a real tool does for bad usage.

``make_replay`` writes a replay directory (see :mod:`kunlun.device.tools`) from a mapping of
command lines to output text.
"""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from kunlun.device.tools import replay_file_name


@dataclass(frozen=True)
class FakeOutput:
    """What a fake tool does for one command line."""

    stdout: str = ""
    exit_code: int = 0
    stderr: str = ""
    sleep_s: float = 0.0


Outputs = Mapping[str, "str | FakeOutput"] | str | FakeOutput


class FakeTools:
    """Writes fake vendor tools into ``bin_dir`` (already first on ``PATH``)."""

    #: So tests can write ``fake_tools.Output(exit_code=3)`` without importing this module.
    Output = FakeOutput

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self._count = 0

    def add(self, tool: str, outputs: Outputs) -> Path:
        """Create (or replace) the fake ``tool``.

        ``outputs`` maps argument strings to stdout text or a :class:`FakeOutput`; a single
        text or :class:`FakeOutput` answers every command line.
        """
        lines = ["#!/bin/sh"]
        if isinstance(outputs, str | FakeOutput):
            lines += self._answer(tool, outputs)
        else:
            lines.append('case "$*" in')
            for args, out in outputs.items():
                lines.append(f"  {shlex.quote(args)})")
                lines += ["    " + line for line in self._answer(tool, out)]
                lines.append("    ;;")
            lines.append("esac")
            lines.append(f'echo "{tool}: unknown arguments: $*" >&2')
            lines.append("exit 2")
        path = self.bin_dir / tool
        path.write_text("\n".join(lines) + "\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return path

    def _answer(self, tool: str, out: str | FakeOutput) -> list[str]:
        if isinstance(out, str):
            out = FakeOutput(stdout=out)
        self._count += 1
        out_path = self.bin_dir / f".{tool}.{self._count}.out"
        err_path = self.bin_dir / f".{tool}.{self._count}.err"
        body: list[str] = []
        if out.sleep_s:
            body.append(f"sleep {out.sleep_s:g}")
        if out.stdout:
            out_path.write_text(out.stdout)
            body.append(f"cat {shlex.quote(str(out_path))}")
        if out.stderr:
            err_path.write_text(out.stderr)
            body.append(f"cat {shlex.quote(str(err_path))} >&2")
        body.append(f"exit {out.exit_code}")
        return body


@pytest.fixture
def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeTools:
    """Fake vendor tools, first on ``PATH`` for this test."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return FakeTools(bin_dir)


def write_replay(directory: Path, outputs: Mapping[str, str]) -> Path:
    """Write a replay directory: ``{"nvidia-smi topo -m": text}`` -> ``nvidia-smi_topo_-m.txt``."""
    directory.mkdir(parents=True, exist_ok=True)
    for command, text in outputs.items():
        (directory / replay_file_name(command.split(" "))).write_text(text, encoding="utf-8")
    return directory


@pytest.fixture
def make_replay(tmp_path: Path) -> Callable[[Mapping[str, str]], Path]:
    """A function that writes a fresh replay directory from ``{command line: output}``."""
    counter = iter(range(1_000_000))

    def make(outputs: Mapping[str, str]) -> Path:
        return write_replay(tmp_path / f"replay-{next(counter)}", outputs)

    return make
