"""The four built-in engines: Kunlun's own, llama.cpp's ``llama-server``, vLLM and SGLang.

Each adapter reads its rows of :mod:`kunlun.engines.table`; none starts anything: the node
agent starts every replica from its adapter's command
(:func:`kunlun.engines.registry.engine_command`). The embedded engine's argv is the worker's
(:func:`kunlun.engine.launch.worker_command`, its one spelling), reading the launch file the
agent writes.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kunlun.device.registry import known_device_types, load_plugins
from kunlun.engine.gguf_source import kept_quantization
from kunlun.engine.launch import EMBEDDED_ENGINE, worker_command
from kunlun.engines.adapter import (
    Availability,
    EngineAdapter,
    EngineCommand,
    LaunchContext,
    ModelFormat,
    binary_available,
    lacks,
    module_available,
)
from kunlun.engines.table import ALL_LAYERS, QUANTIZATION_GAP, VendorRow
from kunlun.planner.plan import ExecutionPlan
from kunlun.protocol.fields import asks_nothing


@functools.cache
def distribution_version(name: str) -> str | None:
    """The installed version of Python distribution ``name``, once per process (every
    placement records it); None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


class ExternalEngine(EngineAdapter):
    """An external engine: its device types and requirements are its rows (``vendors``: one
    :class:`VendorRow` per Kunlun device type), its spelling of Kunlun's dtypes
    ``dtype_flags``, and of quantization schemes ``quantization_flags`` (None: no flag)."""

    formats: tuple[ModelFormat, ...] = ("hf",)
    vendors: Mapping[str, VendorRow] = MappingProxyType({})
    dtype_flags: Mapping[str, str] = MappingProxyType({})
    quantization_flags: Mapping[str, str | None] = MappingProxyType({})
    key_env: str | None = None
    """Where its server takes a key it asks of every request (:attr:`EngineCommand.key_env`);
    set only where that was run against the real server (llama.cpp)."""

    def row(self, device_type: str) -> VendorRow | None:
        """This engine's row for ``device_type``, or None."""
        return self.vendors.get(device_type)

    @property
    def device_types(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self.vendors)

    def installed(self, device_type: str | None = None) -> Availability:
        rows = [self.row(device_type)] if device_type else list(self.vendors.values())
        needed = dict.fromkeys(r for vendor in rows if vendor for r in vendor.requires)
        if not needed:
            return Availability(False, f"{self.name} has no build for {device_type} devices")
        if device_type and (vendor := rows[0]) and vendor.needs_torch_extension:
            plugin = load_plugins().plugins.get(device_type)
            if plugin is not None and plugin.torch_module:
                needed[plugin.torch_module] = None
        found = [self.probe(r) for r in needed]
        missing = [a.reason for a in found if not a]
        if missing:
            return Availability(False, "; ".join(missing))
        return Availability(True, "; ".join(a.reason for a in found))

    distribution: str | None = None
    """The Python distribution whose version is the engine's (vLLM, SGLang); None: the
    version is what :attr:`version_command` prints."""

    def version(self) -> str | None:
        if self.distribution is None:
            return super().version()
        return distribution_version(self.distribution)

    def probe(self, requirement: str) -> Availability:
        return module_available(requirement)

    def vendor(self, plan: ExecutionPlan) -> VendorRow:
        found = self.row(plan.device_type)
        if found is None:
            raise self.refuse("device_type", plan.device_type,
                              f"runs on {', '.join(self.device_types)}")  # fmt: skip
        if plan.dtype not in found.dtypes:
            raise self.refuse("dtype", plan.dtype, f"its {plan.device_type} build computes in "
                                                   f"{', '.join(found.dtypes)}")  # fmt: skip
        return found

    def quantization_flag(self, plan: ExecutionPlan) -> list[str]:
        table = self.quantization_flags
        if plan.quantization not in table:
            why = QUANTIZATION_GAP.format(scheme=plan.quantization, engine=self.name)
            raise self.refuse("quantization", plan.quantization, why)
        value = table[plan.quantization]
        return [] if value is None else ["--quantization", value]

    def environment(self, plan: ExecutionPlan, vendor: VendorRow) -> dict[str, str]:
        return {**plan.env, **vendor.env}

    def finish(
        self, plan: ExecutionPlan, context: LaunchContext, argv: list[str], vendor: VendorRow
    ) -> EngineCommand:
        return EngineCommand(
            engine=self.name,
            argv=argv,
            env=self.environment(plan, vendor),
            host=context.host,
            port=context.port,
            ready_path="/health",
            metrics_path="/metrics",
            stats_path="/metrics" if self.progress_metrics else "/health",
            log_file=context.log_file,
            key_env=self.key_env,
            stop_signal=signal.SIGTERM,
            stop_grace_s=30.0,
            notes=[vendor.note] if vendor.note else [],
        )


class VllmEngine(ExternalEngine):
    """vLLM's OpenAI-compatible server (``vllm.entrypoints.openai.api_server``)."""

    name = "vllm"
    distribution = "vllm"
    vendors = MappingProxyType(
        {
            "nvidia": VendorRow(requires=("vllm",)),
            # ROCm and Hygon DTK builds of vLLM: same module, HIP visibility from the plan
            "amd": VendorRow(requires=("vllm",)),
            "hygon": VendorRow(requires=("vllm",), note="vLLM built against Hygon DTK"),
            # the vllm-ascend platform plugin; its guide asks for spawned workers on NPUs
            "ascend": VendorRow(
                requires=("vllm", "vllm_ascend"),
                env={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
                dtypes=("bf16", "fp16"),
            ),
            # Cambricon's vllm-mlu
            "cambricon": VendorRow(requires=("vllm", "vllm_mlu"), dtypes=("bf16", "fp16")),
        }
    )
    dtype_flags = MappingProxyType({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"})
    quantization_flags = MappingProxyType({"none": None})

    def command(self, plan: ExecutionPlan, context: LaunchContext) -> EngineCommand:
        vendor = self.vendor(plan)
        argv = [
            "python", "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(context.model_path),
            "--served-model-name", context.served_name,
            "--host", context.host,
            "--port", str(context.port),
            "--tensor-parallel-size", str(plan.tensor_parallel_size),
            "--dtype", self.dtype_flags[plan.dtype],
            *self.quantization_flag(plan),
            "--max-model-len", str(plan.max_model_len),
            "--max-num-seqs", str(plan.max_num_seqs),
            *(["--max-num-batched-tokens", str(plan.max_num_batched_tokens)]
              if plan.max_num_batched_tokens else []),
            "--gpu-memory-utilization", f"{plan.memory['utilization']:g}",
        ]  # fmt: skip
        return self.finish(plan, context, argv, vendor)


class SglangEngine(ExternalEngine):
    """SGLang's server (``sglang.launch_server``)."""

    name = "sglang"
    distribution = "sglang"
    vendors = MappingProxyType(
        {
            "nvidia": VendorRow(requires=("sglang",), device_flag="cuda"),
            "amd": VendorRow(requires=("sglang",), device_flag="cuda", attention_backend="triton"),
            "hygon": VendorRow(
                requires=("sglang",),
                device_flag="cuda",
                attention_backend="triton",
                note="SGLang built against Hygon DTK",
            ),
            # SGLang's Ascend support: float16 and bfloat16 only
            "ascend": VendorRow(
                requires=("sglang",),
                needs_torch_extension=True,
                device_flag="npu",
                attention_backend="ascend",
                dtypes=("bf16", "fp16"),
            ),
            "cambricon": VendorRow(
                requires=("sglang",),
                needs_torch_extension=True,
                device_flag="mlu",
                dtypes=("bf16", "fp16"),
                note="Cambricon's SGLang build; upstream --device has no mlu",
            ),
        }
    )
    dtype_flags = MappingProxyType({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"})
    quantization_flags = MappingProxyType({"none": None})

    def command(self, plan: ExecutionPlan, context: LaunchContext) -> EngineCommand:
        vendor = self.vendor(plan)
        argv = [
            "python", "-m", "sglang.launch_server",
            "--model-path", str(context.model_path),
            "--served-model-name", context.served_name,
            "--host", context.host,
            "--port", str(context.port),
            "--tp-size", str(plan.tensor_parallel_size),
            "--dtype", self.dtype_flags[plan.dtype],
            *self.quantization_flag(plan),
            "--context-length", str(plan.max_model_len),
            "--max-running-requests", str(plan.max_num_seqs),
            *(["--chunked-prefill-size", str(plan.max_num_batched_tokens)]
              if plan.max_num_batched_tokens else []),
            "--mem-fraction-static", f"{plan.memory['utilization']:g}",
            *(["--device", vendor.device_flag] if vendor.device_flag else []),
            *(["--attention-backend", vendor.attention_backend]
              if vendor.attention_backend else []),
            "--enable-metrics",
        ]  # fmt: skip
        return self.finish(plan, context, argv, vendor)


class LlamaCppEngine(ExternalEngine):
    """llama.cpp's ``llama-server``: one GGUF file, continuous batching over parallel slots."""

    name = "llama.cpp"
    key_env = "LLAMA_API_KEY"
    version_command = ("llama-server", "--version")
    vendors = MappingProxyType(
        {
            "cpu": VendorRow(requires=("llama-server",)),
            "nvidia": VendorRow(requires=("llama-server",), offload_all_layers=True),
            "amd": VendorRow(requires=("llama-server",), offload_all_layers=True),
        }
    )
    dtype_flags = MappingProxyType({"bf16": "bf16", "fp16": "f16", "fp32": "f32"})
    formats = ("gguf",)
    progress_metrics = {  # noqa: RUF012 - read only
        "num_steps": ("llamacpp:n_decode_total",),
        "num_unfinished_requests": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    }

    def request_body(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        return _llama_cpp_body(payload)

    def prepare_model(
        self, plan: ExecutionPlan, path: Path, model_dir: Path, plan_dir: Path
    ) -> tuple[Path, list[str]]:
        """``quantization: none``: an unquantized GGUF in the plan's dtype
        (:mod:`kunlun.engines.gguf_export`), so llama.cpp computes what the plan says. A
        plan quantized as the model's own checkpoint (a GGUF imported with its 4-bit blocks
        kept, served as w4a16) runs the GGUF file itself: llama.cpp's own block types,
        activations quantized to 8 bits inside its dot products. Any other quantization is
        Kunlun's own and refused by name."""
        if plan.quantization == "none":
            out = plan_dir / f"llama-cpp-{plan.dtype}.gguf"
            return out, [sys.executable, "-m", "kunlun.engines.gguf_export", "--source",
                         str(path), "--out", str(out), "--dtype", plan.dtype, "--"]  # fmt: skip
        if plan.quantization == kept_quantization(model_dir):
            return path, []
        raise self.refuse("quantization", plan.quantization,
                          "llama.cpp computes a GGUF file's own types; serve the model "
                          "unquantized (quantization: none) or imported with its 4-bit "
                          "blocks kept")  # fmt: skip

    def probe(self, requirement: str) -> Availability:
        found = binary_available(requirement)
        if found or not module_available("llama_cpp"):
            return found
        return Availability(False, f"{found.reason} (the llama_cpp module is importable, but "
                                   "serving through it is not built yet)")  # fmt: skip

    def command(self, plan: ExecutionPlan, context: LaunchContext) -> EngineCommand:
        vendor = self.vendor(plan)
        if plan.tensor_parallel_size > 1 and not vendor.offload_all_layers:
            raise self.refuse("tensor_parallel_size", plan.tensor_parallel_size,
                              f"llama-server runs one process on {plan.device_type}; "
                              "it splits a model only across GPUs")  # fmt: skip
        threads = context.num_threads or plan.engine_options.get("num_threads")
        kv_type = self.dtype_flags[plan.dtype]
        argv = [
            "llama-server",
            "--model", str(context.model_path),
            "--alias", context.served_name,
            "--host", context.host,
            "--port", str(context.port),
            # each slot its own context of max_model_len, as many slots as the plan's KV
            # memory holds (llama.cpp's unified KV would fit more, but where a sequence's
            # cells land changes its numbers: a seed no longer gives the same text)
            "--ctx-size", str(slots(plan) * plan.max_model_len),
            "--parallel", str(slots(plan)),
            # a thread for each request the gateway may send (max_num_seqs, more than the
            # slots when the KV holds fewer) and two for health probes and metrics: by
            # default llama-server has slots + 2, and with fewer slots than requests in flight
            # its /health went unanswered and the health checks took the replica out
            "--threads-http", str(plan.max_num_seqs + 2),
            "--cont-batching",
            "--n-gpu-layers", str(ALL_LAYERS if vendor.offload_all_layers else 0),
            *(["--split-mode", "row"] if plan.tensor_parallel_size > 1 else []),
            *(["--threads", str(threads)] if threads else []),
            *(["--batch-size", str(plan.max_num_batched_tokens)]
              if plan.max_num_batched_tokens else []),
            "--cache-type-k", kv_type,
            "--cache-type-v", kv_type,
            "--metrics",
        ]  # fmt: skip
        command = self.finish(plan, context, argv, vendor)
        if plan.quantization != "none":
            command.notes.append(f"quantization {plan.quantization}: the GGUF file's own types")
        if not threads:
            command.notes.append("threads: llama-server's default (every core)")
        if slots(plan) < plan.max_num_seqs:
            command.notes.append(
                f"slots: {slots(plan)} of max_model_len {plan.max_model_len} (the plan's KV "
                f"holds {plan.num_kv_blocks * plan.block_size} tokens; max_num_seqs "
                f"{plan.max_num_seqs} counts on paged KV): more requests wait in llama-server"
            )
        return command


def slots(plan: ExecutionPlan) -> int:
    """llama-server's slots for ``plan``: ``max_num_seqs``, or fewer where the plan's KV
    (its blocks times their size, in tokens) cannot hold that many whole contexts of
    ``max_model_len`` (at least one). With the defaults on a 2-core CPU the plan holds 22
    sequences of the paged engine's average length, and 2 contexts of 8,192 tokens."""
    whole = plan.num_kv_blocks * plan.block_size // plan.max_model_len
    return max(1, min(plan.max_num_seqs, whole))


LLAMA_CPP_LACKS: dict[str, str] = {
    "n": "more than one choice per request",
    "echo": "the prompt echoed back",
    "guided_regex": "output held to a regular expression",
    "guided_choice": "output held to a list of choices",
    "guided_grammar": "output held to an EBNF grammar (llama.cpp's grammars are GBNF)",
    "tools": "tool calling",
    "tool_choice": "tool calling",
    "parallel_tool_calls": "tool calling",
    "stream_options.continuous_usage_stats": "usage in every streamed chunk",
}
"""Kunlun API fields llama-server does not honour (tools need its Jinja mode, which Kunlun
does not start it in), and what each asks for. Values that ask for nothing (``n: 1``,
``echo: false``, ``null``) pass."""
LLAMA_CPP_RENAMES = {"repetition_penalty": "repeat_penalty", "guided_json": "json_schema",
                     "max_completion_tokens": "max_tokens"}  # fmt: skip
"""Kunlun (vLLM/OpenAI) spellings -> llama-server's (tools/server/README.md)."""


def _llama_cpp_body(payload: dict[str, Any]) -> dict[str, Any]:
    body = dict(payload)
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        raise lacks("llama.cpp", "stream_options.continuous_usage_stats",
                    LLAMA_CPP_LACKS["stream_options.continuous_usage_stats"])  # fmt: skip
    for name, what in LLAMA_CPP_LACKS.items():
        value = body.get(name)
        if not asks_nothing(name, value):
            raise lacks("llama.cpp", name, what)
        body.pop(name, None)
    if isinstance(options, dict):
        body["stream_options"] = {k: v for k, v in options.items() if k == "include_usage"}
    for ours, theirs in LLAMA_CPP_RENAMES.items():
        if ours in body:
            value = body.pop(ours)
            if value is not None:
                body[theirs] = json.loads(value) if ours == "guided_json" and isinstance(
                    value, str) else value  # fmt: skip
    if body.get("seed") is not None:
        # A seeded request asks for the same answer every time. llama-server reuses a cached
        # prompt's KV, computed in another batch shape: in bf16 its logits differ enough from
        # a fresh prefill for the sampled answer to change (the validate battery's seed row
        # failed on a CPU with native bf16). Seeded requests are prefilled whole.
        body["cache_prompt"] = False
    return body


class KunlunEngine(EngineAdapter):
    """The embedded PyTorch engine: the node agent's worker, on every device plugin's type."""

    name = EMBEDDED_ENGINE
    formats: tuple[ModelFormat, ...] = ("hf", "gguf")
    takes_launch_file = True

    def version(self) -> str | None:
        from kunlun import __version__

        return __version__

    @property
    def device_types(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(known_device_types())

    def installed(self, device_type: str | None = None) -> Availability:
        return Availability(True, "built in")

    def command(self, plan: ExecutionPlan, context: LaunchContext) -> EngineCommand:
        if context.launch_file is None:
            raise self.refuse("launch_file", None, "the worker starts from its launch file "
                                                   "(kunlun.planner.plan.engine_launch)")  # fmt: skip
        return EngineCommand(
            engine=self.name,
            argv=worker_command(context.launch_file),
            env=dict(plan.env),
            host=context.host,
            port=context.port,
            ready_path=None,
            metrics_path="/metrics",
            stats_path="/stats",
            log_file=context.log_file,
            notes=["ready when the worker writes its ready file (kunlun.node.agent)"],
        )
