"""Cost of ``advanced_profiling``: the engine with the step profiler off and on, same run.

Two measurements, both printed in one JSON object:

1. **Engine A/B.** One :class:`LLMEngine` on the demo model (fp32, CPU, one torch thread)
   runs the same batch workload (8 requests of 32 random prompt tokens and 32 output tokens
   with ``ignore_eos``, queued at once, stepped until done) with the profiler off and with
   it tracing every step (``profiling_interval_ms`` 0, the worst case), the two alternating
   within each round. Each run is timed in wall time and in CPU time of the engine thread
   (``time.thread_time``; with one torch thread the model runs in that thread), which a busy
   machine disturbs far less than wall time. ``overhead_pct`` is the median over rounds of
   the per-round relative loss of output tokens per CPU second (positive = slower).
2. **Profiler alone.** The profiler's own work per traced step (``begin``, six phase marks,
   ``end``, the periodic write to the file) timed over many synthetic steps, in
   microseconds; ``cost_pct_of_step`` relates it to the median CPU time of an engine step
   with the profiler off. On an accelerator a traced step also waits for the device twice,
   which this CPU-only figure does not include.

Usage: ``python benchmarks/profiling.py [--quick] [--rounds N] [--threads N]``.
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

NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 8, 32, 32
PHASES = ("schedule", "prepare", "forward", "sample", "postprocess", "detokenize")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds (a smoke check)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of off / on")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    return parser.parse_args()


def run_once(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, float]:
    """Queue every prompt and step until done; wall and CPU seconds, steps, tokens."""
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps = tokens = 0
    wall, cpu = time.perf_counter(), time.thread_time()
    while engine.has_unfinished():
        tokens += sum(len(d.token_ids) for d in engine.step())
        steps += 1
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "steps": steps, "tokens": tokens}


def engine_ab(rounds: int, threads: int, folder: Path) -> tuple[dict[str, Any], float]:
    engine = LLMEngine.from_model(
        demo_model_dir(), dtype=torch.float32, max_num_seqs=NUM_REQUESTS, num_threads=threads
    )
    rng = random.Random(0)
    vocab = engine.runner.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    run_once(engine, prompts)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {"off": [], "every_step": []}
    for index in range(rounds):
        for mode in ("off", "every_step") if index % 2 == 0 else ("every_step", "off"):
            profiler = StepProfiler(folder / f"ab-{index}.json", 0) if mode != "off" else None
            engine.set_profiler(profiler)
            runs[mode].append(run_once(engine, prompts))
            engine.set_profiler(None)
            if profiler is not None:
                profiler.close()
                runs[mode][-1]["traced_steps"] = profiler.num_traced
    out: dict[str, Any] = {}
    for mode, entries in runs.items():
        out[mode] = {
            "output_tokens_per_s": round(statistics.median(e["tokens"] / e["wall_s"] for e in entries), 2),
            "output_tokens_per_cpu_s": round(statistics.median(e["tokens"] / e["cpu_s"] for e in entries), 2),
            "steps_per_s": round(statistics.median(e["steps"] / e["wall_s"] for e in entries), 2),
        }  # fmt: skip
    losses = [
        (on["cpu_s"] - off["cpu_s"]) / on["cpu_s"] * 100  # loss of tokens per CPU second
        for off, on in zip(runs["off"], runs["every_step"], strict=True)
    ]
    out["every_step"]["traced_steps_per_run"] = runs["every_step"][0]["traced_steps"]
    out["overhead_pct"] = round(statistics.median(losses), 2)
    out["overhead_pct_per_round"] = [round(x, 2) for x in losses]
    step_cpu_s = statistics.median(e["cpu_s"] / e["steps"] for e in runs["off"])
    return out, step_cpu_s


def profiler_alone(folder: Path, num_steps: int) -> tuple[float, float]:
    """Microseconds of profiler work per traced step (file writes included), and the bytes
    of trace per step."""
    profiler = StepProfiler(folder / "alone.json", 0)
    batch = [1] * NUM_REQUESTS
    started = time.perf_counter()
    for _ in range(num_steps):
        trace = profiler.begin()
        for phase in PHASES:
            trace.mark(phase)
        trace.end(batch)
    profiler.close()
    seconds = time.perf_counter() - started
    return seconds / num_steps * 1e6, profiler.path.stat().st_size / num_steps


def main() -> None:
    args = parse_args()
    rounds = 2 if args.quick else args.rounds
    folder = Path(tempfile.mkdtemp(prefix="kunlun-profiling-"))
    ab, step_cpu_s = engine_ab(rounds, args.threads, folder)
    costs = [profiler_alone(folder, 2_000 if args.quick else 20_000) for _ in range(5)]
    cost_us = statistics.median(c[0] for c in costs)
    result = {
        "benchmark": "advanced_profiling overhead",
        "workload": f"{NUM_REQUESTS} requests x ({PROMPT_LEN} prompt + {OUTPUT_LEN} output "
        "tokens), demo model fp32 on cpu, one batch",
        "rounds": rounds,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, load average "
        f"{os.getloadavg()[0]:.1f}",
        "engine": ab,
        "engine_step_cpu_ms": round(step_cpu_s * 1e3, 2),
        "profiler_us_per_traced_step": round(cost_us, 1),
        "profiler_cost_pct_of_step": round(cost_us / (step_cpu_s * 1e6) * 100, 3),
        "trace_bytes_per_traced_step": round(costs[0][1]),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
