"""Confine an external engine's server, then become it.

``python -m kunlun.node.confine --sandbox JSON --nice N -- PROGRAM ARGS...`` is the prefix the
node agent puts before an external engine's command (llama-server, vLLM, SGLang). It applies
what of the embedded worker's confinement carries over to a program Kunlun did not write,
then ``exec``\\ s the program, so the server keeps the same process (the agent's pid, its
watchdog and its cgroup) and inherits all of it:

- it dies with the daemon (``PR_SET_PDEATHSIG`` SIGKILL, checked against the daemon's pid:
  a daemon that is killed leaves no orphaned server holding a port and its memory);
- with the sandbox on, ``RLIMIT_CORE`` 0, ``RLIMIT_NOFILE`` and ``no_new_privs``
  (:func:`kunlun.sandbox.enter`, the same call the worker makes);
- the workers' niceness (:func:`kunlun.serving.worker.default_nice`), so that engine compute
  yields to the gateway's short bursts whichever engine runs it.

The seccomp allow-list is not installed: it lists the calls of Kunlun's own worker (Python,
torch), and another program's calls are its own (a call outside the list would kill a
healthy server). Its clean environment, own directory and memory cap are the agent's, as for
a worker.
"""

from __future__ import annotations

import argparse
import os
import sys

from kunlun import sandbox

MODULE = "kunlun.node.confine"


def command(confinement: sandbox.WorkerSandbox, nice: int, argv: list[str]) -> list[str]:
    """``argv`` started confined (this interpreter runs the prefix)."""
    return [sys.executable, "-m", MODULE, "--sandbox", confinement.to_json(),
            "--nice", str(nice), "--", *argv]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m " + MODULE, description=__doc__.split("\n")[0])
    parser.add_argument("--sandbox", required=True, help="a WorkerSandbox as JSON")
    parser.add_argument("--nice", type=int, default=0, help="niceness to add (0-19)")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("no program after --")
    if not 0 <= args.nice <= 19:
        parser.error(f"--nice must be 0-19, got {args.nice}")
    try:
        confinement = sandbox.WorkerSandbox.from_json(args.sandbox)
    except ValueError as exc:
        parser.error(f"--sandbox: {exc}")
    sandbox.enter(confinement)
    if args.nice:
        os.nice(args.nice)
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        print(f"error: cannot start {program[0]}: {exc}", file=sys.stderr, flush=True)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
