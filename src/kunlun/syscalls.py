"""The engine worker's system call allow-list, and the seccomp filter made from it.

Built by tracing a real worker (``strace -f``) while it converted, loaded and served the demo
model (completions, streams, chat, ``n`` > 1, metrics) and read on the tiny test model; each
group says why the worker needs it (``docs/sandbox.md`` has the same table). Names that the
running architecture does not have (``open`` on aarch64) are skipped. Anything else kills the
whole worker with SIGSYS (``SECCOMP_RET_KILL_PROCESS``); the node agent reports it.

Three calls are narrowed rather than listed plainly:

- ``clone`` only with ``CLONE_THREAD`` (threads, never new processes); ``clone3``, whose flags
  a filter cannot read, answers ENOSYS, so the C library falls back to ``clone``;
- ``socket`` only for ``AF_UNIX``, ``AF_INET`` and ``AF_INET6``;
- ``kill`` and ``tgkill`` only for the worker itself; ``prctl`` only to name threads.

``io_uring_setup`` answers ENOSYS (io_uring operations would bypass this filter; libuv then
uses its thread pool).
"""

from __future__ import annotations

import errno
import os
import socket

SYSCALL_GROUPS: dict[str, tuple[str, ...]] = {
    "memory: the allocator, torch tensors, mapped weight files, NUMA placement": (
        "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "mbind", "get_mempolicy",
        "set_mempolicy", "membarrier", "mlock", "munlock", "msync", "mincore"),
    "threads and waiting: torch's and OpenMP's pools, tokenizers, asyncio's executor": (
        "futex", "futex_waitv", "set_robust_list", "get_robust_list", "set_tid_address", "rseq",
        "sched_yield", "sched_getaffinity", "sched_setaffinity", "sched_getparam",
        "sched_getscheduler", "sched_get_priority_max", "sched_get_priority_min",
        "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday", "time",
        "exit", "exit_group", "restart_syscall", "getcpu"),
    "signals: uvicorn's SIGTERM drain, Python's handlers, the C library's thread signals": (
        "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigsuspend",
        "rt_sigtimedwait", "rt_sigqueueinfo", "sigaltstack", "pause", "alarm", "setitimer",
        "getitimer"),
    "files: reading model files, Python modules, /proc and /sys; the plan cache's weights, "
    "the ready file, traces": (
        "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
        "preadv2", "pwritev2", "lseek", "open", "openat", "openat2", "close", "close_range",
        "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs", "access",
        "faccessat", "faccessat2", "readlink", "readlinkat", "getdents64", "getcwd", "chdir",
        "fchdir", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat",
        "renameat2", "symlink", "symlinkat", "link", "linkat", "chmod", "fchmod", "fchmodat",
        "utimensat", "ftruncate", "fallocate", "fsync", "fdatasync", "fadvise64", "flock",
        "fcntl", "dup", "dup2", "dup3", "pipe", "pipe2", "umask", "memfd_create", "copy_file_range",
        "sendfile", "splice", "readahead", "ioctl"),
    "event loop and sockets: uvloop/asyncio on loopback, the gateway's connections": (
        "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait",
        "epoll_pwait2", "poll", "ppoll", "select", "pselect6", "eventfd", "eventfd2",
        "timerfd_create", "timerfd_settime", "timerfd_gettime", "signalfd", "signalfd4",
        "socketpair", "bind", "listen", "accept", "accept4", "connect", "getsockname",
        "getpeername", "setsockopt", "getsockopt", "sendto", "recvfrom", "sendmsg", "recvmsg",
        "sendmmsg", "recvmmsg", "shutdown"),
    "process facts: ids, limits, usage, the host (torch's CPU detection, psutil)": (
        "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid", "getgroups",
        "getresuid", "getresgid", "getpgrp", "getpgid", "getsid", "getpriority",
        "setpriority", "getrlimit", "prlimit64", "getrusage", "times", "sysinfo", "uname",
        "getrandom", "arch_prctl", "capget", "wait4", "waitid"),
}  # fmt: skip
"""Allowed without conditions, by group (the group names are documentation)."""

CLONE_THREAD = 0x00010000
PR_SET_NAME, PR_GET_NAME = 15, 16
ALLOWED_SOCKET_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
UNAVAILABLE = ("clone3", "io_uring_setup")
"""Calls that answer ENOSYS (see the module docstring) instead of killing the worker."""


def allowed_syscalls() -> list[str]:
    """Every name allowed without conditions, sorted."""
    return sorted({name for names in SYSCALL_GROUPS.values() for name in names})


def install_filter() -> None:
    """Install the allow-list on every thread of this process (``TSYNC``); irreversible."""
    import pyseccomp as seccomp

    pid = os.getpid()
    rules = seccomp.SyscallFilter(seccomp.KILL_PROCESS)
    rules.set_attr(seccomp.Attr.CTL_TSYNC, 1)
    arch = seccomp.system_arch()
    for name in allowed_syscalls():
        if seccomp.resolve_syscall(arch, name) >= 0:
            rules.add_rule(seccomp.ALLOW, name)
    for name in UNAVAILABLE:
        if seccomp.resolve_syscall(arch, name) >= 0:
            rules.add_rule(seccomp.ERRNO(errno.ENOSYS), name)
    rules.add_rule(seccomp.ALLOW, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, CLONE_THREAD))  # fmt: skip
    for family in ALLOWED_SOCKET_FAMILIES:
        rules.add_rule(seccomp.ALLOW, "socket", seccomp.Arg(0, seccomp.EQ, int(family)))
    for target in (pid, 0):
        rules.add_rule(seccomp.ALLOW, "kill", seccomp.Arg(0, seccomp.EQ, target))
    rules.add_rule(seccomp.ALLOW, "tgkill", seccomp.Arg(0, seccomp.EQ, pid))
    for option in (PR_SET_NAME, PR_GET_NAME):
        rules.add_rule(seccomp.ALLOW, "prctl", seccomp.Arg(0, seccomp.EQ, option))
    rules.load()
