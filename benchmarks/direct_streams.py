"""Direct streams against the gateway's relay, side by side; prints one JSON object.

Two ``kunlun-platform --demo`` run at once with fresh homes: one with its defaults (a worker
writes each stream to the client's connection itself, :mod:`kunlun.serving.handoff`), one with
``--no-direct-streams`` (every token relayed by the gateway). The same requests go to each
in turns, round after round, who goes first alternating, through the serving benchmark's lean
client (``benchmarks/serving.py``: its sets ``16``, ``1`` and ``mixed``, 9, 8 and 6 rounds).
Each platform idles while the other runs, so both pay the other's idle work alike.

Keys: ``direct_vs_relay_<set>``, the median over rounds of the ratio of output tokens/s (each
ratio of two runs adjacent in time); ``rounds``, every ratio; ``cpu_ms_per_token``, per side
and set, the CPU milliseconds per output token of the worker, the daemon and the client (this
process), each the median of the rounds: the machine-independent part of the answer, since
on two cores every millisecond a process other than the step's takes is a millisecond the
step waits; ``direct_streams``, the streams each side's worker wrote itself (the relay's: 0).

Usage: ``python benchmarks/direct_streams.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from serving import (  # noqa: E402 - the serving benchmark's pieces, one owner
    CLIENTS,
    direct_streams,
    free_port,
    requests,
    start_platform,
    wait_serving,
    with_cpu,
)

SIDES = {"direct": (), "relay": ("--no-direct-streams",)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    args = parser.parse_args()
    output = 32 if args.quick else 128
    sets = {
        "16": (requests(16, (32, 32), (output, output), seed=0), 16),
        "1": (requests(1, (32, 32), (output, output), seed=1), 1),
        "mixed": (requests(8 if args.quick else 32, (32, 512), (16, output), seed=2), 16),
    }
    rounds = {"16": 9, "1": 8, "mixed": 6}
    if args.quick:
        rounds = dict.fromkeys(rounds, 2)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kunlun-direct-") as base:
        procs, urls = {}, {}
        try:
            for side, flags in SIDES.items():
                home = Path(base) / side
                home.mkdir()
                port = free_port()
                procs[side] = start_platform(home, port, *flags)
                urls[side] = f"http://127.0.0.1:{port}"
            for url in urls.values():
                asyncio.run(wait_serving(url, "smollm2"))
            runs: dict[str, dict[str, list[dict[str, Any]]]] = {
                side: {name: [] for name in sets} for side in SIDES
            }
            for name, (batch, in_flight) in sets.items():
                for turn in range(rounds[name]):
                    order = ("direct", "relay") if turn % 2 == 0 else ("relay", "direct")
                    for side in order:
                        send = functools.partial(CLIENTS["lean"], urls[side], "smollm2", batch,
                                                 in_flight, {"ignore_eos": True})  # fmt: skip
                        run = functools.partial(asyncio.run, send())
                        runs[side][name].append(with_cpu(run, procs[side]))
                    print(f"{name}: direct {runs['direct'][name][-1]['output_tokens_per_s']}, "
                          f"relay {runs['relay'][name][-1]['output_tokens_per_s']}",
                          file=sys.stderr, flush=True)  # fmt: skip
            report["direct_streams"] = {side: direct_streams(url) for side, url in urls.items()}
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(60)
    report["rounds"] = {}
    for name in sets:
        ratios = [d["output_tokens_per_s"] / r["output_tokens_per_s"]
                  for d, r in zip(runs["direct"][name], runs["relay"][name], strict=True)]  # fmt: skip
        report["rounds"][name] = [round(x, 3) for x in ratios]
        report[f"direct_vs_relay_{name}"] = round(statistics.median(ratios), 3)
    report["cpu_ms_per_token"] = {
        side: {name: {part: round(statistics.median(r["cpu_ms_per_token"][part] for r in rs), 3)
                      for part in ("worker", "daemon", "client")}
               for name, rs in by_set.items()}
        for side, by_set in runs.items()
    }  # fmt: skip
    report["best_tokens_per_s"] = {
        side: {name: max(r["output_tokens_per_s"] for r in rs) for name, rs in by_set.items()}
        for side, by_set in runs.items()
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
