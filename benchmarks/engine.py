"""Embedded engine vs transformers ``generate`` on the demo model; prints one JSON object.

Same machine, same run, same weights (the demo GGUF imported to an HF directory, which both
sides load), same dtype and thread count; transformers uses ``attn_implementation="sdpa"``.
Both sides get a warm-up first. Prompts are random token ids (fixed seed), so content does
not matter and eos never stops a request early (ours: ``ignore_eos``; transformers:
``min_new_tokens``). Tokens/s count only the output tokens each request asked for.

- single stream: one request, 128 output tokens (32-token prompt), time to the last token;
  best of ``--repeats`` runs per side, ours and transformers alternating.
- concurrent: 64 requests, prompt lengths 32-512, output lengths 16-256; ours keeps 16 in
  flight (continuous batching: a new request enters as one finishes); transformers runs
  static batches of 16 over the same requests (left padding; each batch generates the
  longest output of its requests).

- tensor parallelism (fp32): ``tp2_vs_tp1_single`` and ``tp2_vs_tp1_concurrent16``, TP=2's
  tokens/s over TP=1's, two ranks over gloo sharing the same threads (half each).

- int8: our engine with int8 weights (``--int8-scheme``, w8a16 by default; fp32 activations)
  on the same workloads: ``int8_single_vs_fp32`` is its single stream over our fp32 single
  stream (best of ``--repeats``, the two alternating), ``int8_concurrent16_vs_hf_fp32`` its
  16-in-flight throughput over transformers' fp32 static batches of 16 (measured above).

- int4: ``int4_single_vs_llamacpp_q4`` is our decode rate on the demo GGUF imported as it
  ships (its 4-bit projections kept as w4a16, groups of 32; fp32 activations) over
  llama.cpp's (``llama-cpp-python``, the optional ``bench`` extra) on the same GGUF file,
  same thread count. Decode rate: tokens after the first over the time after the first
  (so neither side's prompt processing counts); exactly ``single_output_len`` greedy tokens
  on both sides (llama.cpp through ``Llama.generate``, which never stops on its own). Best
  of ``--repeats``, alternating. Skipped, saying so, when llama_cpp is not installed.
  ``int8_single_vs_llamacpp_q8`` likewise: our w8a16 (from the demo's float32 import, fp32
  activations) over llama.cpp on the demo's Q8_0 export of the same weights
  (:func:`kunlun.engines.gguf_export.export_q8_0`). ``--llamacpp-only`` runs these two alone.

Usage: ``python benchmarks/engine.py [--quick] [--threads N] [--no-bf16] [--hf-bf16-static]
[--int8-scheme w8a16|w8a8|none] [--no-tp] [--no-int4] [--llamacpp-only]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from kunlun.engine.engine_config import EngineConfig
from kunlun.engine.gguf import demo_model_dir
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class Workload:
    single_prompt_len: int
    single_output_len: int
    num_requests: int
    in_flight: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]

    def requests(self, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
        rng = random.Random(seed)
        out = []
        for _ in range(self.num_requests):
            prompt = [rng.randrange(100, vocab_size) for _ in range(rng.randint(*self.prompt_lens))]
            out.append((prompt, rng.randint(*self.output_lens)))
        return out


FULL = Workload(32, 128, 64, 16, (32, 512), (16, 256))
QUICK = Workload(32, 32, 8, 4, (32, 128), (8, 32))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


# ---- ours ----
def engine_config(
    model_dir: Path,
    dtype: torch.dtype,
    workload: Workload,
    quantization: str = "none",
    decode_path: str | None = None,
) -> EngineConfig:
    longest = workload.prompt_lens[1] + workload.output_lens[1]
    num_blocks = workload.in_flight * (-(-longest // 16) + 1)
    return EngineConfig(
        model_dir,
        dtype=dtype,
        max_model_len=max(longest, workload.single_prompt_len + workload.single_output_len),
        num_blocks=num_blocks,
        max_num_seqs=workload.in_flight,
        max_num_batched_tokens=512,
        quantization=quantization,
        decode_path=decode_path,
    )


def make_engine(
    model_dir: Path,
    dtype: torch.dtype,
    workload: Workload,
    quantization: str = "none",
    decode_path: str | None = None,
) -> LLMEngine:
    return LLMEngine(engine_config(model_dir, dtype, workload, quantization, decode_path))


def ours_single(engine: LLMEngine, prompt: list[int], num_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return num_tokens / (time.perf_counter() - start)


def ours_decode(engine: LLMEngine, prompt: list[int], num_tokens: int) -> float:
    """Decode tokens/s of one request: tokens after the first over the time after the first
    (the first step is the prefill, which produces the first token)."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    engine.add_request(prompt, params)
    engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (num_tokens - 1) / (time.perf_counter() - start)


def ours_concurrent(
    engine: LLMEngine, requests: list[tuple[list[int], int]], in_flight: int
) -> dict[str, float]:
    """Keep ``in_flight`` requests running; a new one enters as soon as one finishes."""
    pending = list(enumerate(requests))
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    lengths: dict[str, int] = {}

    def add() -> None:
        index, (prompt, num_tokens) = pending.pop(0)
        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        request_id = engine.add_request(prompt, params, request_id=f"r{index}")
        added[request_id] = time.perf_counter()
        lengths[request_id] = num_tokens

    start = time.perf_counter()
    for _ in range(min(in_flight, len(pending))):
        add()
    step_times = []
    while engine.has_unfinished():
        before = time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        step_times.append(now - before)
        for delta in deltas:
            first.setdefault(delta.request_id, now)
            if delta.final is not None:
                done[delta.request_id] = now
                if pending:
                    add()
    elapsed = time.perf_counter() - start
    ttft = [first[r] - added[r] for r in added]
    tpot = [(done[r] - first[r]) / (lengths[r] - 1) for r in added if lengths[r] > 1]
    return {
        "tokens_per_s": sum(lengths.values()) / elapsed,
        "elapsed_s": elapsed,
        "ttft_p50_ms": percentile(ttft, 50) * 1000,
        "ttft_p99_ms": percentile(ttft, 99) * 1000,
        "tpot_p50_ms": percentile(tpot, 50) * 1000,
        "num_steps": len(step_times),
        "step_p50_ms": percentile(step_times, 50) * 1000,
        "num_preemptions": engine.stats().num_preemptions,
    }


# ---- transformers ----
def hf_load(model_dir: Path, dtype: torch.dtype):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa"
    ).eval()


def hf_generate(model, prompts: list[list[int]], num_tokens: int, pad_id: int) -> None:  # noqa: ANN001
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )


def hf_single(model, prompt: list[int], num_tokens: int, pad_id: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    hf_generate(model, [prompt], num_tokens, pad_id)
    return num_tokens / (time.perf_counter() - start)


def hf_static(model, requests: list[tuple[list[int], int]], batch: int, pad_id: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        group = requests[i : i + batch]
        hf_generate(model, [p for p, _ in group], max(n for _, n in group), pad_id)
    return sum(n for _, n in requests) / (time.perf_counter() - start)


# ---- the run ----
def run_dtype(
    model_dir: Path, dtype: torch.dtype, workload: Workload, hf_static_batches: bool, repeats: int
) -> dict[str, float | dict[str, float]]:
    """Concurrent runs once per side; single stream ``repeats`` times, ours and theirs
    alternating, best of each (a shared machine's noise hits both sides alike)."""
    engine = make_engine(model_dir, dtype, workload)
    vocab = engine.runner.config.vocab_size
    pad_id = min(engine.tokenizer.eos_token_ids)
    requests = workload.requests(vocab)
    prompt = requests[0][0][: workload.single_prompt_len]
    tokens = workload.single_output_len
    ours_single(engine, prompt, 8)  # warm-up
    result: dict[str, float | dict[str, float]] = {}
    concurrent = ours_concurrent(engine, requests, workload.in_flight)
    result["concurrent"] = log(dtype, "concurrent", concurrent)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model = hf_load(model_dir, dtype)
    hf_single(model, prompt, 8, pad_id)  # warm-up
    if hf_static_batches:
        static = hf_static(model, requests, workload.in_flight, pad_id)
        result["hf_static"] = log(dtype, "hf_static", static)
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(log(dtype, "single", ours_single(engine, prompt, tokens)))
        theirs.append(log(dtype, "hf_single", hf_single(model, prompt, tokens, pad_id)))
    result["single"], result["hf_single"] = max(ours), max(theirs)
    return result


def run_int8(
    model_dir: Path, scheme: str, workload: Workload, repeats: int
) -> dict[str, float | dict[str, float]]:
    """Our engine with ``scheme`` int8 weights: concurrent once, single stream ``repeats``
    times alternating with a fresh fp32 engine (best of each)."""
    engine = make_engine(model_dir, torch.float32, workload, scheme)
    reference = make_engine(model_dir, torch.float32, workload)
    requests = workload.requests(engine.runner.config.vocab_size)
    prompt = requests[0][0][: workload.single_prompt_len]
    for warm in (engine, reference):
        ours_single(warm, prompt, 8)
    name = f"{scheme} concurrent"
    result: dict[str, float | dict[str, float]] = {
        "concurrent": log(
            torch.float32, name, ours_concurrent(engine, requests, workload.in_flight)
        )
    }
    quantized, floating = [], []
    for _ in range(repeats):
        tokens = workload.single_output_len
        quantized.append(
            log(torch.float32, f"{scheme} single", ours_single(engine, prompt, tokens))
        )
        floating.append(log(torch.float32, "single", ours_single(reference, prompt, tokens)))
    result["single"], result["fp32_single"] = max(quantized), max(floating)
    return result


def llamacpp_decode(llm, prompt: list[int], num_tokens: int) -> float:  # noqa: ANN001
    """llama.cpp's decode tokens/s, measured as :func:`ours_decode` does (greedy)."""
    start = 0.0
    for count, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True), start=1):
        if count == 1:
            start = time.perf_counter()
        if count == num_tokens:
            break
    return (num_tokens - 1) / (time.perf_counter() - start)


def against_llamacpp(
    engine: LLMEngine, gguf: Path, workload: Workload, repeats: int, ours_name: str
) -> tuple[list[float], list[float]]:
    """Decode rates of ``engine`` and of llama.cpp on ``gguf`` (same threads, same prompt),
    ``repeats`` of each, alternating after a warm-up of both."""
    import llama_cpp

    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=512,
        verbose=False,
    )  # fmt: skip
    prompt = workload.requests(engine.runner.config.vocab_size)[0][0][: workload.single_prompt_len]
    tokens = workload.single_output_len
    ours_decode(engine, prompt, 8)  # warm-up
    llamacpp_decode(llm, prompt, 8)
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(log(torch.float32, f"{ours_name} decode", ours_decode(engine, prompt, tokens)))
        theirs.append(log(torch.float32, f"llama.cpp {gguf.name} decode",
                          llamacpp_decode(llm, prompt, tokens)))  # fmt: skip
    return ours, theirs


def run_int4(workload: Workload, repeats: int) -> dict[str, object]:
    """``int4_single_vs_llamacpp_q4``: our decode rate on the demo GGUF imported with its 4-bit
    projections kept (w4a16) over llama.cpp's on the same file, same threads."""
    try:
        import llama_cpp
    except ImportError:
        return {"int4_skipped": "llama_cpp is not installed (pip install '.[bench]')"}
    from kunlun.engine.gguf import ImportOptions, demo_gguf_path, import_gguf
    from kunlun.paths import model_cache_dir

    gguf = demo_gguf_path()
    model_dir = import_gguf(gguf, model_cache_dir() / "smollm2-gguf-w4a16", ImportOptions())
    engine = make_engine(model_dir, torch.float32, workload)
    ours, theirs = against_llamacpp(engine, gguf, workload, repeats, "w4a16")
    spec = engine.runner.quant_spec
    from kunlun.engine.models.quant_linear import QuantLinear
    from kunlun.engine.native import recorded_choice

    record = recorded_choice()
    kernels = sorted(
        {m.kernel for m in engine.runner.model.modules() if isinstance(m, QuantLinear)}
    )
    return {
        "int4_decode_tokens_per_s": round(max(ours), 2),
        "llamacpp_q4_decode_tokens_per_s": round(max(theirs), 2),
        "int4_single_vs_llamacpp_q4": round(max(ours) / max(theirs), 3),
        "int4_detail": {
            "gguf": gguf.name,
            "ours": f"{spec.describe() if spec else 'floating'}, fp32 activations",
            "llama_cpp_python": llama_cpp.__version__,
            "int4_kernels": kernels,
            "kernel_choice": None if record is None else record.describe("float32"),
        },
    }


def run_q8(model_dir: Path, workload: Workload, repeats: int) -> dict[str, object]:
    """``int8_single_vs_llamacpp_q8``: our decode rate with w8a16 weights (from the demo's
    float32 import; fp32 activations) over llama.cpp's on the demo's Q8_0 export of the same
    weights, same threads."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {"int8_llamacpp_skipped": "llama_cpp is not installed (pip install '.[bench]')"}
    from kunlun.engine.gguf import demo_gguf_path
    from kunlun.engines.gguf_export import export_q8_0
    from kunlun.paths import model_cache_dir

    gguf = model_cache_dir() / "smollm2-q8_0.gguf"
    export_q8_0(demo_gguf_path(), gguf)
    engine = make_engine(model_dir, torch.float32, workload, "w8a16")
    ours, theirs = against_llamacpp(engine, gguf, workload, repeats, "w8a16")
    return {
        "int8_decode_tokens_per_s": round(max(ours), 2),
        "llamacpp_q8_decode_tokens_per_s": round(max(theirs), 2),
        "int8_single_vs_llamacpp_q8": round(max(ours) / max(theirs), 3),
    }


def profile_decode(engine: LLMEngine, prompt: list[int], num_tokens: int) -> dict[str, object]:
    """Where one request's decode steps spend their time, by the engine's step profiler
    (:class:`~kunlun.engine.outputs.DecodeTime`: the compiled step, the reference path's
    forward, the engine's Python), as shares of the decode steps' wall time."""
    before = engine.stats().decode
    rate = ours_decode(engine, prompt, num_tokens)
    after = engine.stats().decode
    wall = after.wall_s - before.wall_s
    parts = {part: getattr(after, f"{part}_s") - getattr(before, f"{part}_s")
             for part in ("compiled", "model", "engine")}  # fmt: skip
    return {
        "path": after.path,
        "decode_tokens_per_s": round(rate, 2),
        "step_ms": round(wall / (after.steps - before.steps) * 1000, 2),
        "share": {part: round(value / wall, 3) for part, value in parts.items()},
        "python_share": round(parts["engine"] / wall, 3) if after.path == "compiled" else None,
        "compiled_ms": round(parts["compiled"] / (after.steps - before.steps) * 1000, 2),
    }


def run_profile(workload: Workload) -> dict[str, object]:
    """``decode_profile``: the demo GGUF imported as w4a16, one request's decode on the
    compiled path and on the reference path (``compiled_vs_python_decode``: the rate ratio),
    and w8a16 with 16 in flight on both (``compiled_vs_python_w8a16_concurrent16``).
    The reference path's Python share is estimated as the part of its step beyond the
    compiled step (which runs the same kernels with no Python)."""
    from kunlun.engine.gguf import ImportOptions, demo_gguf_path, import_gguf
    from kunlun.paths import model_cache_dir

    model_dir = import_gguf(
        demo_gguf_path(), model_cache_dir() / "smollm2-gguf-w4a16", ImportOptions()
    )
    result: dict[str, object] = {}
    for path in ("python", "compiled"):
        engine = make_engine(model_dir, torch.float32, workload, decode_path=path)
        prompt = workload.requests(engine.runner.config.vocab_size)[0][0]
        ours_decode(engine, prompt[: workload.single_prompt_len], 8)  # warm-up
        result[path] = log(torch.float32, f"decode profile, {path} path", profile_decode(
            engine, prompt[: workload.single_prompt_len], workload.single_output_len))  # fmt: skip
    python, compiled = result["python"], result["compiled"]
    assert isinstance(python, dict) and isinstance(compiled, dict)
    result["compiled_vs_python_decode"] = round(
        compiled["decode_tokens_per_s"] / python["decode_tokens_per_s"], 3
    )
    # the reference step's Python: what it takes beyond the compiled step's kernels
    python["python_share_estimated"] = round(1 - compiled["compiled_ms"] / python["step_ms"], 3)
    # 16 in flight (decode steps of up to 16 rows, prefill chunks between) on both paths
    concurrent = {}
    for path in ("python", "compiled"):
        engine = make_engine(demo_model_dir(), torch.float32, workload, "w8a16", path)
        requests = workload.requests(engine.runner.config.vocab_size)
        concurrent[path] = round(
            ours_concurrent(engine, requests, workload.in_flight)["tokens_per_s"], 2
        )
        log(torch.float32, f"w8a16 concurrent, {path} path", concurrent[path])
    result["w8a16_concurrent_tokens_per_s"] = concurrent
    result["compiled_vs_python_w8a16_concurrent16"] = round(
        concurrent["compiled"] / concurrent["python"], 3
    )
    return {"decode_profile": result}


def log(dtype: torch.dtype, name: str, value: T) -> T:
    """Report a partial result on stderr as soon as it is known (long runs)."""
    print(f"[{time.strftime('%X')}] {dtype} {name}: {value}", file=sys.stderr, flush=True)
    return value


# ---- tensor parallelism: TP=2 over gloo against TP=1, same threads in total ----
def run_tp(model_dir: Path, workload: Workload, repeats: int) -> dict[str, object]:
    """``tp2_vs_tp1_single`` and ``tp2_vs_tp1_concurrent16`` in fp32: the ratio of TP=2's
    tokens/s to TP=1's, single stream (best of ``repeats``) and with ``in_flight`` requests.
    The two ranks split the threads TP=1 uses (``num_threads // 2`` each)."""
    threads = torch.get_num_threads()
    rates: dict[int, dict[str, float]] = {}
    for tp in (1, 2):
        config = engine_config(model_dir, torch.float32, workload)
        config.tensor_parallel_size = tp
        config.distributed_backend = "gloo" if tp > 1 else None
        config.num_threads = threads
        engine = LLMEngine(config)
        try:
            requests = workload.requests(engine.runner.config.vocab_size)
            prompt = requests[0][0][: workload.single_prompt_len]
            ours_single(engine, prompt, 8)  # warm-up
            single = max(
                ours_single(engine, prompt, workload.single_output_len) for _ in range(repeats)
            )
            concurrent = ours_concurrent(engine, requests, workload.in_flight)["tokens_per_s"]
        finally:
            engine.close()
        rates[tp] = log(torch.float32, f"tp{tp}", {"single": single, "concurrent": concurrent})
    return {
        "tp2_vs_tp1_single": round(rates[2]["single"] / rates[1]["single"], 3),
        "tp2_vs_tp1_concurrent16": round(rates[2]["concurrent"] / rates[1]["concurrent"], 3),
        "tp_detail": {
            f"tp{tp}_{k}_tokens_per_s": round(v, 2) for tp, r in rates.items() for k, v in r.items()
        },
    }


def cpu_facts() -> dict[str, object]:
    """This CPU as the cpu device plugin sees it: model name, native bf16 and int8 units."""
    from kunlun.device.inventory import build_inventory

    profile = build_inventory().get("cpu:0")
    if profile is None:
        return {}
    attributes = profile.get("attributes") or {}
    return {
        "name": profile.get("name"),
        **{k: attributes.get(k) for k in ("bf16_native", "int8_native")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 runs")
    parser.add_argument(
        "--hf-bf16-static",
        action="store_true",
        help="also run transformers' static batches in bf16 (slow on CPUs without bf16 units)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="single-stream runs per side")
    parser.add_argument("--no-tp", action="store_true", help="skip the TP=2 vs TP=1 runs")
    parser.add_argument("--no-int4", action="store_true", help="skip int4 against llama.cpp")
    parser.add_argument(
        "--llamacpp-only",
        action="store_true",
        help="only the comparisons with llama.cpp (int4 on the Q4_1 file, int8 on its Q8_0 export)",
    )
    parser.add_argument(
        "--int8-scheme",
        choices=("w8a16", "w8a8", "none"),
        default="w8a16",
        help="the int8 scheme of the int8 keys (none: skip them)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = QUICK if args.quick else FULL
    threads = torch.get_num_threads()  # before TP: rank 0 of a group lowers it for itself
    model_dir = demo_model_dir()
    load_before = os.getloadavg()
    if args.llamacpp_only:
        only: dict[str, object] = {**run_int4(workload, args.repeats),
                                   **run_q8(model_dir, workload, args.repeats),
                                   **run_profile(workload)}  # fmt: skip
        only["setup"] = {"threads": threads, "cpu": cpu_facts(), "workload": workload.__dict__,
                           "load_average_before": [round(x, 2) for x in load_before],
                           "load_average_after": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
        json.dump(only, sys.stdout, indent=2)
        print()
        return
    fp32 = run_dtype(model_dir, torch.float32, workload, True, args.repeats)
    ours32 = fp32["concurrent"]
    assert isinstance(ours32, dict)
    report: dict[str, object] = {
        "single_stream_tokens_per_s": round(float(fp32["single"]), 2),  # type: ignore[arg-type]
        "hf_single_stream_tokens_per_s": round(float(fp32["hf_single"]), 2),  # type: ignore[arg-type]
        "single_stream_speedup": round(float(fp32["single"]) / float(fp32["hf_single"]), 3),  # type: ignore[arg-type]
        "concurrent_tokens_per_s": round(ours32["tokens_per_s"], 2),
        "hf_static_batch_tokens_per_s": round(float(fp32["hf_static"]), 2),  # type: ignore[arg-type]
        "concurrent_speedup": round(ours32["tokens_per_s"] / float(fp32["hf_static"]), 3),  # type: ignore[arg-type]
        "ttft_p50_ms": round(ours32["ttft_p50_ms"], 1),
        "ttft_p99_ms": round(ours32["ttft_p99_ms"], 1),
        "tpot_p50_ms": round(ours32["tpot_p50_ms"], 2),
        "peak_rss_mb": round(float(fp32["peak_rss_mb"]), 1),  # type: ignore[arg-type]
        "concurrent_detail": {k: round(v, 2) for k, v in ours32.items()},
    }
    if args.int8_scheme != "none":
        int8 = run_int8(model_dir, args.int8_scheme, workload, args.repeats)
        ours8 = int8["concurrent"]
        assert isinstance(ours8, dict)
        single8, single32 = float(int8["single"]), float(int8["fp32_single"])  # type: ignore[arg-type]
        report["int8_scheme"] = args.int8_scheme
        report["int8_single_stream_tokens_per_s"] = round(single8, 2)
        report["int8_single_vs_fp32"] = round(single8 / single32, 3)
        report["int8_concurrent_tokens_per_s"] = round(ours8["tokens_per_s"], 2)
        report["int8_concurrent16_vs_hf_fp32"] = round(
            ours8["tokens_per_s"] / float(fp32["hf_static"]),  # type: ignore[arg-type]
            3,
        )
    if not args.no_int4:
        report.update(run_int4(workload, args.repeats))
        report.update(run_q8(model_dir, workload, args.repeats))
    report.update(run_profile(workload))
    if not args.no_bf16:
        bf16 = run_dtype(model_dir, torch.bfloat16, workload, args.hf_bf16_static, args.repeats)
        ours16 = bf16["concurrent"]
        assert isinstance(ours16, dict)
        report["bf16_single_stream_tokens_per_s"] = round(float(bf16["single"]), 2)  # type: ignore[arg-type]
        report["bf16_concurrent_tokens_per_s"] = round(ours16["tokens_per_s"], 2)
        report["hf_bf16_single_stream_tokens_per_s"] = round(float(bf16["hf_single"]), 2)  # type: ignore[arg-type]
        if "hf_static" in bf16:
            report["hf_bf16_static_batch_tokens_per_s"] = round(float(bf16["hf_static"]), 2)  # type: ignore[arg-type]
    if not args.no_tp:
        report.update(run_tp(model_dir, workload, args.repeats))
    import transformers

    report["setup"] = {
        "model": "SmolLM2-135M-Instruct (demo GGUF imported to HF safetensors)",
        "device": "cpu",
        "threads": threads,
        "dtype": "float32 (bf16 figures: bfloat16 on both sides)",
        "attention": "ours: kunlun paged attention; transformers: sdpa",
        "prompts": "random token ids, seed 0",
        "workload": workload.__dict__,
        "max_num_batched_tokens": 512,
        "single_stream_repeats": args.repeats,
        "quick": args.quick,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "cpu_count": os.cpu_count(),
        "cpu": cpu_facts(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
