"""Command-line options that several commands share, spelled once."""

from __future__ import annotations

from typing import Annotated

import typer

from kunlun.engine.schemes import listed

Quantization = Annotated[
    str | None,
    typer.Option("--quantization", "--quantize", help=f"{listed()}."),
]
"""Weight quantization (``--quantize`` is the seed's spelling)."""
TpSize = Annotated[
    int | None,
    typer.Option("--tp-size", help="Tensor-parallel size (default: what memory needs)."),
]
"""Tensor-parallel size, overriding the plan's."""
MaxNumSeqs = Annotated[
    int | None,
    typer.Option(
        "--max-num-seqs", "--batch-size",
        help="Sequences decoded together (default: sized by the plan; --batch-size is its "
        "old name).",
    ),
]  # fmt: skip
"""``max_num_seqs``, overriding the plan's sizing."""
StepTokens = Annotated[
    int | None,
    typer.Option(
        "--max-num-batched-tokens",
        help="Tokens one engine step computes, prefill chunks and decodes together (the "
        "chunked-prefill budget; default: sized by the plan).",
    ),
]  # fmt: skip
"""``max_num_batched_tokens``, overriding the plan's sizing."""
MemoryUtilization = Annotated[
    float | None,
    typer.Option(
        "--gpu-memory-utilization", "--memory-utilization",
        help="Fraction of each device's memory (0 < F <= 1) the replica's weights and KV "
        "cache may use (default 0.9; on a CPU it also lifts the default 1 GiB KV cap).",
    ),
]  # fmt: skip
"""A spec's ``memory_utilization`` (vLLM's ``--gpu-memory-utilization``)."""
Engine = Annotated[
    str | None,
    typer.Option(help="auto (default), kunlun, llama.cpp, vllm or sglang (docs/engines.md)."),
]
"""The inference engine, overriding the plan's choice."""
