"""Running vendor tools: with a timeout and a minimal environment, or replayed from files.

Every vendor command a device plugin needs goes through a :class:`ToolRunner`, which

- runs the real tool with a timeout (the whole process group is killed when it expires) and
  a minimal environment (``PATH``, ``LD_LIBRARY_PATH``, ``HOME`` and the C locale), or
- in replay mode reads recorded output instead: the output of ``npu-smi info -m`` is the file
  ``npu-smi_info_-m.txt`` in the replay directory (spaces become ``_``). A missing file means
  that one command failed; the tool counts as absent only when no file of it exists.

Each call is recorded as a :class:`CommandRecord`, which ``kunlun-device-probe --verbose``
prints.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kunlun.errors import ToolError

DEFAULT_TIMEOUT_S = 10.0
_ENV_KEEP = ("PATH", "LD_LIBRARY_PATH", "HOME")


@dataclass
class CommandRecord:
    """One vendor command: what ran, how it ended and how long it took."""

    argv: list[str]
    source: str  # "exec" or "replay:<file>"
    ok: bool
    duration_ms: float
    detail: str = ""  # error text when not ok, else a short summary

    @property
    def command(self) -> str:
        return " ".join(self.argv)


def replay_file_name(argv: list[str]) -> str:
    """The replay file that holds the output of ``argv``: spaces become ``_``, plus ``.txt``."""
    return "_".join(argv) + ".txt"


@dataclass
class ToolRunner:
    """Runs vendor commands for one plugin, or replays them from ``replay_dir``."""

    replay_dir: Path | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    records: list[CommandRecord] = field(default_factory=list)

    @property
    def replaying(self) -> bool:
        return self.replay_dir is not None

    def available(self, tool: str) -> bool:
        """Whether ``tool`` exists: on PATH, or (replaying) as any recorded file of it."""
        if self.replay_dir is not None:
            return any(
                p.name == f"{tool}.txt" or p.name.startswith(f"{tool}_")
                for p in self.replay_dir.iterdir()
            )
        return shutil.which(tool) is not None

    def run(self, argv: list[str], timeout_s: float | None = None) -> str:
        """The standard output of ``argv``; raises :class:`ToolError` when it fails.

        A failure is: tool not found, a non-zero exit status, a timeout, or (replaying) no
        recorded file for this command line.
        """
        start = time.monotonic()
        try:
            if self.replay_dir is not None:
                name = replay_file_name(argv)
                out = self._replay(argv, name)
                source = f"replay:{name}"
            else:
                out = self._exec(argv, self.timeout_s if timeout_s is None else timeout_s)
                source = "exec"
        except ToolError as exc:
            self._record(argv, "replay" if self.replaying else "exec", False, start, exc.message)
            raise
        lines = out.count("\n")
        self._record(argv, source, True, start, f"{lines} lines")
        return out

    def _record(self, argv: list[str], source: str, ok: bool, start: float, detail: str) -> None:
        ms = (time.monotonic() - start) * 1000
        self.records.append(CommandRecord(list(argv), source, ok, ms, detail))

    def _replay(self, argv: list[str], name: str) -> str:
        assert self.replay_dir is not None
        path = self.replay_dir / name
        if not path.is_file():
            raise ToolError(f"no recorded output for '{' '.join(argv)}' (expected {path})")
        return path.read_text(encoding="utf-8", errors="replace")

    def _exec(self, argv: list[str], timeout_s: float) -> str:
        exe = shutil.which(argv[0])
        if exe is None:
            raise ToolError(f"'{argv[0]}' not found on PATH")
        env = {k: os.environ[k] for k in _ENV_KEEP if k in os.environ}
        env.update(LC_ALL="C", LANG="C")
        try:
            proc = subprocess.Popen(
                [exe, *argv[1:]],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise ToolError(f"cannot run '{argv[0]}': {exc}") from exc
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise ToolError(
                f"'{' '.join(argv)}' timed out after {timeout_s:g}s and was killed"
            ) from None
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["(no stderr)"]
            raise ToolError(f"'{' '.join(argv)}' exited with status {proc.returncode}: {tail[0]}")
        return out.decode("utf-8", errors="replace")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the tool and anything it started, then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.communicate()
