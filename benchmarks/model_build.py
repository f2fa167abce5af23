"""How long a model's empty tensors take to get their storage: ``kunlun.engine.models.materialize``
against torch's stock ``to_empty`` then ``to(dtype)``; prints one JSON object.

A worker builds its model on the meta device and gives every tensor storage before the
weights are read into it. The stock way allocates float32 tensors and then casts them to
the served dtype: a pass over memory that the weights overwrite anyway, and ``to_empty``
imports torch's symbolic-shape machinery (sympy) on the way. Each way runs in a fresh
process (``import torch`` is paid before the clock starts), interleaved for ``--rounds``
rounds, for the demo model's shape (135M, its own ``config.json``) and a 1.1B Llama shape
(TinyLlama's), in
``--dtype`` (bf16: the dtype a GPU and an AVX-512 BF16 CPU serve). No weights are read,
and none are needed: only the shape counts.

Usage: ``python benchmarks/model_build.py [--rounds 3] [--dtype bf16]`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
    "num_key_value_heads": 4, "vocab_size": 32000,
}  # fmt: skip
"""TinyLlama's shape: a 1.1B Llama, built from its shape alone (no weights are read)."""


def demo_config() -> dict[str, object]:
    """The demo model's ``config.json``, from its import (made once per machine)."""
    from kunlun.engine.gguf import ImportOptions, demo_gguf_path, import_gguf
    from kunlun.paths import model_cache_dir

    model_dir = import_gguf(demo_gguf_path(), model_cache_dir() / "smollm2-gguf-w4a16",
                            ImportOptions())  # fmt: skip
    return dict(json.loads((model_dir / "config.json").read_text()))


CHILD = """
import json, resource, sys, time
import torch
from kunlun.engine.config import ModelConfig
from kunlun.engine.models import build_model, materialize
way, raw, dtype = sys.argv[1], json.loads(sys.argv[2]), getattr(torch, sys.argv[3])
config = ModelConfig.from_dict(raw)
cpu, wall = time.process_time(), time.perf_counter()
with torch.device("meta"):
    model = build_model(config, 2048)
if way == "stock":
    model.to_empty(device=torch.device("cpu"))
    model.to(dtype)
else:
    materialize(model, torch.device("cpu"), dtype)
print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
                  "sympy_imported": "sympy" in sys.modules}))
"""
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def one(way: str, config: dict[str, object], dtype: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, way, json.dumps(config), DTYPES[dtype]],
                          capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
    return dict(json.loads(done.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    result: dict[str, object] = {"dtype": args.dtype, "rounds": args.rounds}
    for name, config in {"smollm2-135m": demo_config(), "llama-1.1b": LLAMA_1B}.items():
        runs: dict[str, list[dict[str, float]]] = {"stock": [], "materialize": []}
        for _ in range(args.rounds):
            for way in runs:
                runs[way].append(one(way, config, args.dtype))
        figures = {way: {key: round(statistics.median(r[key] for r in rs), 3)
                         for key in ("cpu_s", "wall_s")} for way, rs in runs.items()}  # fmt: skip
        for way, rs in runs.items():
            figures[way]["sympy_imported"] = any(r["sympy_imported"] for r in rs)
        stock, ours = figures["stock"]["wall_s"], figures["materialize"]["wall_s"]
        figures["stock_over_materialize_wall"] = round(stock / max(ours, 1e-6), 1)
        result[name] = figures
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
