"""Shared fixtures for engine tests: the imported demo model and tiny random models.

``demo_model_dir`` (``tests/conftest.py``) is SmolLM2-135M-Instruct imported once per
machine. ``make_tiny_model(arch, tie_word_embeddings)`` (alias ``tiny_model_dir``)
builds a seeded random transformers model of that architecture (:mod:`kunlun.engine.tiny`)
with the demo's tokenizer and returns its directory, cached per arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kunlun.engine.tiny import build_tiny_model

TinyFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def make_tiny_model(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TinyFactory:
    """Factory ``(arch, tie_word_embeddings, **options) -> model dir`` (cached per arguments).

    ``arch`` is one of :data:`TINY_ARCHITECTURES`; options: ``llama3_rope`` (Llama with
    llama3 RoPE scaling), ``attention_bias`` (Llama with q/k/v/o biases), ``sharded`` (weights split into several safetensors files).
    """
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[tuple, Path] = {}

    def make(arch: str, tie_word_embeddings: bool = False, **options: bool) -> Path:
        key = (arch, tie_word_embeddings, tuple(sorted(options.items())))
        if key not in cache:
            name = "-".join([arch, str(tie_word_embeddings), *(k for k, v in options.items() if v)])
            cache[key] = build_tiny_model(
                arch, tie_word_embeddings, root / name, demo_model_dir, **options
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model: TinyFactory) -> TinyFactory:
    """Alias of :func:`make_tiny_model`: ``tiny_model_dir(arch, tied) -> Path``."""
    return make_tiny_model
