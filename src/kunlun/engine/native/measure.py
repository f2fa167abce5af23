"""The measurement behind :func:`kunlun.engine.native.choice`: which of Kunlun's operators and
torch's kernels for the same job runs faster on this CPU, timed on the demo model's products.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kunlun.engine.native import DEQUANTIZE_FROM_TOKENS, MEASURED_DTYPES, NativeChoice

#: What the int4 measurement multiplies: the products of one decoder layer as the engine
#: holds them (out, in: q/k/v fused, o, gate/up fused, down; the demo model's), group 32, one
#: token; this many distinct layers (20 MB of int4: more than a core's caches, as a model's
#: layers are), best of this many rounds, the two kernels in turn. (One unfused shape alone
#: misjudged the engine: with bf16 activations int4pack won 1536x576 by 2 %, where Kunlun's
#: kernel ran the demo's decode 5 % faster.)
INT4_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
INT4_GROUP, INT4_LAYERS, ROUNDS = 32, 10, 11
#: The token counts the int8 measurement runs, the same layers' products with int8 rows: one
#: sequence's decode, and batches. (Kunlun's rows, float32 sums of widened weights, streamed
#: the weights fastest at one token on both CPUs measured; torch's kernel, bf16 pairs through
#: the CPU's dot-product instruction, ran 16 tokens 1.6x as fast on a Zen 5 core.)
INT8_TOKENS = (1, 4, 16)


def measure() -> NativeChoice:
    """Both kernels of each pair on the same products: the choice for the loaded library."""
    from kunlun.engine.quant import int4_tiles, pack_int4

    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        every: dict[str, tuple[str, ...]] = dict.fromkeys(MEASURED_DTYPES, ("int4_matmul",))
        return NativeChoice(every, {}, "this torch has no int4pack kernel")
    generator = torch.Generator().manual_seed(0)
    ours, theirs = [], []
    for out_features, in_features in INT4_LAYER * INT4_LAYERS:
        q = torch.randint(
            0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator
        )
        scale = torch.rand(out_features, in_features // INT4_GROUP, generator=generator) / 100
        ours.append((in_features, *int4_tiles(pack_int4(q), scale, -8 * scale, INT4_GROUP)))
        pairs = torch.stack((scale.t(), torch.zeros_like(scale.t())), dim=-1)
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        theirs.append((in_features, packed, pairs.to(torch.bfloat16).contiguous()))
    chosen: dict[str, tuple[str, ...]] = {}
    figures: dict[str, dict[str, float]] = {}
    for dtype in MEASURED_DTYPES:  # the model's activations, as each kernel takes them
        xs = {k: torch.randn(1, k, generator=generator).to(getattr(torch, dtype))
              for k in {k for _, k in INT4_LAYER}}  # fmt: skip

        def own(xs: dict[int, torch.Tensor] = xs) -> None:
            for k, tiles, scale_min in ours:
                torch.ops.kunlun.int4_matmul(xs[k], tiles, scale_min, INT4_GROUP)

        def int4pack(xs: dict[int, torch.Tensor] = xs) -> None:
            for k, packed, pairs in theirs:
                torch._weight_int4pack_mm_for_cpu(
                    xs[k].to(torch.bfloat16), packed, INT4_GROUP, pairs
                )

        best = _best_of({"int4_matmul": own, "int4pack": int4pack})
        chosen[dtype] = ("int4_matmul",) if best["int4_matmul"] < best["int4pack"] else ()
        figures[dtype] = {k: round(v, 4) for k, v in best.items()}
    int8_up_to, int8_figures = _measure_int8(generator)
    detail = (f"the int4 and int8 products of {INT4_LAYERS} decoder layers (q/k/v, o, gate/up, "
              f"down; hidden size 576), int4 at one token, {torch.get_num_threads()} threads, "
              f"best of {ROUNDS}")  # fmt: skip
    return NativeChoice(chosen, figures, detail, int8_up_to, int8_figures)


def _measure_int8(generator: torch.Generator) -> tuple[int, dict[str, dict[str, float]]]:
    """Kunlun's int8 rows against torch's int8pack kernel (the library's ``int8_matmul``
    with ``rows_up_to`` past and below the token count) for each of :data:`INT8_TOKENS`: the
    counts up to which Kunlun's rows run (the last count before the first where int8pack was
    faster) and the figures."""
    weights = [
        (torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator),
         torch.rand(shape[0], generator=generator) / 100)
        for shape in INT4_LAYER * INT4_LAYERS
    ]  # fmt: skip
    figures: dict[str, dict[str, float]] = {}
    up_to, before = DEQUANTIZE_FROM_TOKENS - 1, 0
    for tokens in INT8_TOKENS:
        xs = {k: torch.randn(tokens, k, generator=generator) for k in {k for _, k in INT4_LAYER}}

        def products(rows_up_to: int, xs: dict[int, torch.Tensor] = xs) -> Callable[[], None]:
            def run() -> None:
                for weight, scale in weights:
                    torch.ops.kunlun.int8_matmul(xs[weight.shape[1]], weight, scale, rows_up_to)

            return run

        best = _best_of({"int8_rows": products(tokens), "int8pack": products(0)})
        figures[str(tokens)] = {k: round(v, 4) for k, v in best.items()}
        if best["int8pack"] < best["int8_rows"] and up_to == DEQUANTIZE_FROM_TOKENS - 1:
            up_to = before
        before = tokens
    return up_to, figures


def _best_of(runs: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Each run's best time in milliseconds over :data:`ROUNDS` rounds, the runs in turn."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(ROUNDS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best
