"""Which KV transport a disaggregated replica uses (`disaggregation.kv_transport`): `auto` is the
object store for host-memory payloads (the measured faster path on one machine) and on clusters
of several machines (no transfer paid twice), the collective pairs only for CUDA payloads on one
machine; `object_store` and `collective` force theirs. Bad values are errors naming the field, in
the library (DisaggPhase, kv_transport) and at build_app."""

from __future__ import annotations

import math

import pytest

from cluster.disagg_replica import PAYLOAD_DEVICE, DisaggPhase, kv_transport, transport_choice
from cluster.disagg_transport import ObjectStoreTransport
from deploy.app import AppConfigError, build_app, replica_deployment
from deploy.config import AppConfig
from workers.kv_collective import CollectiveTransport

STORE, PAIRS, PAIRS_AND_COPY = "object_store", "collective", "collective + store copy"


def kind(transport: object) -> str:
    if isinstance(transport, ObjectStoreTransport):
        return STORE
    assert isinstance(transport, CollectiveTransport), transport
    assert isinstance(transport.fallback, ObjectStoreTransport)
    return PAIRS_AND_COPY if transport.copy_to_fallback else PAIRS


@pytest.mark.parametrize(
    ("choice", "device", "machines", "expected"),
    [
        ("auto", "cpu", 1, STORE),
        ("auto", "cpu", 3, STORE),
        ("auto", "cuda", 1, PAIRS),
        ("auto", "cuda:1", 1, PAIRS),
        ("auto", "cuda", 2, STORE),
        ("object_store", "cpu", 1, STORE),
        ("object_store", "cuda", 1, STORE),
        ("object_store", "cuda", 2, STORE),
        ("collective", "cpu", 1, PAIRS),
        ("collective", "cuda", 1, PAIRS),
        ("collective", "cpu", 2, PAIRS_AND_COPY),
        ("collective", "cuda", 4, PAIRS_AND_COPY),
    ],
)
def test_each_choice_on_each_device_and_cluster(choice, device, machines, expected):
    assert kind(kv_transport(choice, device, machines)) == expected
    assert transport_choice(choice, device, machines) == expected.split(" ")[0]


@pytest.mark.parametrize("machines", [1, 2])
def test_the_default_is_the_object_store_for_today_s_host_staged_payloads(machines):
    """read_blocks stages every payload in host memory, so the default never uses gloo pairs
    (slower than the store on one machine) nor pays a transfer twice across machines."""
    assert PAYLOAD_DEVICE == "cpu"
    assert DisaggPhase("decode").kv_transport == "auto"
    assert kind(kv_transport(machines=machines)) == STORE


@pytest.mark.parametrize("choice", ["auto", "object_store", "collective"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_setting_reaches_each_phase_s_replicas(choice, role):
    config = AppConfig.from_args({"model": "default", "disaggregation": {"kv_transport": choice}})
    bound = replica_deployment(config, "LLMReplica", role)._bound_deployment
    phase = bound.init_args[3]  # LLMReplica(config, slo, model_name, phase)
    assert phase == DisaggPhase(role, 10.0, choice)


BAD = ["nccl", "AUTO", "", 2**64, -1, math.nan, None, "x" * 10_000_000]


@pytest.mark.parametrize("value", BAD)
def test_an_unknown_transport_is_a_value_error_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^kv_transport: one of \['auto', 'object_store'") as e:
        DisaggPhase("prefill", 10.0, value)
    assert len(str(e.value)) < 200  # a huge value is not echoed back
    with pytest.raises(ValueError, match=r"^kv_transport: one of"):
        kv_transport(value, "cpu", 1)


@pytest.mark.parametrize("value", BAD)
def test_build_app_refuses_an_unknown_transport_naming_the_field(value):
    args = {"model": "default", "disaggregation": {"kv_transport": value}}
    with pytest.raises(AppConfigError, match=r"disaggregation\.kv_transport: must be") as e:
        build_app(args)
    assert "one of ['auto', 'object_store', 'collective']" in str(e.value) or (
        not isinstance(value, str) and "must be a string" in str(e.value)
    )
