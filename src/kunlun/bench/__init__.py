"""``kunlun-cli bench``: serving benchmarks against any OpenAI-compatible endpoint.

- :mod:`~kunlun.bench.stats`: per-request timings and the summary math (TTFT, TPOT, ITL,
  end-to-end latency, throughput, goodput), on plain timestamps;
- :mod:`~kunlun.bench.load`: the load generators (closed-loop concurrency, Poisson
  arrivals) streaming ``/v1/completions`` with fixed prompt and output lengths, and the
  reading of the platform's memory and start-up times from ``/metrics``;
- :mod:`~kunlun.bench.report`: the table, the JSON document and the PNG chart.

The definitions are in ``docs/telemetry.md`` ("Benchmark definitions").
"""
