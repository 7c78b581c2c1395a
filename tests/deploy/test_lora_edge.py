"""LoRA at the HTTP edge, without Ray: which adapter `model` names, the admin bodies and checks,
the error mapping, the app settings, and the commands that address one replica each."""

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cluster.fleet_view import register, replica_ids
from cluster.lora_admin import LoraCommand
from deploy.admin_gate import LORA_GATE
from deploy.api_keys import ApiKeyProfile
from deploy.body import parse_body
from deploy.config import AppConfig
from deploy.errors import APIError, ModelNotFoundError, PermissionDeniedError, error_response
from deploy.lora import (
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    adapter_cards,
    adapter_of,
    check_adapter_scope,
    scoped_cards,
)
from scheduler.lora_slots import LoraInUseError, UnknownLoraError

BASE = ("tiny", "/models/tiny-llama")


def _mapped(exc: BaseException) -> tuple[int, dict]:
    response = error_response(exc)
    return response.status_code, json.loads(response.body)["error"]


@pytest.mark.parametrize(
    "model,adapter",
    [
        (None, None),
        ("tiny", None),
        ("/models/tiny-llama", None),
        ("tiny:sql-v2", "sql-v2"),
        ("/models/tiny-llama:sql-v2", "sql-v2"),
        ("sql-v2", "sql-v2"),
    ],
)
def test_model_names_the_base_or_an_adapter(model, adapter):
    assert adapter_of(model, BASE) == adapter


@pytest.mark.parametrize(
    "model",
    ["other:sql", "tiny:", "tiny:a b", "a/b", "x" * 65, "tiny:" + "x" * 10_000_000, "", ":"],
)
def test_a_model_that_is_neither_is_a_404_naming_model(model):
    with pytest.raises(ModelNotFoundError) as info:
        adapter_of(model, BASE)
    status, err = _mapped(info.value)
    assert status == 404 and err["param"] == "model" and err["code"] == "model_not_found"
    assert len(err["message"]) < 300


@settings(max_examples=100, deadline=None)
@given(model=st.text(max_size=80))
def test_any_model_string_is_the_base_an_adapter_or_a_404(model):
    try:
        adapter = adapter_of(model, BASE)
    except ModelNotFoundError:
        return
    assert adapter is None or model in (adapter, f"tiny:{adapter}", f"{BASE[1]}:{adapter}")


def test_adapter_cards_name_their_parent():
    cards = adapter_cards(["a", "b"], "tiny", 7)
    assert [c["id"] for c in cards] == ["a", "b"]
    assert all(c["parent"] == "tiny" and c["object"] == "model" for c in cards)


def test_an_unknown_adapter_is_a_404_and_one_in_use_a_400():
    status, err = _mapped(UnknownLoraError("nope"))
    assert status == 404 and err["code"] == "model_not_found" and "nope" in err["message"]
    status, err = _mapped(LoraInUseError("lora_name: adapter 'a' is used by 2 requests"))
    assert status == 400 and err["param"] == "lora_name"


@pytest.mark.parametrize(
    "raw,field",
    [
        ({"lora_name": "a"}, "lora_path"),
        ({"lora_name": "a", "lora_path": ""}, "lora_path"),
        ({"lora_name": "a", "lora_path": "x" * 10_000_000}, "lora_path"),
        ({"lora_name": "x" * 100_000, "lora_path": "/p"}, "lora_name"),
        ({"lora_name": 2**64, "lora_path": "/p"}, "lora_name"),
        ({"lora_name": "a", "lora_path": "/p", "base_model_name": "m"}, "base_model_name"),
    ],
)
def test_a_bad_load_body_is_a_400_naming_its_field(raw, field):
    with pytest.raises((ValidationError, APIError)) as info:
        asyncio.run(parse_body(json.dumps(raw).encode(), LoadLoraAdapterRequest, 16))
    status, err = _mapped(info.value)
    assert status == 400 and field in (err["param"] or "") + err["message"]


def test_an_unload_body_names_the_adapter():
    body = asyncio.run(parse_body(b'{"lora_name": "a"}', UnloadLoraAdapterRequest, 16))
    assert body.lora_name == "a"


def test_admin_calls_need_the_setting_and_an_admin_key():
    status, err = _mapped(_raised(lambda: LORA_GATE.check(False, None)))
    assert status == 400 and err["code"] == "runtime_lora_disabled"
    status, err = _mapped(_raised(lambda: LORA_GATE.check(True, False)))
    assert status == 403 and err["code"] == "permission_denied"
    LORA_GATE.check(True, True)
    LORA_GATE.check(True, None)  # no keys configured: the app is open to its callers
    assert isinstance(_raised(lambda: LORA_GATE.check(True, False)), PermissionDeniedError)


def _raised(fn) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_runtime_lora_needs_the_fleet_router_and_lora_on():
    with pytest.raises(ValueError, match="allow_runtime_lora: needs router: fleet"):
        AppConfig.from_args({"allow_runtime_lora": True, "router": "power_of_two"})
    with pytest.raises(ValueError, match="allow_runtime_lora: LoRA is off"):
        AppConfig.from_args({"allow_runtime_lora": True})
    config = AppConfig.from_args({"allow_runtime_lora": True, "lora_root": "/adapters"})
    assert config.engine.num_lora_slots == 4
    assert config.key_profiles() == {}
    keyed = AppConfig.from_args(
        {"api_key": "k", "api_keys": {"t": {"tenant": "t"}, "op": {"tenant": "o", "admin": True}}}
    )
    assert {k: p.admin for k, p in keyed.key_profiles().items()} == {
        "t": False,
        "op": True,
        "k": True,
    }
    with pytest.raises(ValueError, match="admin"):
        ApiKeyProfile(tenant="t", admin="yes")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"op": "list", "name": "a"},
        {"op": "add", "name": "a"},
        {"op": "add", "name": "a", "path": "x" * 10_000},
        {"op": "remove", "name": "a b"},
        {"op": "remove", "name": "x" * 100_000},
    ],
)
def test_a_bad_command_is_refused_by_field(kwargs):
    with pytest.raises(ValueError):
        LoraCommand("r1", **kwargs)


def test_replica_ids_come_from_the_routers_of_this_process_for_one_deployment():
    class Source:
        def __init__(self, deployment, ids):
            self.deployment, self.ids = deployment, ids

        def replica_reports(self):
            return {}

        def replica_ids(self):
            return self.ids

        def deployment_name(self):
            return self.deployment

    sources = [Source("llm", {"r1", "r2"}), Source("other-model", {"r3"})]
    for source in sources:
        register(source)
    assert {"r1", "r2"} <= replica_ids("llm")
    assert "r3" not in replica_ids("llm")


def test_the_metrics_page_lists_each_replicas_loaded_adapters():
    from cluster.metrics import RequestMetrics
    from deploy.metrics_page import render
    from router.stats import RoutingStats
    from scheduler.outputs import SchedulerStats

    reports = {
        "r1": RoutingStats(SchedulerStats(0, 0, 0, 0.0, 0.0, 0, loaded_loras=("a", "b"))),
        "r2": RoutingStats(SchedulerStats(0, 0, 0, 0.0, 0.0, 0)),
    }
    page = render([RequestMetrics()], reports, 0)
    assert 'raylm_lora_adapters_loaded{replica="r1"} 2' in page
    assert 'raylm_lora_adapters_loaded{replica="r2"} 0' in page
    assert 'raylm_lora_adapter_loaded{replica="r1",lora="b"} 1' in page


@pytest.mark.parametrize(
    "loras", [2**64, -1, float("nan"), "a1", ["a"] * 4097, ["a/b"], [2**64], [None], {"a1": 1}]
)
def test_a_key_scope_that_is_not_a_list_of_names_is_refused_naming_loras(loras):
    with pytest.raises(ValueError, match="loras:"):
        ApiKeyProfile(tenant="t", loras=loras)
    with pytest.raises(ValueError, match="loras"):
        AppConfig.from_args({"api_keys": {"k": {"tenant": "t", "loras": loras}}})


def test_a_scoped_key_names_and_sees_only_its_adapters():
    assert ApiKeyProfile(tenant="t", loras=["a1"]).loras == ["a1"]
    assert ApiKeyProfile(tenant="t").loras is None
    check_adapter_scope("a1", ["a1"], "a1")
    check_adapter_scope(None, [], "tiny")  # the base model is every key's
    check_adapter_scope("a2", None, "a2")  # unscoped
    status, err = _mapped(_raised(lambda: check_adapter_scope("a2", ["a1"], "tiny:a2")))
    assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert err["message"] == "The model `tiny:a2` does not exist."
    cards = [{"id": "tiny"}, *adapter_cards(["a1", "a2"], "tiny", 0)]
    assert [c["id"] for c in scoped_cards(cards, ["a1"])] == ["tiny", "a1"]
    assert [c["id"] for c in scoped_cards(cards, [])] == ["tiny"]
    assert scoped_cards(cards, None) == cards
