"""The portable PyTorch inference engine.

Runs Llama-family and Qwen2/Qwen3 models on any torch device (cpu, cuda, npu, mlu, musa,
xpu): paged KV cache with prefix caching, continuous batching with chunked prefill, and a
full sampler. Imports need only torch, safetensors, tokenizers, jinja2 and pydantic (the
launch contract, :mod:`kunlun.engine.launch`); which extension module registers a vendor's
device type it asks the device plugins (:mod:`kunlun.engine.device`).
"""
