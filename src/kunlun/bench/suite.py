"""One whole benchmark: warm-up, the concurrency sweep, Poisson runs, platform figures.

:func:`run` returns the JSON document that ``kunlun-cli bench`` prints and saves::

    {"endpoint", "model", "input_len", "output_len", "slo": {"ttft_ms", "tpot_ms"},
     "startup": [{"replica", "device", "compile_s", "load_s", "warmup_ttft_s", "total_s"}],
     "memory": {"idle_bytes", "one_request_bytes", "full_concurrency_bytes"},
     "runs": [{"mode": "concurrency" | "poisson", "concurrency", "rate", "peak_memory_bytes",
               "client": {"cpu_s", "wall_s", "cpu_share"},
               ...the summary of kunlun.bench.stats.summarize..., "requests": [...]}],
     "client": {"cpu_s", "wall_s", "cpu_share"}, "warnings": [...]}

``client`` is this benchmark's own CPU time (user and system, every thread of its process)
against wall time, per run and for the whole benchmark; a run over :data:`CLIENT_CPU_WARN`
is named in ``warnings`` (printed under the table).

Memory figures are the resident memory of the daemon's process tree read from its
``/metrics``: before any request (idle), the peak during the single warm-up request (one
request), and the peak during the run with the most concurrency (full concurrency). They
are None when the endpoint is not a Kunlun daemon.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kunlun.bench import load
from kunlun.bench.report import run_label
from kunlun.bench.stats import summarize
from kunlun.errors import KunlunError

WARMUP_SEED = -1
CLIENT_CPU_WARN = 0.05
"""A run whose benchmark process used more CPU than this share of its wall time is warned
about (``warnings``)."""


class BenchError(KunlunError):
    """The benchmark cannot run against this endpoint (its warm-up request failed)."""

    code = "bench.failed"


@dataclass(frozen=True)
class BenchOptions:
    target: load.Target
    concurrencies: tuple[int, ...] = (1, 4, 16)
    rates: tuple[float, ...] = ()
    num_prompts: int | None = None
    """Requests per run; None: 4 per client (at least 8) in the sweep, 32 per Poisson run."""
    input_len: int = 128
    output_len: int = 128
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    seed: int = 0

    def count(self, concurrency: int | None) -> int:
        if self.num_prompts is not None:
            return self.num_prompts
        return 32 if concurrency is None else max(8, 4 * concurrency)


async def run(options: BenchOptions, progress: Any = None) -> dict[str, Any]:
    """Run every configured run in turn; ``progress(message)`` is told what starts."""
    probe = load.PlatformProbe(options.target)
    try:
        return await _run(options, probe, progress or (lambda message: None))
    finally:
        await probe.close()


class ClientClock:
    """The benchmark's own CPU time (this process, every thread) against wall time: a load
    generator that takes much of the machine it shares with the server disturbs the figure
    it measures."""

    def __init__(self) -> None:
        self.cpu, self.wall = time.process_time(), time.monotonic()

    def figures(self) -> dict[str, float]:
        cpu, wall = time.process_time() - self.cpu, time.monotonic() - self.wall
        return {"cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                "cpu_share": round(cpu / wall, 4) if wall > 0 else 0.0}  # fmt: skip


async def _run(options: BenchOptions, probe: load.PlatformProbe, say: Any) -> dict[str, Any]:
    target = options.target
    whole = ClientClock()
    idle = await probe.memory()
    startup = await probe.startup()
    say("warm-up: 1 request")
    async with probe.peak_memory() as one:
        warm = await load.closed_loop(
            target, load.make_prompts(1, options.input_len, WARMUP_SEED), 1, options.output_len
        )
    if not warm[0].ok:
        raise BenchError(
            f"the warm-up request to {target.base_url}/v1/completions (model {target.model!r}) "
            f"failed: {warm[0].error or 'no text received'}",
            hint="check --endpoint, --model and the API key (--api-key or KUNLUN_API_KEY)",
        )
    runs = []
    plan: list[tuple[str, int | None, float | None]]
    plan = [("concurrency", c, None) for c in options.concurrencies]
    plan += [("poisson", None, r) for r in options.rates]
    for index, (mode, concurrency, rate) in enumerate(plan):
        count = options.count(concurrency)
        prompts = load.make_prompts(count, options.input_len, options.seed + index)
        label = f"concurrency {concurrency}" if concurrency else f"Poisson rate {rate:g}/s"
        say(f"{label}: {count} requests of {options.input_len} + {options.output_len} tokens")
        clock = ClientClock()
        async with probe.peak_memory() as peak:
            if concurrency is not None:
                records = await load.closed_loop(target, prompts, concurrency, options.output_len)
            else:
                assert rate is not None
                records = await load.poisson(
                    target, prompts, rate, options.output_len, options.seed + index
                )
        summary = summarize(records, options.slo_ttft_ms, options.slo_tpot_ms)
        runs.append(
            {
                "mode": mode,
                "concurrency": concurrency,
                "rate": rate,
                "peak_memory_bytes": peak["peak_bytes"],
                "client": clock.figures(),
                **summary,
                "requests": [r.to_dict() for r in records],
            }
        )
    busiest = max(runs, key=lambda r: (r["concurrency"] or 0, r["rate"] or 0), default=None)
    client = whole.figures()
    return {
        "endpoint": target.base_url,
        "model": target.model,
        "input_len": options.input_len,
        "output_len": options.output_len,
        "slo": {"ttft_ms": options.slo_ttft_ms, "tpot_ms": options.slo_tpot_ms},
        "warmup": summarize(warm),
        "startup": startup,
        "memory": {
            "idle_bytes": idle,
            "one_request_bytes": one["peak_bytes"],
            "full_concurrency_bytes": busiest["peak_memory_bytes"] if busiest else None,
        },
        "runs": runs,
        "client": client,
        "warnings": [
            f"{run_label(r)}: this benchmark's own CPU was {r['client']['cpu_share']:.0%} of the "
            f"run's wall time (over {CLIENT_CPU_WARN:.0%}): on a machine it shares with the "
            "server, it takes CPU from what it measures"
            for r in runs
            if r["client"]["cpu_share"] > CLIENT_CPU_WARN
        ],
    }
