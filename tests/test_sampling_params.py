import pytest

from sage_infer.core.sampling_params import SamplingParams


def test_defaults_are_valid_and_not_greedy():
    params = SamplingParams()
    assert params.n == 1 and params.max_tokens == 16 and params.top_k == -1
    assert not params.greedy


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"top_k": 1}, {"temperature": 0.0, "top_k": 5}])
def test_greedy_when_temperature_zero_or_top_k_one(kwargs):
    assert SamplingParams(**kwargs).greedy


def test_top_k_zero_means_off():
    assert SamplingParams(top_k=0).top_k == -1


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="###").stop == ["###"]


def test_stop_list_is_copied():
    stops = ["a"]
    params = SamplingParams(stop=stops)
    stops.append("b")
    assert params.stop == ["a"]


def test_max_tokens_none_means_until_context_end():
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 0, "n must be >= 1"),
        ("max_tokens", 0, "max_tokens must be >= 1"),
        ("temperature", -0.1, "temperature must be >= 0"),
        ("temperature", float("nan"), "temperature must be >= 0"),
        ("top_k", -2, "top_k must be -1 or 0 (off) or in [1, 2**31)"),
        ("top_k", 2**31, "top_k must be -1 or 0 (off) or in [1, 2**31)"),
        ("seed", 2**64, "seed must be a 64-bit integer"),
        ("seed", -(2**63) - 1, "seed must be a 64-bit integer"),
        ("top_k", 2.5, "top_k must be an integer"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("min_p", -0.1, "min_p must be in [0, 1]"),
        ("min_p", 1.1, "min_p must be in [0, 1]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -2.5, "frequency_penalty must be in [-2, 2]"),
        ("logprobs", 21, "logprobs must be in [0, 20]"),
        ("logprobs", -1, "logprobs must be in [0, 20]"),
        ("seed", "7", "seed must be an integer"),
        ("stop", [""], "stop must be a non-empty string"),
        ("stop_token_ids", [-1], "stop_token_ids must be token ids"),
        ("stop_token_ids", [2**64], "stop_token_ids must be token ids"),
        ("n", True, "n must be an integer"),
    ],
)
def test_invalid_field_raises_value_error_naming_field_and_range(field, value, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert message in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0, "min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": 0},
        {"top_k": 50},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_is_slotted():
    with pytest.raises(AttributeError):
        SamplingParams().not_a_field = 1
