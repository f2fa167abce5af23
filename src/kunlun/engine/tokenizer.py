"""Text <-> token ids for a model directory, the way Hugging Face's ``AutoTokenizer`` does it.

Reads ``tokenizer.json`` (the ``tokenizers`` serialization), ``tokenizer_config.json``
(special tokens, chat template), ``chat_template.jinja`` and ``generation_config.json``
(extra end-of-sequence ids). Which special tokens ``encode`` adds is decided by the
post-processor inside ``tokenizer.json`` alone: like transformers 5, the
``add_bos_token``/``add_eos_token`` flags of ``tokenizer_config.json`` are ignored when a
``tokenizer.json`` exists. Chat templates render in a
sandboxed jinja2 environment configured like transformers' (:mod:`kunlun.jinja_sandbox`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as _Backend

from kunlun.errors import Location, ModelError, ModelFileMissing
from kunlun.jinja_sandbox import sandbox_environment

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_LONG_TEXT_CHARS = 4096
"""Texts longer than this are encoded with the GIL released (:meth:`Tokenizer.encode`)."""


class Tokenizer:
    """Encode, decode and chat-format text for one model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        """Load the tokenizer files of ``model_dir``.

        Raises :class:`ModelFileMissing` when ``tokenizer.json`` is absent and
        :class:`ModelError` naming the file when a file cannot be parsed.
        """
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ModelFileMissing(f"tokenizer not found: {path}", location=Location(str(path)))
        try:
            self.backend: _Backend = _Backend.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise ModelError(f"cannot load {path}: {exc}", location=Location(str(path))) from exc
        config = _read_json(root / "tokenizer_config.json")
        self.special_tokens: dict[str, str | None] = {
            name: _token_text(config.get(name)) for name in _SPECIAL_NAMES
        }
        """``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` text (or ``None``)."""
        self.chat_template: str | None = _chat_template(root, config)
        """The jinja2 chat template, or ``None`` when the model has none. An engine replaces
        it with a workload's own (:attr:`kunlun.engine.engine_config.EngineConfig.chat_template`)."""
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.bos_token_id = self._id_of(self.special_tokens["bos_token"])
        """Id of the BOS token, or ``None``."""
        self.eos_token_id = self._id_of(self.special_tokens["eos_token"])
        """Id of the EOS token, or ``None``."""
        self.eos_token_ids: set[int] = _eos_ids(root, self.eos_token_id)
        """Every id that ends generation (tokenizer EOS and the generation config's)."""
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        """Number of token ids, added tokens included."""
        self.all_special_ids: set[int] = {
            int(index)
            for index, token in self.backend.get_added_tokens_decoder().items()
            if token.special
        }
        """Ids of the special added tokens (what ``skip_special_tokens`` drops)."""

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for: the longest decoded vocabulary
        entry, special tokens included (computed once). A text of ``B`` bytes encodes to at
        least ``B / max_token_bytes`` tokens when the tokenizer covers every byte of its
        input (byte-level BPE, byte fallback) and its normalizer does not shrink text; the
        worker allows a margin on top (:data:`kunlun.serving.worker_core.PROMPT_BYTES_MARGIN`)."""
        ids = [[i] for i in range(self.vocab_size)]
        texts = self.backend.decode_batch(ids, skip_special_tokens=False)
        return max((len(text.encode("utf-8", "replace")) for text in texts), default=1) or 1

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, plus those the post-processor of
        ``tokenizer.json`` adds (a BOS, for many models). A long text goes through
        ``encode_batch``, which gives the same ids but releases the GIL while it works (plain
        ``encode`` holds it: 4 s for a 1 MB text, during which no other thread of the process
        runs), so that a caller in a worker thread does not stall the event loop."""
        if len(text) > _LONG_TEXT_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens`` is false."""
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (raw, e.g. byte-level ``Ġword``) of ``token_id``, or ``None``."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary entry ``token``, or ``None``."""
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template.

        ``extra`` variables (``tools``, ``documents``...) are passed to the template. Raises
        :class:`ModelError` when the model has no template or the template fails, with the
        template's own message.
        """
        if self.chat_template is None:
            raise ModelError("this model has no chat template", hint="send a plain prompt")
        variables: dict[str, Any] = {"tools": None, "documents": None, **extra}
        for name, value in self.special_tokens.items():
            variables.setdefault(name, value)
        try:
            return _compile(self.chat_template).render(
                messages=[dict(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ModelError(
                f"chat template failed: {exc}", location=Location("chat_template")
            ) from exc


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot parse {path}: {exc}", location=Location(str(path))) from exc
    if not isinstance(data, dict):
        raise ModelError(f"{path.name} is not a JSON object", location=Location(str(path)))
    return data


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {item.get("name"): item.get("template") for item in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _eos_ids(root: Path, eos_token_id: int | None) -> set[int]:
    ids = set() if eos_token_id is None else {eos_token_id}
    generation = _read_json(root / "generation_config.json")
    value = generation.get("eos_token_id")
    if value is None and not generation:
        value = _read_json(root / "config.json").get("eos_token_id")
    if isinstance(value, int):
        ids.add(value)
    elif isinstance(value, list):
        ids.update(int(item) for item in value)
    return ids


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``: drop spaces before punctuation/contractions."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox set up like transformers'."""
    return sandbox_environment().from_string(source)
