"""SamplingParams: defaults and validation errors that name the field, the rule and the value."""

from __future__ import annotations

import pytest

from pagedmla.engine.sampling_params import SamplingParams


def test_defaults() -> None:
    params = SamplingParams()
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == -1
    assert params.max_tokens == 16
    assert params.stop_token_ids is None
    assert params.ignore_eos is False
    assert params.logprobs is None
    assert params.seed is None


def test_boundary_values_are_accepted() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, max_tokens=1, logprobs=0, seed=0)
    SamplingParams(top_p=1e-6, stop_token_ids=[1, 2], ignore_eos=True)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("temperature", -0.5, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("top_p", 0.0, "in (0, 1]"),
        ("top_p", 1.5, "in (0, 1]"),
        ("top_k", 0, "-1 (disabled) or >= 1"),
        ("top_k", -2, "-1 (disabled) or >= 1"),
        ("max_tokens", 0, ">= 1"),
        ("logprobs", -1, "None or >= 0"),
    ],
)
def test_invalid_values_raise_naming_field_expected_and_actual(
    field: str, value: float, expected: str
) -> None:
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    message = str(error.value)
    assert field in message
    assert expected in message
    assert repr(value) in message
