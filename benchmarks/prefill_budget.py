"""The chunked-prefill budget's trade-off: time to first token against throughput and stalls.

One run, the demo model with the plan the platform makes on this machine's CPU, one engine in
this process, the same requests for every budget (``max_num_batched_tokens``, the most tokens
one step computes: prefill chunks and decodes together; set on the engine's scheduler between
runs; the prefix cache off, so that every run prefills its prompts). Two sets, each all arriving at once: ``uniform`` (16 requests, 32-token prompts, 64
output tokens) and ``mixed`` (16 requests, prompts 32-512 tokens, outputs 16-64). The budgets
take turns, round after round (this machine's speed drifts: each budget sees the same drift),
and each figure is the median over the rounds. Per budget and set: output tokens/s, TTFT p50
and p90, and the longest gap between two tokens of one stream once it has started (a step
that carries a long prefill stalls every decoding stream for that long).

Usage: ``python benchmarks/prefill_budget.py [--budgets 64,128,...] [--threads N]``; prints
one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kunlun.device.registry import load_plugins  # noqa: E402
from kunlun.engine.gguf import demo_model_dir  # noqa: E402
from kunlun.engine.llm_engine import LLMEngine  # noqa: E402
from kunlun.engine.sampling_params import SamplingParams  # noqa: E402
from kunlun.planner.launch import engine_launch  # noqa: E402
from serving import Request, platform_plan, requests  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(engine: LLMEngine, batch: list[Request]) -> dict[str, float]:
    """Every request of ``batch`` added at once and stepped to the end."""
    sent: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    started = time.perf_counter()
    for prompt, num in batch:
        params = SamplingParams(temperature=0, max_tokens=num, ignore_eos=True)
        sent[engine.add_request(prompt, params)] = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.token_ids:
                times.setdefault(delta.request_id, []).append(time.perf_counter())
                tokens += len(delta.token_ids)
    elapsed = time.perf_counter() - started
    ttfts = [times[r][0] - sent[r] for r in sent]
    stalls = [
        max(b - a for a, b in zip(t, t[1:], strict=False)) for t in times.values() if len(t) > 1
    ]
    return {
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000),
        "ttft_p90_ms": round(percentile(ttfts, 0.9) * 1000),
        "longest_stall_ms": round(max(stalls) * 1000),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="64,128,256,512,1024,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plan = platform_plan()
    launch = engine_launch(plan, load_plugins().plugins["cpu"], demo_model_dir(), "smollm2",
                           None, args.threads)  # fmt: skip
    sets = {
        "uniform": requests(16, (32, 32), (64, 64)),
        "mixed": requests(16, (32, 512), (16, 64), seed=2),
    }
    report: dict[str, Any] = {"plan": plan.summary(), "budgets": {}}
    # the sets repeat: without the prefix cache every run prefills its whole prompts
    engine = LLMEngine(launch.model_copy(update={"enable_prefix_caching": False}).engine_config())
    run(engine, requests(2, (32, 32), (4, 4), seed=9))  # warm-up
    budgets = [int(b) for b in args.budgets.split(",")]
    runs: dict[int, dict[str, list[dict[str, float]]]] = {b: {n: [] for n in sets} for b in budgets}
    for _ in range(args.rounds):
        for budget in budgets:
            config = engine.scheduler.config
            engine.scheduler.config = dataclasses.replace(config, max_num_batched_tokens=budget)
            for name, batch in sets.items():
                runs[budget][name].append(run(engine, batch))
            print(budget, {n: r[-1] for n, r in runs[budget].items()}, file=sys.stderr, flush=True)
    for budget in budgets:
        report["budgets"][budget] = {
            name: {key: statistics.median(r[key] for r in results) for key in results[0]}
            for name, results in runs[budget].items()
        }
    engine.close()
    report["setup"] = {"threads": args.threads, "rounds": args.rounds, "cpu_count": os.cpu_count(),
                       "torch": torch.__version__}  # fmt: skip
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
