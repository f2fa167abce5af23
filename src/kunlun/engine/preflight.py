"""The engine's checks that need neither a device nor a weight, in one place.

:func:`preflight` is the first thing :class:`~kunlun.engine.llm_engine.LLMEngine` does, and
what the planner's plans are held to: every plan the planner prints for any device passes it
(``tests/planner/test_plans_start.py``), and on the CPU every such plan also starts and
generates. A refusal here is a :class:`ConfigError` naming the setting and its value, raised
before any rank or device is touched.
"""

from __future__ import annotations

from kunlun.engine.config import ModelConfig
from kunlun.engine.engine_config import EngineConfig
from kunlun.engine.quant import QuantSpec, resolve_spec
from kunlun.engine.tp_layout import head_split_problem, quantized_split_problem
from kunlun.errors import ConfigError, Location


def preflight(config: EngineConfig) -> QuantSpec | None:
    """Check ``config`` against its model: the settings themselves, ``max_model_len`` within
    the model's positions, the quantization against the checkpoint and its layers, and the
    tensor-parallel split (heads; quantized weights stay on one rank). Returns the
    quantization the engine will run (None: floating point)."""
    config.validate()
    model = ModelConfig.from_dir(config.model_dir)
    check_max_model_len(config.max_model_len, model)
    spec = resolve_spec(config.model_dir, config.quantization, config.group_size, model)
    tp = config.tensor_parallel_size
    problem = head_split_problem(model.num_attention_heads, model.num_key_value_heads, tp)
    if problem is not None:
        raise ConfigError(
            f"{config.model_dir}: {problem}", location=Location("tensor_parallel_size"),
            hint="choose a tensor-parallel size the heads split over",
        )  # fmt: skip
    # the scheme the weights run in: the checkpoint's own, or the one asked
    raise_if_quantized_split("none" if spec is None else spec.scheme, tp)
    return spec


def check_max_model_len(requested: int | None, model: ModelConfig) -> int:
    """``requested`` (or the model's ``max_position_embeddings`` when None), refused outside
    ``[1, max_position_embeddings]``."""
    limit = model.max_position_embeddings
    if requested is None:
        return limit
    if not 1 <= requested <= limit:
        raise ConfigError(
            f"max_model_len={requested} is outside [1, {limit}] "
            f"(the model's max_position_embeddings)"
        )
    return requested


def raise_if_quantized_split(quantization: str, tp: int) -> None:
    """Raise :class:`ConfigError` when ``tp`` ranks would split ``quantization`` weights."""
    problem = quantized_split_problem(quantization, tp)
    if problem is not None:
        raise ConfigError(
            problem, location=Location("tensor_parallel_size"),
            hint="run the quantized model with tensor_parallel_size 1, or the floating model "
            "split over ranks",
        )  # fmt: skip
