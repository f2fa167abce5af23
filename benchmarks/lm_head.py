"""The int8 LM head of a quantized model against its floating one; prints one JSON object.

One w8a16 engine on the demo model (fp32 activations), single-stream decode rate (tokens
after the first over the time after the first; 32-token prompt, 128 tokens), with the LM
head's int8 copy in use and set aside in turn, alternating, best of ``--repeats`` each.

Usage: ``python benchmarks/lm_head.py [--threads N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import Workload, make_engine, ours_decode  # noqa: E402
from kunlun.engine.gguf import demo_model_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = make_engine(demo_model_dir(), torch.float32, Workload(32, 128, 1, 1, (32, 32), (128, 128)),
                         "w8a16")  # fmt: skip
    head = engine.runner.model.lm_head
    int8 = head.int8
    assert int8 is not None, "this CPU has no int8pack kernel"
    prompt = list(range(100, 132))
    ours_decode(engine, prompt, 8)  # warm-up
    rates: dict[str, list[float]] = {"int8_head": [], "fp32_head": []}
    for _ in range(args.repeats):
        head.int8 = int8
        rates["int8_head"].append(ours_decode(engine, prompt, 128))
        head.int8 = None
        rates["fp32_head"].append(ours_decode(engine, prompt, 128))
    best = {k: max(v) for k, v in rates.items()}
    print(json.dumps({
        "int8_head_decode_tokens_per_s": round(best["int8_head"], 2),
        "fp32_head_decode_tokens_per_s": round(best["fp32_head"], 2),
        "int8_head_vs_fp32_head": round(best["int8_head"] / best["fp32_head"], 3),
        "threads": args.threads,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
