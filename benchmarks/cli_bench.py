"""``kunlun-cli bench`` against the serving benchmark's client, on one platform; prints JSON.

One ``kunlun-platform --demo`` with a fresh home; then, round after round on it, ``kunlun-cli
bench --concurrency 16 --num-prompts 16 --input-len 32 --output-len 128`` and the same load
(16 requests at once, 32 + 128 tokens) from ``benchmarks/serving.py``'s lean client, its
``16`` set. With ``--before REV``, the ``kunlun-cli`` of commit ``REV`` (its ``src`` from ``git
archive``, run on this venv) takes a turn in every round too, so a change to the benchmark's
client is measured against the code before it on the same platform in the same minutes.

Keys, per client (``cli``, and ``before`` with ``--before``): ``tokens_per_s`` (every
round's output tokens/s), ``client_cpu_share`` (every round's ``client.cpu_share`` of its
run: the command's own CPU over the run's wall time), and ``vs_lean`` (the median over
rounds of its tokens/s over the lean client's in the same round); ``lean_tokens_per_s``.

Usage: ``python benchmarks/cli_bench.py [--rounds N] [--before REV]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from serving import (  # noqa: E402 - the serving benchmark's pieces, one owner
    BIN,
    CLIENTS,
    free_port,
    requests,
    start_platform,
    wait_serving,
)

ROOT = Path(__file__).resolve().parent.parent
BENCH_ARGS = ("bench", "--model", "smollm2", "--concurrency", "16", "--num-prompts", "16",
              "--input-len", "32", "--output-len", "128", "--json")  # fmt: skip


def cli_run(url: str, out: Path, src: Path | None) -> dict[str, Any]:
    """One ``kunlun-cli bench`` (this checkout's, or the one under ``src``): its run."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    command = [str(BIN / "python"), "-c", "import sys; from kunlun.cli.main import main; "
               "sys.argv[0] = 'kunlun-cli'; sys.exit(main())",
               *BENCH_ARGS, "--endpoint", url, "--out", str(out)]  # fmt: skip
    subprocess.run(command, env=env, check=True, capture_output=True)
    doc = json.loads((out / "bench.json").read_text())
    run: dict[str, Any] = doc["runs"][0]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", help="a commit whose kunlun-cli takes a turn too")
    args = parser.parse_args()
    batch = requests(16, (32, 32), (128, 128), seed=0)
    with tempfile.TemporaryDirectory(prefix="kunlun-cli-bench-") as base:
        clients: dict[str, Path | None] = {"cli": None}
        if args.before:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "src"],
                                     check=True, capture_output=True).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
            clients["before"] = Path(base) / "src"
        home = Path(base) / "home"
        home.mkdir()
        port = free_port()
        proc = start_platform(home, port)
        url = f"http://127.0.0.1:{port}"
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in clients}
        lean: list[float] = []
        try:
            asyncio.run(wait_serving(url, "smollm2"))
            for turn in range(args.rounds):
                for name, src in clients.items():
                    runs[name].append(cli_run(url, Path(base) / f"{name}-{turn}", src))
                result = asyncio.run(CLIENTS["lean"](url, "smollm2", batch, 16,
                                                     {"ignore_eos": True}))  # fmt: skip
                lean.append(result["output_tokens_per_s"])
                print(f"round {turn}: " + ", ".join(
                    f"{name} {r[-1]['output_tokens_per_s']:.1f} "
                    f"(client {r[-1]['client']['cpu_share']:.3f})" for name, r in runs.items()
                ) + f", lean {lean[-1]:.1f}", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(60)
    report: dict[str, Any] = {"lean_tokens_per_s": lean}
    for name, rs in runs.items():
        speeds = [r["output_tokens_per_s"] for r in rs]
        report[name] = {
            "tokens_per_s": speeds,
            "client_cpu_share": [r["client"]["cpu_share"] for r in rs],
            "vs_lean": round(
                statistics.median(s / x for s, x in zip(speeds, lean, strict=True)), 3
            ),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
