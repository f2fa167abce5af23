"""Kunlun's compiled decode path: ``decode.cpp`` built once per CPU and loaded into torch.

The library registers ``torch.ops.kunlun.int8_matmul``, ``torch.ops.kunlun.float_matmul``
and the class ``torch.classes.kunlun.Decoder`` (a whole decode step in C++; see
:mod:`kunlun.engine.native.decoder`). It is compiled with the machine's C++ compiler (the one
``make llama-server`` needs) against the installed torch, ``-O3 -march=native``, so a build
is only good for the CPU, torch and source it was made from: its file name carries a key of
all three, and a machine with another CPU builds its own.

Where builds live, first that exists or can be written: ``$KUNLUN_NATIVE_DIR``; ``_build/``
beside this file (an editable install: ``make setup`` builds there, and every worker of the
checkout shares it); ``KUNLUN_HOME/cache/native``. A build runs under a file lock, into a
temporary name renamed into place, so concurrent workers build once.

:func:`load` says which decode path runs and why (:class:`NativeStatus`): ``compiled`` when
the library loads, ``python`` (the reference path, every module in Python) when the setting
asks for it (``decode_path="python"``, or ``KUNLUN_DECODE_PATH=python``), no compiler is
found or the build fails; the engine logs it. ``python -m kunlun.engine.native`` builds and
prints the library's path (``make setup`` runs it).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kunlun.sandbox import NATIVE_BUILD_ENV, PASSED_THROUGH

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.cpp")
DECODE_PATHS = ("auto", "compiled", "python")
"""The decode path setting: auto (compiled when it builds, else python), compiled (an error
when it cannot), python (the reference path)."""
ENV_DECODE_PATH, ENV_NATIVE_DIR = PASSED_THROUGH
BUILD_TIMEOUT_S = 600.0
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-std=c++20",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-w",
)


class NativeBuildError(RuntimeError):
    """The library could not be built or loaded (the message says how)."""


@dataclass(frozen=True)
class NativeStatus:
    """Which decode path runs, and why."""

    path: str
    """``compiled`` or ``python``."""
    reason: str
    """Said in the log: the library's file, or why the reference path runs."""

    @property
    def compiled(self) -> bool:
        return self.path == "compiled"


def compiler() -> str | None:
    """The C++ compiler on PATH (``$CXX`` first), or None."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (found := shutil.which(name)):
            return found
    return None


def cpu_identity() -> str:
    """The CPU as the build sees it: model name and instruction-set flags."""
    lines: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "Features", "CPU part") and key not in lines:
            lines[key] = value.strip()
    return "|".join([platform.machine(), *(f"{k}={v}" for k, v in sorted(lines.items()))])


def build_key(cxx: str) -> str:
    """A key of the source, the torch build, the compiler (its file: a worker may not run
    it) and the CPU."""
    import torch

    binary = Path(cxx).resolve()
    stat = binary.stat()
    compiler_id = f"{binary}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), compiler_id.encode(),
                 cpu_identity().encode(), " ".join(FLAGS).encode()):  # fmt: skip
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build_dirs() -> list[Path]:
    """Where builds may live, in order (see the module's docs)."""
    dirs = [Path(os.environ[ENV_NATIVE_DIR])] if os.environ.get(ENV_NATIVE_DIR) else []
    dirs.append(Path(__file__).with_name("_build"))
    from kunlun.paths import kunlun_home

    dirs.append(kunlun_home() / "cache" / "native")
    return dirs


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def library_path() -> Path:
    """The built library for this CPU, torch and source; built first when none exists
    (never in a worker: ``KUNLUN_NATIVE_BUILD=0``). Raises :class:`NativeBuildError` saying why there is none."""
    cxx = compiler()
    if cxx is None:
        raise NativeBuildError("no C++ compiler on PATH (c++, g++ or clang++; or set CXX)")
    try:
        name = f"kunlun_decode_{build_key(cxx)}.so"
    except OSError as exc:  # the source missing from an install, an unreadable compiler
        raise NativeBuildError(f"cannot key a build: {exc}") from exc
    dirs = build_dirs()
    for folder in dirs:
        if (folder / name).is_file():
            return folder / name
    if os.environ.get(NATIVE_BUILD_ENV) == "0":
        raise NativeBuildError(
            f"{name} is not built for this CPU, torch and source (python -m kunlun.engine.native "
            "builds it; make setup does)"
        )
    target = next((d / name for d in dirs if _writable(d)), None)
    if target is None:
        raise NativeBuildError(f"no writable folder for {name}: {', '.join(map(str, dirs))}")
    return _build(cxx, target)


def _build(cxx: str, target: Path) -> Path:
    import torch
    from torch.utils import cpp_extension

    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # another process built it while this one waited
            return target
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        command = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", str(SOURCE), "-o", str(partial)]
        command[1:1] = [f"-I{p}" for p in cpp_extension.include_paths()]
        for lib_dir in cpp_extension.library_paths():
            command += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
        command += ["-lc10", "-ltorch_cpu", "-ltorch"]
        log.info("building the compiled decode path: %s", target.name)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NativeBuildError(f"{cxx} failed to run: {exc}") from exc
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise NativeBuildError(f"{cxx} exited {done.returncode}: " + " | ".join(tail))
        os.replace(partial, target)
    return target


def wanted_path(setting: str | None) -> str:
    """The decode path asked for: the engine's setting, else ``KUNLUN_DECODE_PATH``, else
    auto; a value outside :data:`DECODE_PATHS` is an error naming it."""
    from kunlun.errors import ConfigError

    value = setting or os.environ.get(ENV_DECODE_PATH) or "auto"
    if value not in DECODE_PATHS:
        where = "decode_path" if setting else ENV_DECODE_PATH
        raise ConfigError(
            f"{where}={value!r} is invalid: expected one of {', '.join(DECODE_PATHS)}"
        )
    return value


def _loaded() -> Path:
    """The loaded library's path; a failure is raised again, not retried, for the rest of
    the process (a compiler that fails once fails again, in seconds per model load)."""
    outcome = _load_once()
    if isinstance(outcome, NativeBuildError):
        raise NativeBuildError(str(outcome))
    return outcome


@cache
def _load_once() -> Path | NativeBuildError:
    import torch

    try:
        path = library_path()
    except NativeBuildError as exc:
        return exc
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        return NativeBuildError(f"{path} does not load: {exc}")
    return path


def load(setting: str | None = None) -> NativeStatus:
    """Load the library when the setting allows; the status says which path runs and why.
    ``decode_path="compiled"`` that cannot load raises :class:`~kunlun.errors.EngineError`."""
    from kunlun.errors import EngineError

    wanted = wanted_path(setting)
    if wanted == "python":
        return NativeStatus("python", "decode_path=python asks for the reference path")
    try:
        path = _loaded()
    except NativeBuildError as exc:
        if wanted == "compiled":
            raise EngineError(
                f"decode_path=compiled, but the compiled path is unavailable: {exc}"
            ) from exc
        return NativeStatus("python", f"the compiled path is unavailable: {exc}")
    return NativeStatus("compiled", f"compiled decode library {path}")


def main() -> None:
    """Build (or find) the library for this machine and print its path."""
    try:
        print(_loaded())
    except NativeBuildError as exc:
        print(f"kunlun.engine.native: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
