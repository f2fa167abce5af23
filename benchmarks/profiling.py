"""Cost of ``advanced_profiling``: engine throughput with the step profiler off and on.

One :class:`LLMEngine` on the demo model (fp32, CPU) runs the same batch workload (8
requests of 32 random prompt tokens and 64 output tokens with ``ignore_eos``, all queued at
once, stepped until done) in three modes, taking turns within each round so that drifts of
the machine hit every mode alike:

- ``off``: no profiler (the default);
- ``every_step``: profiler with ``profiling_interval_ms`` 0, the worst case;
- ``interval_50ms``: profiler with ``profiling_interval_ms`` 50 (the default interval).

For each mode: the median over rounds of output tokens/s and engine steps/s; for each
profiled mode, ``overhead_pct`` is the median over rounds of the per-round relative loss of
tokens/s against ``off`` in the same round (positive = slower). Also the traced steps per
run and the bytes of trace written per traced step.

Usage: ``python benchmarks/profiling.py [--quick] [--rounds N] [--threads N]``. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kunlun.engine.gguf import demo_model_dir
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.step_profiler import StepProfiler

MODES = {"off": None, "every_step": 0.0, "interval_50ms": 50.0}
NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 8, 32, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds (a smoke check)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the three modes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    return parser.parse_args()


def run_once(engine: LLMEngine, prompts: list[list[int]]) -> tuple[float, int, int]:
    """Queue every prompt, step until done: (seconds, steps, output tokens)."""
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps = tokens = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(d.token_ids) for d in engine.step())
        steps += 1
    return time.perf_counter() - started, steps, tokens


def main() -> None:
    args = parse_args()
    rounds = 2 if args.quick else args.rounds
    engine = LLMEngine.from_model(
        demo_model_dir(), dtype=torch.float32, max_num_seqs=NUM_REQUESTS, num_threads=args.threads
    )
    rng = random.Random(0)
    vocab = engine.runner.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    run_once(engine, prompts)  # warm-up
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    folder = Path(tempfile.mkdtemp(prefix="kunlun-profiling-"))
    order = list(MODES)
    for round_index in range(rounds):
        for mode in order[round_index % 3 :] + order[: round_index % 3]:
            interval = MODES[mode]
            profiler = None
            if interval is not None:
                profiler = StepProfiler(folder / f"{mode}-{round_index}.json", interval)
            engine.set_profiler(profiler)
            seconds, steps, tokens = run_once(engine, prompts)
            engine.set_profiler(None)
            entry = {"tokens_per_s": tokens / seconds, "steps_per_s": steps / seconds}
            if profiler is not None:
                profiler.close()
                entry["traced_steps"] = profiler.num_traced
                entry["trace_bytes"] = profiler.path.stat().st_size
            results[mode].append(entry)
    print(json.dumps(summary(results, rounds, args.threads), indent=2))


def summary(
    results: dict[str, list[dict[str, float]]], rounds: int, threads: int
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "benchmark": "advanced_profiling overhead",
        "workload": f"{NUM_REQUESTS} requests x ({PROMPT_LEN} prompt + {OUTPUT_LEN} output tokens), "
        "demo model fp32 on cpu, batched",
        "rounds": rounds,
        "threads": threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, load average "
        f"{os.getloadavg()[0]:.1f}",
    }
    for mode, entries in results.items():
        figures: dict[str, Any] = {
            "tokens_per_s": round(statistics.median(e["tokens_per_s"] for e in entries), 1),
            "steps_per_s": round(statistics.median(e["steps_per_s"] for e in entries), 1),
        }
        if mode != "off":
            losses = [
                (off["tokens_per_s"] - on["tokens_per_s"]) / off["tokens_per_s"] * 100
                for off, on in zip(results["off"], entries, strict=True)
            ]
            figures["overhead_pct"] = round(statistics.median(losses), 2)
            figures["overhead_pct_per_round"] = [round(x, 2) for x in losses]
            traced = statistics.median(e["traced_steps"] for e in entries)
            figures["traced_steps_per_run"] = traced
            figures["trace_bytes_per_traced_step"] = round(
                statistics.median(e["trace_bytes"] for e in entries) / max(traced, 1)
            )
        out[mode] = figures
    return out


if __name__ == "__main__":
    main()
