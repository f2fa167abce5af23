"""Kunlun's int4 kernel against torch's int4pack kernel, on the demo model's shapes.

The products of one decode step of the demo's 30 layers (qkv 960x576, o 576x576, gate/up
3072x576, down 576x1536: 106 M int4 weights, 66 MB with their group scales), as many distinct
matrices as the model has (so the weights stream from memory, as in a step), group 32,
random nibbles with float16-exact scales and minimums; for each token count and activation
dtype: both kernels' best of five passes over the 120 products, taken in turn, and their
largest error against a float64 product of the same weights (the first layer's shapes).
``torch.ops.kunlun.int4_matmul`` (``decode.cpp``: tiles of 32 rows up to 48 tokens, 16 on AVX2;
dequantized tiles through ``torch.mm`` past them) against
``torch._weight_int4pack_mm_for_cpu`` with the bf16 activations it takes.

Usage: ``python benchmarks/int4_kernel.py [--tokens 1,4,16,32,128,512] [--threads N]``;
prints one JSON object (``ours_vs_int4pack`` per row: their time over ours). On another
instruction set than the machine's own, run it with the library built for that set and
torch's dispatch held to it (``docs/benchmarks.md`` says how the AVX2 figures were taken).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import torch

from kunlun.engine.native import load
from kunlun.engine.native.measure import INT4_LAYER
from kunlun.engine.quant import QuantSpec, dequantize, int4_tiles, pack_int4

SHAPES = INT4_LAYER  # one decoder layer's products as the engine holds them (the demo's)
LAYERS, GROUP, ROUNDS = 30, 32, 5


def weights(generator: torch.Generator) -> list[Any]:
    """Per layer and shape: our tiles, torch's packed weight and pairs, the float weight."""
    out = []
    for _ in range(LAYERS):
        layer = []
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
            scale = (torch.rand(n, k // GROUP, generator=generator) / 100 + 1e-3).half().float()
            minimum = (-8 * scale + torch.randn(scale.shape, generator=generator) / 1000).half()
            minimum = minimum.float()
            ours = int4_tiles(pack_int4(q), scale, minimum, GROUP)
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            pairs = torch.stack((scale.t(), (minimum + 8 * scale).t()), dim=-1)
            canonical = {"weight_packed": pack_int4(q), "weight_scale": scale,
                         "weight_min": minimum}  # fmt: skip
            exact = dequantize(canonical, QuantSpec("w4a16", GROUP))
            layer.append((ours, (packed, pairs.to(torch.bfloat16).contiguous()), exact))
        out.append(tuple(layer))
    return out


def run(
    tokens: int, dtype: torch.dtype, layers: list[Any], generator: torch.Generator
) -> dict[str, Any]:
    xs = {k: torch.randn(tokens, k, generator=generator).to(dtype) for k in (576, 1536)}

    def ours() -> None:
        for layer in layers:
            for (_, k), (tiles, _, _) in zip(SHAPES, layer, strict=True):
                torch.ops.kunlun.int4_matmul(xs[k], *tiles, GROUP)

    def theirs() -> None:
        for layer in layers:
            for (_, k), (_, (packed, pairs), _) in zip(SHAPES, layer, strict=True):
                torch._weight_int4pack_mm_for_cpu(xs[k].to(torch.bfloat16), packed, GROUP, pairs)

    best = {"ours": float("inf"), "int4pack": float("inf")}
    for _ in range(ROUNDS):
        for name, fn in (("ours", ours), ("int4pack", theirs)):
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    errors = {"ours": 0.0, "int4pack": 0.0}
    for (_, k), (tiles, (packed, pairs), exact) in zip(SHAPES, layers[0], strict=True):
        want = xs[k].double() @ exact.double().T
        got = {"ours": torch.ops.kunlun.int4_matmul(xs[k], *tiles, GROUP),
               "int4pack": torch._weight_int4pack_mm_for_cpu(
                   xs[k].to(torch.bfloat16), packed, GROUP, pairs)}  # fmt: skip
        for name, value in got.items():
            errors[name] = max(errors[name], float((value.double() - want).abs().max()))
    megabytes = sum(n * k for n, k in SHAPES) * LAYERS * (0.5 + 4 / GROUP) / 1e6
    return {
        "tokens": tokens,
        "activations": str(dtype).removeprefix("torch."),
        "ours_ms": round(best["ours"] * 1e3, 2),
        "int4pack_ms": round(best["int4pack"] * 1e3, 2),
        "ours_gb_per_s": round(megabytes / best["ours"] / 1e3, 1),
        "ours_vs_int4pack": round(best["int4pack"] / best["ours"], 3),
        "max_error": {name: float(f"{e:.3g}") for name, e in errors.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,4,16,32,128,512")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    status = load()
    if not status.compiled:
        raise SystemExit(f"the compiled library is not loaded: {status.reason}")
    generator = torch.Generator().manual_seed(0)
    layers = weights(generator)
    rows = [run(int(t), dtype, layers, generator)
            for t in args.tokens.split(",") for dtype in (torch.float32, torch.bfloat16)]  # fmt: skip
    print(json.dumps({
        "library": status.reason, "threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.processor() or platform.machine(), "rows": rows,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
