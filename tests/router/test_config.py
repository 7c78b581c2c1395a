"""The fleet router's settings: each bad value is refused naming its field, and Serve's
request_router_kwargs map one to one onto them."""

import pytest

from router.config import RoutingConfig


@pytest.mark.parametrize(
    "field,value",
    [
        ("router_policy", "random"),
        ("imbalance_threshold", -1),
        ("imbalance_ratio", 0.5),
        ("min_match_blocks", 0),
        ("max_index_blocks", 0),
        ("tokens_per_request", 0),
        ("kv_usage_weight", -0.5),
        ("stats_grace_s", -1),
        ("unconfirmed_ttl_s", 0),
        ("circuit_breaker_failures", -1),
        ("circuit_breaker_cooldown_s", 0),
        ("circuit_breaker_cooldown_s", float("nan")),
        ("seed", -1),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**{field: value})


def test_router_kwargs_map_one_to_one_and_unknown_keys_are_named():
    config = RoutingConfig.from_router_kwargs(
        {"router_policy": "least_loaded", "imbalance_threshold": 2}
    )
    assert (config.router_policy, config.imbalance_threshold) == ("least_loaded", 2)
    assert RoutingConfig.from_router_kwargs(None) == RoutingConfig()
    with pytest.raises(ValueError, match="router_kwargs.imbalance"):
        RoutingConfig.from_router_kwargs({"imbalance": 2})
