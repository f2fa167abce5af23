"""SamplingParams.validate names the bad field and its value."""

from __future__ import annotations

import pytest

from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import RequestError


def test_defaults_are_valid() -> None:
    params = SamplingParams().validate()
    assert params.n == 1 and params.max_tokens is None and not params.greedy


def test_a_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]


def test_greedy_and_penalty_flags() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(frequency_penalty=0.1).needs_penalties
    assert not SamplingParams().needs_penalties


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("seed", "7"),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("max_tokens", 0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 100),
        ("priority", 1.5),
        ("temperature", True),
    ],
)
def test_each_bad_value_is_named(field: str, value: object) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value}).validate()
    assert f"{field}={value!r}" in info.value.message
    assert info.value.code == "request.invalid"


@pytest.mark.parametrize(
    "good",
    [
        dict(temperature=0),
        dict(top_p=1.0, top_k=1, min_p=1.0),
        dict(presence_penalty=-2, frequency_penalty=2),
        dict(logprobs=0, prompt_logprobs=20),
        dict(priority=-5, seed=0, stop=["a", "bc"], stop_token_ids=[0, 5], max_tokens=1),
    ],
)
def test_boundary_values_are_accepted(good: dict) -> None:
    SamplingParams(**good).validate()
