"""SGLang's native ``/generate`` request and response, over Kunlun's engine types.

A program written for SGLang's ``RuntimeEndpoint`` (or plain ``requests`` against SGLang's
native API) sends ``{text | input_ids, sampling_params, stream, return_logprob,
top_logprobs_num, logprob_start_len, return_text_in_logprobs, rid}``; :class:`GenerateRequest`
reads it with SGLang's names and defaults (``max_new_tokens`` 128, ``top_k`` -1 for "all")
and maps ``sampling_params`` onto :class:`~kunlun.engine.sampling_params.SamplingParams`
(``regex``, ``json_schema`` and ``ebnf`` become a :class:`~kunlun.engine.guided.Guide`).
Like every request model it is strict: a field SGLang has and Kunlun cannot honour
(:data:`SGLANG_UNSUPPORTED`) is a 400 naming it and what it is for, a misspelt one a 400 too.
``model`` is Kunlun's extension (SGLang serves one model; the platform may serve several).

The builders shape one completion as SGLang does: ``{"text", "meta_info": {"id",
"finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}``;
``finish_reason`` is ``{"type": "stop", "matched": <stop string or token id>}``,
``{"type": "length", "length": <max_new_tokens>}`` or ``{"type": "abort", "message"}``; with
``return_logprob`` the meta info carries ``input_token_logprobs`` / ``output_token_logprobs``
as ``[logprob, token_id, text or null]`` triples, and with ``top_logprobs_num`` > 0
``input_top_logprobs`` / ``output_top_logprobs`` as one list of triples per position.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from kunlun.engine.guided import Guide
from kunlun.engine.outputs import CompletionOutput, RequestOutput
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.sequence import TopLogprobs
from kunlun.protocol.fields import StrictModel
from kunlun.protocol.openai_api import TokenIds, schema_guide
from kunlun.protocol.openai_errors import param_error
from kunlun.protocol.responses import TokenText

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens``."""

SGLANG_UNSUPPORTED: dict[str, str] = {
    "image_data": "image input",
    "audio_data": "audio input",
    "video_data": "video input",
    "input_embeds": "embedding input",
    "lora_path": "LoRA adapters",
    "lora_id": "LoRA adapters",
    "return_hidden_states": "hidden states output",
    "session_params": "sessions",
    "custom_logit_processor": "custom logit processors",
    "token_ids_logprob": "logprobs of chosen token ids",
    "bootstrap_host": "prefill/decode disaggregation",
    "bootstrap_port": "prefill/decode disaggregation",
    "bootstrap_room": "prefill/decode disaggregation",
    "data_parallel_rank": "data-parallel rank choice",
    "return_entropy": "entropy output",
}
"""Fields of SGLang's ``/generate`` that Kunlun does not implement, and what they are for:
a request that sets one (to anything but null) is a 400 naming it."""


def _refuse_unsupported(data: Any, where: str) -> None:
    if not isinstance(data, dict):
        return
    for name, purpose in SGLANG_UNSUPPORTED.items():
        if data.get(name) is not None:
            raise param_error(
                f"{where}{name}", f"'{where}{name}' is not supported by Kunlun ({purpose})"
            )


class GenerateSamplingParams(StrictModel):
    """``sampling_params`` of ``/generate``, with SGLang's names, ranges and defaults."""

    max_new_tokens: Annotated[int, Field(ge=0)] | None = DEFAULT_MAX_NEW_TOKENS
    """0 runs the prompt only (it then sits in the prefix cache); None: up to the context."""
    min_new_tokens: Annotated[int, Field(ge=0, le=0)] = 0
    """Only 0: the engine has no minimum length (RuntimeEndpoint sends 0)."""
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: int = -1
    """-1 keeps every token, else >= 1."""
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    stop_regex: str | list[str] | None = None
    """Only empty: the engine stops on strings and token ids, not on regexes."""
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """Only true (SGLang's default): the tokenizer decodes special tokens as they are."""
    no_stop_trim: bool = False
    """Only false: a stop string is never part of the text."""
    seed: int | None = None
    """Kunlun's extension (SGLang calls it ``sampling_seed``)."""
    regex: str | None = None
    json_schema: str | None = None
    """A JSON schema as JSON text (SGLang's form)."""
    ebnf: str | None = None

    @model_validator(mode="after")
    def _honourable(self) -> GenerateSamplingParams:
        if self.top_k == 0 or self.top_k < -1:
            raise param_error("sampling_params.top_k", f"top_k={self.top_k}: -1 (all) or >= 1")
        if self.stop_regex:
            raise param_error("sampling_params.stop_regex", "stop regexes are not supported")
        if not self.spaces_between_special_tokens:
            raise param_error("sampling_params.spaces_between_special_tokens",
                              "only true is supported")  # fmt: skip
        if self.no_stop_trim:
            raise param_error("sampling_params.no_stop_trim", "only false is supported")
        return self

    def guide(self) -> Guide | None:
        given = [n for n in ("regex", "json_schema", "ebnf") if getattr(self, n) is not None]
        if len(given) > 1:
            raise param_error(f"sampling_params.{given[1]}",
                              f"use one of {', '.join(given)}: each constrains the output")  # fmt: skip
        if not given:
            return None
        field = f"sampling_params.{given[0]}"
        if given[0] == "json_schema":
            return schema_guide(self.json_schema or "", field)
        if given[0] == "regex":
            return Guide("regex", self.regex or "", field)
        return Guide("grammar", self.ebnf or "", field)


class GenerateRequest(StrictModel):
    """The body of ``POST /generate``."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    """First prompt position whose logprob is returned; -1: the last prompt token only."""
    top_logprobs_num: Annotated[int, Field(ge=0, le=20)] = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    model: str | None = None
    """Kunlun's extension: which served model (needed when the platform serves several)."""

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        _refuse_unsupported(data, "")
        return data

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise param_error("text", "send exactly one of text and input_ids")
        if self.logprob_start_len < -1:
            raise param_error("logprob_start_len", "must be -1 or a prompt position >= 0")
        prompts = self.prompts()
        if not prompts:
            raise param_error("text" if self.text is not None else "input_ids", "is empty")
        if self.rid is not None and isinstance(self.rid, list) != self.is_batch:
            raise param_error("rid", "a list of ids goes with a list of prompts, one per prompt")
        if isinstance(self.rid, list) and len(self.rid) != len(prompts):
            raise param_error("rid", f"{len(self.rid)} ids for {len(prompts)} prompts")
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            twice = next(r for i, r in enumerate(self.rid) if r in self.rid[:i])
            raise param_error("rid", f"{twice!r} is given twice: each prompt's id must be its own")
        return self

    @property
    def is_batch(self) -> bool:
        """A list of prompts (answered with a list)."""
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]

    @property
    def lists_answer(self) -> bool:
        """The answer is a list: several prompts, or ``n`` > 1."""
        return self.is_batch or self.sampling_params.n > 1

    def prompts(self) -> list[str | list[int]]:
        if self.text is not None:
            return list(self.text) if isinstance(self.text, list) else [self.text]
        if self.is_batch:
            return list(self.input_ids)  # type: ignore[arg-type]
        return [self.input_ids]  # type: ignore[list-item]

    def rids(self) -> list[str | None]:
        if isinstance(self.rid, list):
            return list(self.rid)
        return [self.rid] * len(self.prompts())

    def to_sampling_params(self) -> SamplingParams:
        p = self.sampling_params
        stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        if any(not s for s in stop):
            raise param_error("sampling_params.stop", "stop strings must not be empty")
        k = self.top_logprobs_num if self.return_logprob else None
        return SamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=None if p.top_k == -1 else p.top_k,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            seed=p.seed,
            stop=stop,
            stop_token_ids=list(p.stop_token_ids or []),
            # max_new_tokens 0: one token is run and not returned (the prompt gets computed)
            max_tokens=None if p.max_new_tokens is None else max(p.max_new_tokens, 1),
            ignore_eos=p.ignore_eos,
            logprobs=k,
            prompt_logprobs=k,
            skip_special_tokens=p.skip_special_tokens,
            guide=p.guide(),
        )


# ---- responses ----


def finish_reason(output: CompletionOutput, max_new_tokens: int | None) -> dict[str, Any] | None:
    """SGLang's ``finish_reason`` object for a completion (None while it runs)."""
    if output.finish_reason is None:
        return None
    if max_new_tokens == 0:
        return {"type": "length", "length": 0}
    if output.finish_reason == "stop":
        matched = output.stop_reason
        if matched is None and output.token_ids:
            matched = output.token_ids[-1]
        return {"type": "stop", "matched": matched}
    if output.finish_reason == "length":
        return {"type": "length", "length": len(output.token_ids)}
    return {"type": "abort", "message": "the request was aborted"}


def _triple(tokens: TokenText, logprob: float | None, token_id: int, with_text: bool) -> list[Any]:
    return [logprob, token_id, tokens(token_id)[0] if with_text else None]


def _tops(tokens: TokenText, entry: TopLogprobs | None, k: int, with_text: bool) -> Any:
    if entry is None:
        return None
    ranked = sorted(entry.items(), key=lambda item: item[1], reverse=True)[:k]
    return [_triple(tokens, lp, t, with_text) for t, lp in ranked]


def logprob_fields(
    req: GenerateRequest,
    tokens: TokenText,
    prompt_ids: list[int],
    prompt_logprobs: list[TopLogprobs | None] | None,
    output_ids: list[int],
    output_logprobs: list[TopLogprobs],
) -> dict[str, Any]:
    """The meta info's logprob fields (``return_logprob``); input ones once known."""
    text, k = req.return_text_in_logprobs, req.top_logprobs_num
    fields: dict[str, Any] = {
        "output_token_logprobs": [
            _triple(tokens, e.get(t), t, text)
            for t, e in zip(output_ids, output_logprobs, strict=True)
        ]
    }
    if k:
        fields["output_top_logprobs"] = [_tops(tokens, e, k, text) for e in output_logprobs]
    if prompt_logprobs is not None:
        start = len(prompt_ids) - 1 if req.logprob_start_len == -1 else req.logprob_start_len
        positions = range(start, len(prompt_ids))
        fields["input_token_logprobs"] = [
            _triple(tokens, (prompt_logprobs[i] or {}).get(prompt_ids[i]), prompt_ids[i], text)
            for i in positions
        ]
        if k:
            fields["input_top_logprobs"] = [
                _tops(tokens, prompt_logprobs[i], k, text) for i in positions
            ]
    return fields


def generate_item(
    req: GenerateRequest,
    tokens: TokenText,
    rid: str,
    final: RequestOutput,
    output: CompletionOutput,
    e2e_latency: float,
) -> dict[str, Any]:
    """One finished completion as SGLang's ``/generate`` answers it."""
    max_new = req.sampling_params.max_new_tokens
    prefill_only = max_new == 0
    output_ids = [] if prefill_only else output.token_ids
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason(output, max_new),
        "prompt_tokens": len(final.prompt_token_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": final.num_cached_tokens,
        "e2e_latency": e2e_latency,
    }
    if req.return_logprob:
        meta.update(logprob_fields(req, tokens, final.prompt_token_ids, final.prompt_logprobs,
                                   output_ids, [] if prefill_only else output.logprobs or []))  # fmt: skip
    return {"text": "" if prefill_only else output.text, "meta_info": meta}


CHAT_TEMPLATE_FAMILIES = (
    ("<|im_start|>", "chatml"),
    ("<|start_header_id|>", "llama-3-instruct"),
    ("<start_of_turn>", "gemma-it"),
    ("[INST]", "llama-2-chat"),
)
"""Markers of a model's own chat template (its tokenizer's Jinja text) and the name of SGLang
front-end template that writes the same turns: SGLang's front-end renders a program's
``sgl.user``/``sgl.assistant`` turns itself, by a template it picks from ``model_path`` (names
the platform's aliases do not follow) or from ``RuntimeEndpoint(chat_template_name=...)``."""


def chat_template_family(template: str | None) -> str | None:
    """The SGLang front-end template that writes turns as ``template`` does, or None."""
    for marker, name in CHAT_TEMPLATE_FAMILIES:
        if template and marker in template:
            return name
    return None
