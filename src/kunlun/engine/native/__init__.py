"""Kunlun's compiled decode path: ``decode.cpp`` built once per CPU and loaded into torch.

The library registers ``torch.ops.kunlun.int8_matmul``, ``torch.ops.kunlun.float_matmul``,
``torch.ops.kunlun.int4_matmul`` and the class ``torch.classes.kunlun.Decoder`` (a whole
decode step in C++; see :mod:`kunlun.engine.native.decoder`). It is compiled with the machine's C++ compiler (the one
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

Where torch has a kernel for the same job as one of the library's operators (int4 weights:
``torch._weight_int4pack_mm_for_cpu``; int8 weights: ``torch._weight_int8pack_mm``), which one
runs on a CPU is measured, not assumed: the first process that loads a library times both on
the same products, for each activation dtype a model runs in (:data:`MEASURED_DTYPES`; int8's
arithmetic is the same for both: for token counts
:data:`kunlun.engine.native.measure.INT8_TOKENS` instead), and records the outcome beside it
(``<library>.choice.t<threads>.json``, :class:`NativeChoice`: one per torch thread count);
every later model load with as many threads reads the record for its dtype, and the planner
reports from it (:func:`recorded_choice`), so a plan says what was measured on the CPU for
its dtype.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
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
DEQUANTIZE_FROM_TOKENS = 48
"""From this many tokens in one call (a prefill chunk) the int8 schemes dequantize their rows
into float32 ``F.linear`` rather than call an int8 kernel, on both paths
(:mod:`kunlun.engine.models.quant_linear`; ``decode.cpp``'s ``kDequantizeFrom``): on the 2-vCPU
machine, one thread, demo shapes, the int8pack kernel is on par at 16 tokens and about 2x
slower from 64 on (1536x576 at 64 tokens: 4.6 ms against 2.7 ms; at 256: 14.6 against 8.7)."""


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


@dataclass(frozen=True)
class NativeChoice:
    """What the measurement of a library on its CPU chose, per activation dtype: which of
    Kunlun's own operators run where torch has a kernel for the same job, and the figures."""

    native_ops: dict[str, tuple[str, ...]]
    """Operators that run (``torch.ops.kunlun.<name>``), by activation dtype (torch's name:
    ``float32``, ``bfloat16``)."""
    figures: dict[str, dict[str, float]]
    """Milliseconds per measured round, by activation dtype, then kernel."""
    detail: str
    """What was measured."""
    int8_rows_up_to: int = DEQUANTIZE_FROM_TOKENS - 1
    """Token counts up to which int8 weights run Kunlun's rows (``int8_matmul``) in the
    compiled step; past them torch's int8pack kernel (and from
    :data:`DEQUANTIZE_FROM_TOKENS`, dequantized rows, as the eager path)."""
    int8_figures: dict[str, dict[str, float]] = field(default_factory=dict)
    """Milliseconds per measured round of the int8 products, by token count, then kernel."""

    def ops(self, dtype: str) -> tuple[str, ...]:
        """The operators that run for activations of ``dtype`` (torch's name); a dtype not
        measured (float16) takes float32's choice, as its products widen to float32 too."""
        return self.native_ops.get(dtype, self.native_ops.get(MEASURED_DTYPES[0], ()))

    def describe(self, dtype: str | None = None) -> str:
        """The figures, of ``dtype``'s activations only where one is given."""
        shown = [d for d in self.figures if dtype is None or d == dtype] or list(self.figures)
        figures = "; ".join(f"{d} activations: " + ", ".join(
            f"{name} {ms:.3f} ms" for name, ms in self.figures[d].items()) for d in shown)  # fmt: skip
        int8 = "; ".join(f"{n} token{'' if n == '1' else 's'}: " + ", ".join(
            f"{name} {ms:.3f} ms" for name, ms in kernels.items())
            for n, kernels in self.int8_figures.items())  # fmt: skip
        if int8:
            up_to = self.int8_rows_up_to
            int8 = (f"; int8 weights at {int8}: Kunlun's int8 rows up to {up_to} "
                    f"token{'' if up_to == 1 else 's'}")  # fmt: skip
        return f"measured on this CPU: {figures}{int8} ({self.detail})"

    def to_record(self) -> dict[str, object]:
        ops = {d: list(names) for d, names in self.native_ops.items()}
        return {"cpu": cpu_identity(), "source": source_digest(), "measure": MEASURE_VERSION,
                "native_ops": ops, "figures": self.figures, "detail": self.detail,
                "int8_rows_up_to": self.int8_rows_up_to, "int8_figures": self.int8_figures}  # fmt: skip

    @classmethod
    def from_record(cls, raw: object) -> NativeChoice | None:
        """The choice a record holds, or None where it is not one for this CPU and source
        (or one in an older shape: the library is measured again)."""
        if not isinstance(raw, dict) or raw.get("cpu") != cpu_identity():
            return None
        ops, figures, detail = raw.get("native_ops"), raw.get("figures"), raw.get("detail")
        if raw.get("source") != source_digest() or raw.get("measure") != MEASURE_VERSION:
            return None
        if not isinstance(detail, str):
            return None
        if not isinstance(ops, dict) or not all(isinstance(v, list) for v in ops.values()):
            return None
        int8_up_to, int8_figures = raw.get("int8_rows_up_to"), raw.get("int8_figures")
        if not (_table(figures) and _table(int8_figures) and isinstance(int8_up_to, int)):
            return None
        assert isinstance(figures, dict) and isinstance(int8_figures, dict)

        def milliseconds(table: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
            return {str(a): {str(k): float(ms) for k, ms in v.items()} for a, v in table.items()}

        return cls({str(d): tuple(map(str, v)) for d, v in ops.items()}, milliseconds(figures),
                   detail, int8_up_to, milliseconds(int8_figures))  # fmt: skip


def _table(raw: object) -> bool:
    """Whether a record's ``raw`` figures are a table of tables."""
    return isinstance(raw, dict) and all(isinstance(v, dict) for v in raw.values())


def source_digest() -> str:
    """A digest of ``decode.cpp`` (a record is good for the source it measured)."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


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


def _record_path(library: Path, threads: int) -> Path:
    """Where the measurement of ``library`` with ``threads`` torch threads is recorded: one
    per thread count, since which kernel is faster depends on it (at one token, torch's int8
    kernel took 6.5 ms on one thread of a Zen 5 machine against 1.2 on two; Kunlun's rows 1.4
    against 1.0)."""
    return library.with_name(f"{library.stem}.choice.t{threads}.json")


def recorded_choice() -> NativeChoice | None:
    """The newest record of a measurement on this CPU of this source, in any build folder;
    None where no library was measured here. Torch-free (the planner reads it)."""
    records = []
    for folder in build_dirs():
        try:
            records += [(p.stat().st_mtime, p) for p in folder.glob("kunlun_decode_*.choice*.json")]
        except OSError:
            continue
    for _, path in sorted(records, reverse=True):
        try:
            found = NativeChoice.from_record(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue
        if found is not None:
            return found
    return None


@cache
def choice() -> NativeChoice:
    """The loaded library's measured choice for this process's torch threads: its record,
    or measured now and recorded (where the folder is writable; a worker's may not be: then it
    is measured once per process)."""
    import torch

    library = _loaded()
    record = _record_path(library, torch.get_num_threads())
    try:
        found = NativeChoice.from_record(json.loads(record.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        found = None
    if found is not None:
        return found
    from kunlun.engine.native.measure import measure

    measured = measure()
    log.info("compiled library %s: %s", library.name, measured.describe())
    partial = record.with_suffix(f".{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(measured.to_record(), indent=1), encoding="utf-8")
        os.replace(partial, record)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        log.info("the measurement is not recorded (%s): %s", record, exc)
    return measured


def native_ops(setting: str | None, dtype: str) -> frozenset[str]:
    """Kunlun's own operators a model loaded under the ``decode_path`` setting runs where
    torch has a kernel for the same job, for activations of ``dtype`` (torch's name): none on
    the reference path or without the library, else those :func:`choice` measured faster."""
    if not load(setting).compiled:
        return frozenset()
    return frozenset(choice().ops(dtype))


MEASURE_VERSION = 3
"""Part of a record's key with the CPU and the source: raise it when what
:func:`kunlun.engine.native.measure.measure` measures changes, so a library is measured again."""
#: The activation dtypes the int4 measurement runs (torch's names; the first is the default).
MEASURED_DTYPES = ("float32", "bfloat16")


def main() -> None:
    """Build (or find) the library for this machine, measure it where no record says what
    runs, and print its path and the choice."""
    try:
        print(_loaded())
    except NativeBuildError as exc:
        print(f"kunlun.engine.native: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    print(choice().describe())
