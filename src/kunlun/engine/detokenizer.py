"""Turn one sequence's output tokens into text as they arrive, and decide when it stops.

Incremental decoding keeps a small window of ids (``prefix_offset:read_offset`` is what was
already turned into text; the window starts on the prompt's last tokens so that leading
spaces of SentencePiece tokenizers survive). New text is taken only when the decoded window
does not end in U+FFFD, so a UTF-8 character split over several byte tokens is never
emitted half-way. Stop strings are searched across token boundaries; text that could be the
start of a stop string is held back until it is known not to be one, and a stop string is
never emitted (unless ``include_stop_str_in_output``). Before ``min_tokens`` output tokens
nothing ends the answer but ``max_tokens``. Finish reasons: ``"stop"`` (a stop string, a stop token, an end-of-sequence
token unless ``ignore_eos``, or the request's ``end_text`` rule), ``"length"``
(``max_tokens`` output tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kunlun.engine.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
_PROMPT_WINDOW = 6
"""Prompt tokens decoded as context for the first output token."""


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    """Incremental text and stop conditions of one sequence."""

    def __init__(
        self,
        tokenizer: Decoder,
        params: SamplingParams,
        prompt_token_ids: list[int],
        *,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        max_tokens: int,
    ) -> None:
        """``max_tokens`` is the effective output limit (the request's, capped by the
        context window); ``eos_token_ids`` end the sequence unless ``params.ignore_eos``."""
        self.tokenizer = tokenizer
        self.params = params
        self.max_tokens = max_tokens
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= set(eos_token_ids)
        self._stops = [s for s in params.stop if s]
        self._ids = list(prompt_token_ids[-_PROMPT_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.num_tokens = 0
        self.text = ""
        """Text so far (after a stop string, cut before it)."""
        self._num_emitted = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        """The stop string or token id that finished the sequence."""

    def update(self, token_id: int) -> str | None:
        """Take the next output token; return the finish reason if the sequence ends here."""
        if self.finish_reason is not None:
            raise RuntimeError("update() after the sequence finished")
        self.num_tokens += 1
        if self.num_tokens < self.params.min_tokens:  # (its stop tokens were masked)
            self.text += self._decode_next(token_id)
        elif token_id in self._stop_ids:
            self._finish("stop", token_id if token_id in self.params.stop_token_ids else None)
        else:
            start = max(0, len(self.text) - self._longest_stop() + 1)
            piece = self._decode_next(token_id)
            self.text += piece
            self._check_stop_strings(start)
            if piece and self.finish_reason is None and self.params.end_text is not None:
                self._check_end_text(self.params.end_text)
        if self.finish_reason is None and self.num_tokens >= self.max_tokens:
            self._finish("length", None)
        return self.finish_reason

    def finish(self, reason: str) -> None:
        """End the sequence for a reason decided elsewhere (abort, context full)."""
        if self.finish_reason is None:
            self._finish(reason, None)

    def take_delta(self) -> str:
        """Text not yet handed out that is safe to hand out now (all of it once finished)."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= self._held_back()
        delta = self.text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    # ---- internals ----
    def _decode_next(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        skip = self.params.skip_special_tokens
        decode = self.tokenizer.decode
        prefix = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # an incomplete character, or nothing printable yet
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if self._prefix_offset > 2 * _PROMPT_WINDOW:  # keep the window small
            drop = self._prefix_offset
            del ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return full[len(prefix) :]

    def _check_stop_strings(self, start: int) -> None:
        found: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.text.find(stop, start)
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        if found is not None:
            kept = len(found[1]) if self.params.include_stop_str_in_output else 0
            self.text = self.text[: found[0] + kept]
            self._finish("stop", found[1])

    def _check_end_text(self, rule: Callable[[str], int | None]) -> None:
        cut = rule(self.text)
        if cut is not None:
            self.text = self.text[:cut]  # what was handed out already stays handed out
            self._finish("stop", None)

    def _finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _longest_stop(self) -> int:
        return max((len(s) for s in self._stops), default=1)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        text = self.text
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
