"""The garbage detector: the ways a broken kernel, dtype or tokenizer shows in answer text.

Every answer the battery receives goes through :func:`garbage_reasons`. Each rule names a
failure seen when a model runs wrong on a new chip:

- **empty**: nothing but whitespace (a model that emits EOS at once, a dropped body);
- **``!`` runs**: six or more ``!`` in a row (token 0 of many vocabularies is ``!``: what
  an fp16 overflow or all-NaN logits decode to);
- **mojibake**: U+FFFD (bytes that were not UTF-8; one or two at the very end are a
  character cut by the length limit and pass), UTF-8 read as Latin-1 / cp1252
  (``Ã©`` for ``é``, ``â€™`` for ``’``), or C0 control characters other than tab and newlines;
- **runaway repetition**: in an answer of at least :data:`MIN_REPEAT_TOKENS` words, more than
  :data:`MAX_REPEATED_TRIGRAMS` of its word trigrams repeat an earlier one (a decoder stuck in
  a loop). Text without spaces (Chinese, Japanese) counts characters instead of words.
"""

from __future__ import annotations

import re

MIN_REPEAT_TOKENS = 24
"""Shorter answers are not judged for repetition (too few trigrams to tell a loop)."""
MAX_REPEATED_TRIGRAMS = 0.5
"""Largest share of word trigrams that may repeat an earlier trigram of the same answer."""
BANG_RUN = 6
"""This many ``!`` in a row is garbage."""

_CP1252_HIGH = "€‚ƒ„…†‡ˆ‰Š‹ŒŽ‘’“”•–—˜™š›œžŸ"
_MOJIBAKE = re.compile(f"[\u00c2-\u00f4][\u0080-\u00bf{_CP1252_HIGH}]+")
_CONTROL = re.compile("[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f]")
_WORDS = re.compile(r"\w+|[^\w\s]")


def garbage_reasons(text: str) -> list[str]:
    """Why ``text`` looks like garbage; empty when it looks like language."""
    if not text.strip():
        return ["empty answer"]
    reasons = []
    run = max((len(m) for m in re.findall(r"!+", text)), default=0)
    if run >= BANG_RUN:
        reasons.append(f"a run of {run} '!'")
    replaced = _without_cut_character(text).count("\ufffd")
    if replaced:
        reasons.append(f"{replaced} U+FFFD replacement character(s)")
    for match in _MOJIBAKE.finditer(text):
        if _is_mojibake(match.group()):
            reasons.append(f"mojibake {match.group()!r} (UTF-8 read as Latin-1)")
            break
    control = _CONTROL.search(text)
    if control:
        reasons.append(f"control character U+{ord(control.group()):04X}")
    ratio, num_tokens = repetition(text)
    if num_tokens >= MIN_REPEAT_TOKENS and ratio > MAX_REPEATED_TRIGRAMS:
        reasons.append(f"runaway repetition: {ratio:.0%} of {num_tokens - 2} trigrams repeat")
    return reasons


def repetition(text: str) -> tuple[float, int]:
    """The share of trigrams that repeat an earlier one, and the number of tokens counted."""
    tokens = _WORDS.findall(text.lower())
    if len(tokens) < 0.1 * len(text.strip()):  # few spaces: count characters
        tokens = [c for c in text if not c.isspace()]
    trigrams = [tuple(tokens[i : i + 3]) for i in range(len(tokens) - 2)]
    if not trigrams:
        return 0.0, len(tokens)
    return 1 - len(set(trigrams)) / len(trigrams), len(tokens)


def _without_cut_character(text: str) -> str:
    """``text`` less one character cut in half at its end (up to two U+FFFD after other
    text): what a length limit falling inside a multi-byte character leaves, not garbage."""
    body = text.rstrip("\ufffd")
    return body if body.strip() and len(text) - len(body) <= 2 else text


def _is_mojibake(chunk: str) -> bool:
    """Whether ``chunk`` starts with UTF-8 bytes decoded as cp1252 / Latin-1 (the first
    two to four characters re-decode as one UTF-8 character)."""
    for size in (2, 3, 4):
        for codec in ("cp1252", "latin-1"):
            try:
                if len(chunk[:size].encode(codec).decode("utf-8")) == 1:
                    return True
            except (UnicodeEncodeError, UnicodeDecodeError):
                continue
    return False
