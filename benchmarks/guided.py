"""What guided decoding's token mask costs per decode step; prints one JSON object.

The embedded engine on the demo model (fp32, this machine's CPU) runs 16 concurrent greedy
requests of the same prompts, each making ``--tokens`` tokens, in two forms, alternated
``--repeats`` times in one process:

- ``free``: no constraint (``ignore_eos``, so every request makes all its tokens);
- ``guided``: each constrained by a regex of letters and spaces longer than ``--tokens``
  tokens can spell (``[a-z ]{20N}``), so the grammar never ends a request early and the two
  forms make the same number of steps of the same batch size.

Per form: the median over repeats of the mean wall time of a decode step (every request of
the batch decoding), and for the guided form the time inside the mask (computing the
batch's masks in one llguidance call and applying them), measured around
:meth:`GuidedDecoding.mask`. The figure to read is ``added_ms_per_step`` and its ratio to the
free step.

Usage: ``python benchmarks/guided.py [--concurrency 16] [--tokens 48] [--repeats 3]`` from the
repository root; writes ``benchmarks/results/guided-DATE.json`` too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kunlun import __version__  # noqa: E402
from kunlun.engine.gguf import demo_model_dir  # noqa: E402
from kunlun.engine.guided import Guide, GuidedDecoding  # noqa: E402
from kunlun.engine.llm_engine import LLMEngine  # noqa: E402
from kunlun.engine.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["Tell me a story about a dragon.", "Describe the sea.", "What is a CPU?",
           "Write about autumn."]  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args()


class TimedMask:
    """Wraps :meth:`GuidedDecoding.mask` to add up the time spent in it."""

    def __init__(self, guided: GuidedDecoding) -> None:
        self.inner = guided.mask
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, scores: torch.Tensor, matchers: list[tuple[Any, int]]) -> None:
        started = time.perf_counter()
        self.inner(scores, matchers)
        self.seconds += time.perf_counter() - started
        self.calls += 1


def run(engine: LLMEngine, args: argparse.Namespace, guided: bool) -> dict[str, float]:
    letters = 20 * args.tokens  # more than the tokens can spell: the grammar never completes
    guide = Guide("regex", f"[a-z ]{{{letters}}}", "bench") if guided else None
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=not guided,
                            guide=guide)  # fmt: skip
    for i in range(args.concurrency):
        engine.add_request(PROMPTS[i % len(PROMPTS)], params)
    timer = TimedMask(engine.guided)
    engine.guided.mask = timer  # type: ignore[method-assign]
    decode: list[float] = []
    made = 0
    try:
        while engine.has_unfinished():
            started = time.perf_counter()
            deltas = engine.step()
            elapsed = time.perf_counter() - started
            made += sum(len(d.token_ids) for d in deltas)
            if len(deltas) == args.concurrency and all(len(d.token_ids) == 1 for d in deltas):
                decode.append(elapsed)
    finally:
        engine.guided.mask = timer.inner  # type: ignore[method-assign]
    return {
        "decode_steps": len(decode),
        "step_ms": statistics.fmean(decode[1:]) * 1e3,  # the first may include a prefill tail
        "mask_ms_per_step": timer.seconds / max(1, timer.calls) * 1e3,
        "tokens": made,
    }


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine.from_model(demo_model_dir(), max_model_len=512,
                                  max_num_seqs=args.concurrency)  # fmt: skip
    run(engine, argparse.Namespace(**{**vars(args), "concurrency": 2, "tokens": 4}), True)
    runs: dict[str, list[dict[str, float]]] = {"free": [], "guided": []}
    for _ in range(args.repeats):  # alternated: both forms see the same machine
        runs["free"].append(run(engine, args, False))
        runs["guided"].append(run(engine, args, True))
    free = statistics.median(r["step_ms"] for r in runs["free"])
    guided = statistics.median(r["step_ms"] for r in runs["guided"])
    mask = statistics.median(r["mask_ms_per_step"] for r in runs["guided"])
    result = {
        "benchmark": "guided",
        "date": datetime.date.today().isoformat(),
        "kunlun": __version__,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
        },  # fmt: skip
        "settings": {
            "concurrency": args.concurrency,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "model": "smollm2 fp32",
        },  # fmt: skip
        "free_step_ms": round(free, 2),
        "guided_step_ms": round(guided, 2),
        "added_ms_per_step": round(guided - free, 2),
        "guided_over_free": round(guided / free, 3),
        "mask_ms_per_step": round(mask, 2),
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    out = args.output or ROOT / "benchmarks" / "results" / f"guided-{result['date']}.json"
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
