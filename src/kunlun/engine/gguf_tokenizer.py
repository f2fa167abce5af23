"""Rebuild a Hugging Face ``tokenizer.json`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are supported: the
vocabulary and merges come from the file, tokens typed control (3) become special added
tokens and user-defined ones (4) plain added tokens. Text is split before BPE by the regex
the vocabulary was trained with, named by ``tokenizer.ggml.pre``; a name not in
:data:`PRE_TOKENIZER_SPLITS` gets GPT-2's byte-level split, as transformers does.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from kunlun.engine.gguf_reader import GGUFFile
from kunlun.errors import Location, ModelError

_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` -> the split regex its merges were learned with.
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character that spells it."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _spelled(token: str, alphabet: set[str]) -> str:
    """``token`` in the byte alphabet (a token already spelled that way is kept)."""
    if set(token) <= alphabet:
        return token
    table = byte_alphabet()
    return "".join(table[byte] for byte in token.encode("utf-8"))


def _invalid(gguf: GGUFFile, key: str, message: str) -> ModelError:
    return ModelError(
        f"GGUF metadata {key} {message}", location=Location(str(gguf.path), field=key)
    )


def _list_of(gguf: GGUFFile, key: str, kind: type, what: str) -> list[Any]:
    value = gguf.metadata.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _invalid(gguf, key, f"must be an array of {what}, got a {type(value).__name__}")
    for index, item in enumerate(value):
        if type(item) is not kind:
            raise _invalid(gguf, key, f"must hold only {what}; item {index} is {item!r:.80}")
    return value


def token_list(gguf: GGUFFile) -> list[str]:
    """``tokenizer.ggml.tokens``, checked to be an array of strings (empty when absent)."""
    return _list_of(gguf, "tokenizer.ggml.tokens", str, "strings")


def special_token_id(gguf: GGUFFile, name: str, vocab_size: int) -> int | None:
    """``tokenizer.ggml.<name>`` (e.g. ``bos_token_id``): None when absent, else checked to
    be a token id below ``vocab_size``."""
    key = f"tokenizer.ggml.{name}"
    value = gguf.metadata.get(key)
    if value is not None and (type(value) is not int or not 0 <= value < vocab_size):
        raise _invalid(gguf, key, f"must be a token id in [0, {vocab_size}), got {value!r:.80}")
    return value


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The ``tokenizers`` tokenizer the GGUF file's vocabulary describes; a vocabulary the
    ``tokenizers`` library refuses raises :class:`ModelError` naming the key."""
    meta = gguf.metadata
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelError(
            f"GGUF tokenizer model {model!r:.80} cannot be imported; supported: gpt2 "
            "(byte-level BPE)",
            location=Location(str(gguf.path), field="tokenizer.ggml.model"),
        )
    tokens = token_list(gguf)
    if not tokens:
        raise _invalid(gguf, "tokenizer.ggml.tokens", "is missing or empty")
    token_types = _list_of(gguf, "tokenizer.ggml.token_type", int, "integers") or [1] * len(tokens)
    alphabet = set(byte_alphabet().values())
    vocab = {_spelled(token, alphabet): index for index, token in enumerate(tokens)}
    merges = []
    for index, merge in enumerate(_list_of(gguf, "tokenizer.ggml.merges", str, "strings")):
        pair = tuple(merge.split(" ", 1))
        if len(pair) != 2:
            raise _invalid(
                gguf, "tokenizer.ggml.merges", f"item {index} {merge!r:.80} is not 'LEFT RIGHT'"
            )
        merges.append(pair)
    pre = meta.get("tokenizer.ggml.pre")
    if pre is not None and not isinstance(pre, str):
        raise _invalid(gguf, "tokenizer.ggml.pre", f"must be a string, got {pre!r:.80}")
    try:
        tokenizer = Tokenizer(
            BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
    except Exception as exc:  # tokenizers raises a bare Exception for a bad vocabulary
        raise _invalid(gguf, "tokenizer.ggml.merges", f"do not fit the vocabulary: {exc}") from None
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    try:
        tokenizer.post_processor = _post_processor(gguf, tokens)
    except Exception as exc:  # tokenizers' template parser, on a special token it cannot spell
        raise _invalid(
            gguf, "tokenizer.ggml.bos_token_id", f"names a token BOS/EOS cannot use: {exc}"
        ) from None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL and set(token) <= alphabet
    ]
    tokenizer.add_special_tokens(control)
    user = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _USER_DEFINED and token in vocab
    ]
    tokenizer.add_tokens(user)
    return tokenizer


def _post_processor(gguf: GGUFFile, tokens: list[str]) -> processors.PostProcessor:
    """BOS/EOS around the text as ``tokenizer.ggml.add_bos_token``/``add_eos_token`` ask
    (the template transformers builds from the same flags)."""

    def flagged(flag: str, key: str) -> str | None:
        index = special_token_id(gguf, key, len(tokens))
        if gguf.metadata.get(f"tokenizer.ggml.{flag}") and index is not None:
            return tokens[index]
        return None

    bos = flagged("add_bos_token", "bos_token_id")
    eos = flagged("add_eos_token", "eos_token_id")
    single = f"{f'{bos}:0 ' if bos else ''}$A:0{f' {eos}:0' if eos else ''}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    special = [(token, tokens.index(token)) for token in dict.fromkeys((bos, eos)) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _pre_tokenizer(name: str | None) -> pre_tokenizers.PreTokenizer:
    split = PRE_TOKENIZER_SPLITS.get(name or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_config(gguf: GGUFFile) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens, BOS/EOS flags and the chat template."""
    meta = gguf.metadata
    tokens = token_list(gguf)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        index = special_token_id(gguf, key, len(tokens))
        if index is not None:
            config[name] = tokens[index]
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    config["clean_up_tokenization_spaces"] = False
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config
