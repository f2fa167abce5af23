"""Offline, synchronous generation: :class:`LLM` runs the engine until its requests finish.

Every prompt is validated before any runs, so a bad one raises (a :class:`RequestError`)
and nothing is queued; outputs come back in the prompts' order.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import Any, cast

from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.outputs import RequestOutput
from kunlun.engine.request import Prompt
from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import ConfigError, RequestError


class LLM:
    """Offline, synchronous use of the engine: ``generate`` and ``chat`` block until done."""

    def __init__(self, model_dir: str | Path | None = None, *, engine: LLMEngine | None = None,
                 **settings: Any) -> None:  # fmt: skip
        """Build an engine from ``model_dir`` and :class:`EngineConfig` keywords, or wrap
        ``engine``."""
        if engine is None:
            if model_dir is None:
                raise ConfigError("LLM needs a model_dir or an engine")
            engine = LLMEngine.from_model(model_dir, **settings)
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        Every prompt is validated before any runs: a bad one raises :class:`RequestError`
        and nothing is queued. ``sampling_params`` is one for all or one per prompt.
        """
        batch = _as_batch(prompts)
        params_list = _per_prompt(sampling_params, len(batch))
        requests = [
            self.engine.make_request(p, sp) for p, sp in zip(batch, params_list, strict=True)
        ]
        for request in requests:
            self.engine.add(request)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(requests) and self.engine.has_unfinished():
            for delta in self.engine.step():
                if delta.final is not None:
                    results[delta.request_id] = delta.final
        return [results[r.request_id] for r in requests]

    def chat(
        self,
        messages: SequenceOf[Mapping[str, Any]] | SequenceOf[SequenceOf[Mapping[str, Any]]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, formatted with the
        model's chat template (with the generation prompt)."""
        if messages and isinstance(messages[0], Mapping):
            conversations = [cast(SequenceOf[Mapping[str, Any]], messages)]
        else:
            conversations = cast(list[SequenceOf[Mapping[str, Any]]], list(messages))
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params)


def _per_prompt(
    params: SamplingParams | SequenceOf[SamplingParams] | None, count: int
) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise RequestError(f"got {len(params)} sampling_params for {count} prompts")
    return list(params)


def _as_batch(prompts: Prompt | SequenceOf[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or a sequence of prompts, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [cast(list[int], items)]
    return cast(list[Prompt], items)
