"""Decode steps replayed from CUDA graphs against the eager path, on a real NVIDIA GPU.

The demo model (float32 import, run in bfloat16 on ``cuda:0``), loaded twice: with the
decode graphs a plan captures (``graph_batch_sizes`` 1, 2, 4, 8, 16; :mod:`kunlun.engine.
graphs`) and on the reference path (every kernel launched from Python). Eight prompts,
greedy, 48 tokens each, once one at a time and once all together (so steps of 8 sequences,
padded to 8, and of fewer as they finish): every completion's tokens must be the same on
both. Prints each side's decode rate (one stream) and exits 0 when the tokens agree, 1 with
the first difference, 77 where there is no CUDA device (skipped).

Usage: ``python scripts/graph_smoke.py`` (``scripts/accelerator-smoke.sh`` runs it).
"""

from __future__ import annotations

import sys
import time

import torch

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "A list of three primary colours:",
    "def fibonacci(n):",
    "The largest planet in the solar system is",
    "Translate to French: good morning",
    "Once upon a time, in a small village,",
    "The square root of 144 is",
]


def main() -> int:
    if not torch.cuda.is_available():
        print("graph-smoke: no CUDA device here; skipped")
        return 77
    from kunlun.engine.gguf import demo_model_dir
    from kunlun.engine.llm import LLM
    from kunlun.engine.sampling_params import SamplingParams

    model_dir = demo_model_dir()
    common = {"device": "cuda:0", "dtype": torch.bfloat16, "max_num_seqs": 16,
              "max_model_len": 512}  # fmt: skip
    graphed = LLM(model_dir, graph_batch_sizes=(1, 2, 4, 8, 16), **common)
    eager = LLM(model_dir, decode_path="python", **common)
    status = graphed.engine.runner.decode_status
    print(f"graph-smoke: {status.path} ({status.reason})")
    if "captured as CUDAGraph" not in status.reason:
        print("graph-smoke: FAIL: the decode steps were not captured")
        return 1
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for llm in (graphed, eager):  # warm-up
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4))
    rates = {}
    for name, llm in (("graphs", graphed), ("eager", eager)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(PROMPTS[:1], greedy)
        torch.cuda.synchronize()
        rates[name] = 48 / (time.perf_counter() - start)
    for together in (False, True):
        batches = [PROMPTS] if together else [[p] for p in PROMPTS]
        for batch in batches:
            ours = graphed.generate(batch, greedy)
            theirs = eager.generate(batch, greedy)
            for prompt, a, b in zip(batch, ours, theirs, strict=True):
                if a.outputs[0].token_ids != b.outputs[0].token_ids:
                    print(
                        f"graph-smoke: FAIL: {prompt!r} ({'batch' if together else 'alone'}): "
                        f"graphs {a.outputs[0].text!r} against eager {b.outputs[0].text!r}"
                    )
                    return 1
    print(
        f"graph-smoke: PASS: {len(PROMPTS)} prompts alone and together, the same greedy "
        f"tokens; one stream {rates['graphs']:.1f} tok/s with graphs, "
        f"{rates['eager']:.1f} eager"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
