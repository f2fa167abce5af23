"""The body of ``POST /v1/embeddings`` (OpenAI's shape), apart from its handler
(:mod:`kunlun.serving.embeddings`) so that the gateway can describe it without loading the
engine."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kunlun.errors import RequestError
from kunlun.protocol.fields import StrictModel
from kunlun.protocol.openai_api import TokenIds
from kunlun.protocol.openai_errors import param_error


class EmbeddingRequest(StrictModel):
    """``POST /v1/embeddings``."""

    model: str
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    """Accepted, ignored (:data:`IGNORED_FIELDS`)."""

    @property
    def single(self) -> bool:
        """One input (a string or one token list): errors name it ``input``, not ``input.0``."""
        value = self.input
        return isinstance(value, str) or bool(value) and isinstance(value[0], int)

    def inputs(self) -> list[str | list[int]]:
        """The inputs, in order."""
        return [self.input] if self.single else list(self.input)  # type: ignore[list-item,arg-type]


def served_for_generation(model: str) -> RequestError:
    """The 400 for ``/v1/embeddings`` to a model served for generation."""
    return param_error(
        "model",
        f"model {model!r} is served for generation (task generate), not embeddings; serve it "
        "with --task embed (or task: embed in its workload spec) for /v1/embeddings",
    )
