"""Does ``torch.compile`` speed up the embedded engine's decode on this machine? Prints JSON.

Same process, same weights (the demo model, fp32), same thread count: single-stream decode
and a 16-sequence decode batch, eager against the same model with ``torch.compile`` applied
(a) to each decoder layer's MLP and norms (the dense part; attention reads the paged cache
with data-dependent shapes and stays eager), and (b) with ``--whole`` to each whole decoder
layer (``dynamic=True``). The compile time of the first call is reported apart. Runs
alternate eager and compiled, best of ``--repeats``.

Usage: ``python benchmarks/compile.py [--threads 2] [--tokens 64] [--repeats 3] [--whole]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from kunlun.engine.gguf import demo_model_dir
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.sampling_params import SamplingParams


def decode_tokens_per_s(engine: LLMEngine, num_seqs: int, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request([100 + i, 200, 300, 400], params)
    engine.step()  # the prefill step is not timed
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return num_seqs * (tokens - 1) / (time.perf_counter() - start)


def compile_layers(engine: LLMEngine, whole: bool) -> float:
    """Wrap the layers' modules with ``torch.compile``; returns the seconds of the first call
    (the compilation), measured on a one-token decode step."""
    for layer in engine.runner.model.model.layers:
        if whole:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        else:
            layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=True)
            layer.input_layernorm.forward = torch.compile(
                layer.input_layernorm.forward, dynamic=True
            )
            layer.post_attention_layernorm.forward = torch.compile(
                layer.post_attention_layernorm.forward, dynamic=True
            )
    start = time.perf_counter()
    decode_tokens_per_s(engine, 1, 3)
    decode_tokens_per_s(engine, 16, 3)  # a second shape: dynamic compile settles
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--whole", action="store_true", help="compile whole decoder layers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = {"dtype": torch.float32, "max_model_len": 512, "num_blocks": 16 * 6,
                "max_num_seqs": 16}  # fmt: skip
    eager = LLMEngine.from_model(demo_model_dir(), **settings)
    compiled = LLMEngine.from_model(demo_model_dir(), **settings)
    decode_tokens_per_s(eager, 1, 4)  # warm-up
    compile_s = compile_layers(compiled, args.whole)
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, engine in (("eager", eager), ("compiled", compiled)):
            for num_seqs in (1, 16):
                key = f"{name}_{num_seqs}"
                value = decode_tokens_per_s(engine, num_seqs, args.tokens)
                best[key] = max(best.get(key, 0.0), value)
    print(json.dumps({
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "what": "whole decoder layers" if args.whole else "MLP and norms of each layer",
        "compile_s": round(compile_s, 1),
        "eager_single_tok_s": round(best["eager_1"], 2),
        "compiled_single_tok_s": round(best["compiled_1"], 2),
        "compiled_vs_eager_single": round(best["compiled_1"] / best["eager_1"], 3),
        "eager_16_tok_s": round(best["eager_16"], 2),
        "compiled_16_tok_s": round(best["compiled_16"], 2),
        "compiled_vs_eager_16": round(best["compiled_16"] / best["eager_16"], 3),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
