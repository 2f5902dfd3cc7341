import pytest

from early_exit_router import RouterConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(exit_layers=[3, 1]), "sorted"),
        (dict(exit_layers=[2, 2]), "duplicates"),
        (dict(exit_layers=[-1]), "non-negative"),
        (dict(high_conf_threshold=1.5), "high_conf_threshold must be in \\[0, 1\\]"),
        (dict(low_conf_threshold=-0.1), "low_conf_threshold must be in \\[0, 1\\]"),
        (dict(high_conf_threshold=0.5, low_conf_threshold=0.6), "low_conf_threshold .* is above"),
        (dict(entropy_threshold=1.2), "entropy_threshold \\(normalized\\) must be in \\[0, 1\\]"),
        (dict(entropy_normalized=False, entropy_threshold=-1.0), "nats >= 0"),
        (dict(mode="fast"), "Unknown mode 'fast'"),
        (dict(block_size=0), "block_size must be an integer >= 1"),
        (dict(max_pending=0), "max_pending must be an integer >= 1"),
        (dict(adapter="mlp"), "Unknown adapter 'mlp'"),
        (dict(gate_threshold=2.0), "gate_threshold must be in"),
        (dict(exit_layers=[1, 3], exit_adapters={3: "mlp"}), "Unknown adapter 'mlp' for exit 3"),
        (dict(exit_layers=[1, 3], exit_adapters={2: "block"}), "not exit layers \\[1, 3\\]"),
        (dict(ngram_tier="false"), "ngram_tier must be true or false, got 'false'"),  # a form's or a JSON string
        (dict(use_gate=1), "use_gate must be true or false"),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)


def test_exit_layers_are_checked_against_the_depth():
    config = RouterConfig(exit_layers=[2, 5])
    with pytest.raises(ValueError, match="out of range .* 6 layers: use 0-based indices from 0 to 4"):
        config.check_model_depth(6)
    assert RouterConfig(exit_layers=[2, 4]).resolved_exit_layers(6) == [2, 4]


def test_default_exit_layers_sit_at_one_and_two_thirds():
    assert RouterConfig().resolved_exit_layers(30) == [10, 20]
    assert RouterConfig().resolved_exit_layers(6) == [2, 4]


def test_replace_rejects_unknown_fields_and_validates():
    with pytest.raises(TypeError, match="Unknown RouterConfig fields \\['threshold'\\]"):
        RouterConfig().replace(threshold=0.3)
    with pytest.raises(ValueError):
        RouterConfig().replace(high_conf_threshold=3)


def test_a_new_high_threshold_alone_takes_the_low_one_down_with_it():
    calibrated = RouterConfig(high_conf_threshold=0.95, low_conf_threshold=0.95)
    lowered = calibrated.replace(high_conf_threshold=0.9)
    assert (lowered.high_conf_threshold, lowered.low_conf_threshold) == (0.9, 0.9)
    assert calibrated.replace(high_conf_threshold=0.99).low_conf_threshold == 0.95  # already below: kept
    with pytest.raises(ValueError, match="low_conf_threshold .* is above"):
        calibrated.replace(low_conf_threshold=0.99)  # an explicit low above high is still an error
    with pytest.raises(ValueError, match="low_conf_threshold .* is above"):
        calibrated.replace(high_conf_threshold=0.5, low_conf_threshold=0.6)


def test_json_round_trip(tmp_path):
    config = RouterConfig(
        exit_layers=[1, 3], high_conf_threshold=0.8, block_size=2, exit_adapters={3: "residual_block"}
    )
    config.save(tmp_path / "c.json")
    import json

    assert RouterConfig.from_dict(json.loads((tmp_path / "c.json").read_text())) == config
    with pytest.raises(ValueError, match="newer early-exit-router"):
        RouterConfig.from_dict({**config.to_dict(), "future_knob": 1})


def test_per_exit_adapter_kinds_override_the_default_kind():
    config = RouterConfig(exit_layers=[1, 3, 4], adapter="postnorm", exit_adapters={"3": "residual_block"})
    assert config.exit_adapters == {3: "residual_block"}  # JSON's string keys become layer indices
    assert [config.adapter_for(e) for e in (1, 3, 4)] == ["postnorm", "residual_block", "postnorm"]


def test_every_field_is_documented():
    text = RouterConfig.describe()
    for name in RouterConfig.field_names():
        assert name in text
