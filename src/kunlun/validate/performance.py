"""A short performance sweep: a few streamed requests at concurrency 1 and 4.

Figures only (``kunlun-cli bench`` is the real benchmark): time to first token (to the
first chunk with text), output tokens per second over the wall time of the round, and
per-stream decode speed. A cell fails only on errors. Requests use ``ignore_eos`` (a vLLM
extension Kunlun serves) so every request decodes the same number of tokens where the
server honours it; tokens are counted from the ``include_usage`` chunk.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from kunlun.validate.check import Check, Context
from kunlun.validate.client import CheckFailed, Stream
from kunlun.validate.matrix import Cell, Row, failed, passed

PROMPT = [{"role": "user", "content": "Write a short poem about mountains."}]


def _one(ctx: Context) -> Stream | str:
    body = {"messages": PROMPT, "max_tokens": ctx.settings.perf_max_tokens, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        return ctx.client.stream("performance", "/v1/chat/completions", body)
    except CheckFailed as exc:
        return str(exc)


def sweep(ctx: Context, concurrency: int, num_requests: int) -> Cell:
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda _: _one(ctx), range(num_requests)))
    wall = time.perf_counter() - started
    errors = [r for r in results if isinstance(r, str)]
    streams = [r for r in results if isinstance(r, Stream)]
    if errors:
        return failed(f"{len(errors)}/{num_requests} errors", "; ".join(sorted(set(errors))[:3]))
    tokens = [int((s.chunks[-1].get("usage") or {}).get("completion_tokens") or 0)
              if s.chunks else 0 for s in streams]  # fmt: skip
    ttfts = [s.first_content_s for s in streams if s.first_content_s is not None]
    if not ttfts or not sum(tokens):
        return failed("no tokens", "the streams carried no text or no usage")
    ttft_ms = statistics.median(ttfts) * 1e3
    output_tok_s = sum(tokens) / wall
    decode = [(n - 1) / (s.elapsed_s - s.first_content_s)
              for s, n in zip(streams, tokens, strict=True)
              if s.first_content_s is not None and n > 1 and s.elapsed_s > s.first_content_s]  # fmt: skip
    per_stream = statistics.median(decode) if decode else 0.0
    return passed(
        f"TTFT {ttft_ms:.0f} ms, {output_tok_s:.1f} tok/s",
        f"{num_requests} requests at concurrency {concurrency}: median TTFT {ttft_ms:.1f} ms, "
        f"{sum(tokens)} output tokens in {wall:.2f} s, median decode {per_stream:.1f} tok/s "
        f"per stream",
        ttft_ms=round(ttft_ms, 1),
        output_tok_s=round(output_tok_s, 2),
        decode_tok_s=round(per_stream, 2),
    )


def checks(plan: tuple[tuple[int, int], ...]) -> list[Check]:
    """One row per ``(concurrency, requests)`` of the sweep."""
    out = []
    for concurrency, num_requests in plan:

        def run(ctx: Context, c: int = concurrency, n: int = num_requests) -> Cell:
            return sweep(ctx, c, n)

        row = Row(f"perf.c{concurrency}", f"performance, concurrency {concurrency}")
        out.append(Check(row, run))
    return out
