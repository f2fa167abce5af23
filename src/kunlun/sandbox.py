"""The engine worker's sandbox: what a worker may see, use and call.

The daemon decides a worker's confinement as one :class:`WorkerSandbox` (built by
:meth:`SandboxPolicy.for_worker`), passes it to the worker in its launch file (the
``sandbox`` field of :class:`~kunlun.engine.launch.EngineLaunch`), and the worker applies it
to itself in two steps:

1. :func:`enter` as the first thing in its ``main``: it dies with the daemon
   (``PR_SET_PDEATHSIG`` SIGKILL, then a check that its parent is still the daemon, which
   closes the race of a daemon that died before the call) and, when the sandbox is on, it
   sets ``RLIMIT_CORE`` 0 (no core dumps), ``RLIMIT_NOFILE`` and ``no_new_privs``;
2. :func:`lock` after its trusted imports (torch, uvicorn) and before it opens any model
   file: the seccomp allow-list of :mod:`kunlun.syscalls` is installed; a call outside it
   kills the worker with SIGSYS (``SECCOMP_RET_KILL_PROCESS``).

The daemon side also gives each worker a clean environment (:func:`worker_environment`: only
what Python, its device family's runtime and the worker itself need; never another vendor's
variables or the daemon's secrets), its own working directory
(``KUNLUN_HOME/run/workers/<replica>/``, mode 0700), and a host memory cap that the node
agent enforces by watching the worker's resident set (:func:`over_memory_cap`): a
worker past it is killed and its workload fails with ``worker exceeded its memory cap of N
MiB``. The cap is not an ``RLIMIT_AS``: torch reserves far more address space than it uses
(see ``docs/sandbox.md`` for the figures), so an address-space limit near the real need
breaks loading. A cgroup v2 per workload (``memory.max``, ``cpu.max``) is used where the host
delegates one with those controllers (:func:`cgroup_v2_base`); elsewhere the daemon says so
once in its log and relies on the watchdog and rlimits.

A worker that dies of SIGSYS is reported as ``seccomp: forbidden system call N (name)``
(:func:`seccomp_reason`), with the number read from the kernel's audit record in
``/dev/kmsg`` when the host lets the daemon read it.

``--no-worker-sandbox`` (or ``KUNLUN_WORKER_SANDBOX=0``) turns all of this off except dying
with the daemon, for debugging; the daemon logs that once.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
MAX_OPEN_FILES = 4096
"""``RLIMIT_NOFILE`` of a worker: its model files, its loopback connections (one per request
the gateway has in flight to it, at most a few hundred; two for a direct stream, its hand-off
and the client's socket) and Python's own."""
RUNTIME_MEMORY_MB = 1024
"""Host memory of a worker beyond its weights and host-side KV cache: the interpreter, torch's
CPU runtime and allocator caches, uvicorn, the tokenizer (a serving demo-model worker holds
about 855 MiB of private memory, of which about 500 MiB are its fp32 weights)."""
MEMORY_MARGIN = 1.25
"""Headroom factor on the estimate, for activations of a full batch and allocator slack."""
SELF_TEST_FORBIDDEN_SYSCALL = "forbidden-syscall"
"""The only self-test (:attr:`WorkerSandbox.self_test`): the worker makes a call outside the
allow-list once it has locked itself, to show that the filter kills it and the workload
says why. Set by the daemon's operator (``KUNLUN_WORKER_SELF_TEST``), never by an API user."""
_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class WorkerSandbox:
    """How one worker is confined. The daemon builds it; the worker applies it to itself."""

    parent_pid: int
    """The daemon's pid: the worker dies when its parent does (always, even sandbox off)."""
    enabled: bool = True
    """False: only ``parent_pid`` applies (``--no-worker-sandbox``)."""
    workdir: str | None = None
    """The worker's own working directory (0700)."""
    max_open_files: int = MAX_OPEN_FILES
    """``RLIMIT_NOFILE`` (soft and hard, never above the daemon's hard limit)."""
    seccomp: bool = True
    """Install the system call allow-list (False where libseccomp is missing)."""
    memory_cap_mb: int | None = None
    """Host memory cap, enforced by the node agent's watchdog (None: no cap)."""
    self_test: str | None = None
    """``forbidden-syscall`` or None; see :data:`SELF_TEST_FORBIDDEN_SYSCALL`."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> WorkerSandbox:
        """Parse a sandbox from its JSON; a bad one raises ValueError naming what is wrong."""
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"sandbox is not a WorkerSandbox JSON object: {exc}") from None


# ---- worker side ----
def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}, {arg}): {os.strerror(errno)}")


def enter(sandbox: WorkerSandbox) -> None:
    """First step in the worker (see the module docstring). Exits at once if the daemon
    that started it is already gone."""
    if sys.platform == "linux":
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != sandbox.parent_pid:
        os._exit(0)  # the daemon died before the death signal was armed: nothing to serve
    if not sandbox.enabled:
        return
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = (
        sandbox.max_open_files
        if hard == resource.RLIM_INFINITY
        else min(hard, sandbox.max_open_files)
    )
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    if sys.platform == "linux":
        _prctl(PR_SET_NO_NEW_PRIVS, 1)


def lock(sandbox: WorkerSandbox) -> None:
    """Second step: install the system call allow-list, then run the self-test if asked."""
    if sandbox.enabled and sandbox.seccomp:
        from kunlun.syscalls import install_filter

        install_filter()
    if sandbox.self_test == SELF_TEST_FORBIDDEN_SYSCALL:
        print(f"self-test: calling chroot(2), which the sandbox forbids (pid {os.getpid()})",
              flush=True)  # fmt: skip
        os.chroot("/")


# ---- daemon side ----
def seccomp_available() -> str | None:
    """None when the allow-list can be installed here, else why not."""
    if sys.platform != "linux":
        return f"seccomp is Linux-only (this is {sys.platform})"
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, RuntimeError, OSError) as exc:
        return f"pyseccomp cannot load libseccomp ({exc})"
    return None


def cgroup_v2_base() -> tuple[Path | None, str]:
    """The cgroup v2 directory under which workload cgroups can be made, or None, and why."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError as exc:
        return None, f"cannot read the process's cgroups ({exc})"
    own = next((line[3:] for line in lines if line.startswith("0::")), None)
    mount = next((m.split()[4] for m in mounts if " - cgroup2 " in m), None)
    if own is None or mount is None:
        return None, "the host has no cgroup v2 hierarchy (cgroup v1 only)"
    base = Path(mount) / own.lstrip("/")
    try:
        controllers = set((base / "cgroup.controllers").read_text().split())
    except OSError as exc:
        return None, f"cannot read {base}/cgroup.controllers ({exc})"
    missing = {"memory", "cpu"} - controllers
    if missing:
        return None, (
            f"cgroup v2 at {base} lacks the {', '.join(sorted(missing))} controller(s) "
            f"(has: {', '.join(sorted(controllers)) or 'none'}; they are bound to cgroup v1)"
        )
    if not os.access(base, os.W_OK):
        return None, f"cgroup v2 at {base} is not writable by the daemon (not delegated)"
    return base, f"cgroup v2 at {base}"


@dataclass
class SandboxPolicy:
    """The daemon's sandbox settings and what this host allows; one per node agent."""

    home: Path
    enabled: bool = True
    self_test: str | None = None

    def __post_init__(self) -> None:
        self.seccomp_problem = seccomp_available() if self.enabled else None
        self.cgroup_base, self.cgroup_note = cgroup_v2_base() if self.enabled else (None, "")
        self._cgroup_ready = False

    def describe(self) -> list[str]:
        """The lines the daemon logs once at start: what confines its workers here."""
        if not self.enabled:
            return ["worker sandbox: OFF (--no-worker-sandbox): workers run with the daemon's "
                    "environment and no seccomp filter or limits; they still die with the daemon"]  # fmt: skip
        lines = ["worker sandbox: on (clean environment, own directory, rlimits, no_new_privs, "
                 "memory watchdog" + (", seccomp allow-list)" if not self.seccomp_problem else ")")]  # fmt: skip
        if self.seccomp_problem:
            lines.append(f"worker sandbox: no seccomp filter: {self.seccomp_problem}")
        if self.cgroup_base is None:
            lines.append(f"worker sandbox: no per-workload cgroup: {self.cgroup_note}; "
                         "relying on rlimits and the memory watchdog")  # fmt: skip
        return lines

    def workdir(self, replica_id: str) -> Path:
        path = self.home / "run" / "workers" / replica_id
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)
        return path

    def for_worker(self, replica_id: str, memory_cap_mb: int | None) -> WorkerSandbox:
        return WorkerSandbox(
            parent_pid=os.getpid(),
            enabled=self.enabled,
            workdir=str(self.workdir(replica_id)) if self.enabled else None,
            seccomp=self.seccomp_problem is None,
            memory_cap_mb=memory_cap_mb if self.enabled else None,
            self_test=self.self_test,
        )

    def join_cgroup(self, workload_id: str, pid: int, memory_cap_mb: int | None,
                    num_threads: int) -> str | None:  # fmt: skip
        """Put ``pid`` in its workload's cgroup (memory.max, cpu.max). Returns None, or once,
        why cgroups cannot be used (later calls then do nothing)."""
        if self.cgroup_base is None:
            return None
        base = self.cgroup_base
        try:
            if not self._cgroup_ready:
                # cgroup v2 lets only a cgroup without processes give controllers to its
                # children: the daemon moves itself into a leaf of its own first
                (base / "daemon").mkdir(exist_ok=True)
                (base / "daemon" / "cgroup.procs").write_text(str(os.getpid()))
                (base / "cgroup.subtree_control").write_text("+memory +cpu")
                self._cgroup_ready = True
            group = base / f"kunlun-{workload_id}"
            group.mkdir(exist_ok=True)
            if memory_cap_mb is not None:
                (group / "memory.max").write_text(str(memory_cap_mb << 20))
            (group / "cpu.max").write_text(f"{num_threads * 100000} 100000")
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            self.cgroup_base = None
            self.cgroup_note = f"cgroup v2 at {base} not usable ({exc})"
            return f"worker sandbox: no per-workload cgroup: {self.cgroup_note}; relying on rlimits and the memory watchdog"
        return None


def memory_cap_mb(weights_mb: int, host_kv_mb: int, cap_override_mb: int | None) -> int:
    """A worker's host memory cap: the override, else (need + runtime) x margin, where need is
    the larger of serving (weights + host KV cache) and a first start's loading (twice the
    weights: casting a checkpoint to the plan's dtype holds the cast tensors of a file and
    their serialized copy at once)."""
    if cap_override_mb is not None:
        return cap_override_mb
    need_mb = max(weights_mb + host_kv_mb, 2 * weights_mb)
    return int((need_mb + RUNTIME_MEMORY_MB) * MEMORY_MARGIN)


def over_memory_cap(pid: int, cap_mb: int | None) -> int | None:
    """The worker's private resident memory in MiB when it is above ``cap_mb``, else None.

    Private (anonymous) memory is what a runaway worker takes from the host: file pages it has
    mapped, such as safetensors weights, are counted once loaded into tensors, not while
    merely mapped (the kernel can drop them)."""
    if cap_mb is None:
        return None
    try:
        info = psutil.Process(pid).memory_info()
    except psutil.Error:
        return None
    private_mb = (info.rss - getattr(info, "shared", 0)) >> 20
    return private_mb if private_mb > cap_mb else None


def worker_environment(
    *,
    home: Path,
    workdir: Path | None,
    device_env: dict[str, str],
    runtime_env: tuple[str, ...],
    num_threads: int,
    source: dict[str, str] | None = None,
) -> dict[str, str]:
    """A worker's whole environment: Python's needs, its device family's runtime variables
    (``runtime_env``, copied from the daemon's environment when set), the plan's device
    variables (``device_env``: visibility, engine options) and the ``KUNLUN_*`` it reads."""
    source = dict(os.environ) if source is None else source
    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), _SYSTEM_PATH]),
        "HOME": str(workdir or home),
        "LANG": source.get("LANG", "C.UTF-8"),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(num_threads),
        "KUNLUN_HOME": str(home),
    }
    if workdir is not None:
        env["TMPDIR"] = str(workdir)
    env[NATIVE_BUILD_ENV] = "0"
    for name in ("PYTHONPATH", "KUNLUN_WORKER_NICE", "TZ", *PASSED_THROUGH, *runtime_env):
        if name in source:
            env[name] = source[name]
    env.update(device_env)
    return env


NATIVE_BUILD_ENV = "KUNLUN_NATIVE_BUILD"
"""``0`` in a worker's environment: the worker never compiles the decode library
(:mod:`kunlun.engine.native`; its seccomp filter forbids starting a compiler) and runs the build
``make setup`` made, or the reference path, saying which."""
PASSED_THROUGH = ("KUNLUN_DECODE_PATH", "KUNLUN_NATIVE_DIR")
"""The daemon's settings of the engine's decode path that its workers inherit."""

_AUDIT = re.compile(r"type=1326 .*?\bpid=(\d+)\b.*?\bsig=(\d+)\b.*?\bsyscall=(\d+)")


def seccomp_reason(pid: int) -> str:
    """Why a worker died of SIGSYS: the forbidden call from the kernel's audit record in
    ``/dev/kmsg`` when readable, else what the exit status alone tells."""
    number = _audit_syscall(pid)
    if number is None:
        return ("seccomp: forbidden system call (killed by SIGSYS; the kernel audit log "
                "is not readable here, so the call's number is unknown)")  # fmt: skip
    return f"seccomp: forbidden system call {number} ({_syscall_name(number)})"


def _audit_syscall(pid: int) -> int | None:
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode("utf-8", errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on
                continue
            if not record:
                break
            match = _AUDIT.search(record)
            if match and int(match.group(1)) == pid:
                found = int(match.group(3))
    finally:
        os.close(fd)
    return found


def _syscall_name(number: int) -> str:
    try:
        import pyseccomp

        return pyseccomp.resolve_syscall(pyseccomp.system_arch(), number).decode()
    except (ImportError, RuntimeError, OSError, ValueError):
        return "name unknown"
