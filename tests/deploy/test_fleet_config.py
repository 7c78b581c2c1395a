"""Several models in one app: the `models:` list, and how a request's `model` and key find one."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy.app import application, check_exposure
from deploy.config import AppConfig
from deploy.errors import AuthenticationError, ModelNotFoundError
from deploy.fleet_config import INGRESS_ONLY, MAX_MODELS, FleetConfig
from deploy.models import ModelTable, ServedModel

TWO = {
    "max_num_seqs": 8,
    "models": [
        {"name": "chat", "model": "default", "num_replicas": 2, "api_key": "k-chat"},
        {
            "name": "small/v1",
            "model": "/models/tiny",
            "max_num_seqs": 4,
            "autoscaling": {"min_replicas": 0, "max_replicas": 2},
        },
    ],
}


def test_args_without_models_are_the_one_model_form():
    fleet = FleetConfig.from_args({"served_model_name": "m", "num_replicas": 2})
    assert fleet.single and fleet.ingress is fleet.models[0]
    assert fleet.models[0] == AppConfig.from_args({"served_model_name": "m", "num_replicas": 2})
    assert fleet.deployment_name(0) == "LLMReplica"


def test_each_entry_is_the_shared_settings_with_its_own_over_them():
    fleet = FleetConfig.from_args(TWO)
    chat, small = fleet.models
    assert (chat.model_name, chat.num_replicas, chat.engine.scheduler.max_num_seqs) == (
        "chat",
        2,
        8,
    )
    assert small.engine.model == "/models/tiny" and small.engine.scheduler.max_num_seqs == 4
    assert small.autoscaling is not None and small.autoscaling.min_replicas == 0
    assert fleet.key_profiles().keys() == {"k-chat"}
    assert [fleet.deployment_name(i) for i in range(2)] == [
        "LLMReplica-chat",
        "LLMReplica-small_v1",
    ]


def test_the_app_has_one_ingress_and_a_replica_deployment_per_model():
    app = application(FleetConfig.from_args(TWO))
    ingress = app._bound_deployment
    names = [d._bound_deployment.name for d in ingress.init_args[1]]
    assert ingress.name == "OpenAIIngress"
    assert names == ["LLMReplica-chat", "LLMReplica-small_v1"]


@pytest.mark.parametrize(
    ("models", "field"),
    [
        ([], "models"),
        ("chat", "models"),
        (["chat"], "models[0]"),
        ([{"name": "a"}, {"name": "a"}], "models"),
        ([{"name": "a/b"}, {"name": "a_b"}], "models"),
        ([{"name": ""}], "models[0].name"),
        ([{"name": "x" * 10_000}], "models[0].name"),
        ([{"name": 7}], "models[0].name"),
        ([{"name": "a", "served_model_name": "b"}], "models[0].name"),
        ([{"name": "a", "max_num_seqs": -1}], "models[0].engine.scheduler.max_num_seqs"),
        ([{"name": "a", "num_replicas": 2**64}], "models[0].num_replicas"),
        ([{"name": "a", "bogus": 1}], "models[0].bogus"),
        ([{"name": f"m{i}"} for i in range(MAX_MODELS + 1)], "models"),
        ([{"name": "a"}] * 100_000, "models"),
        ([{"name": "a", "request_timeout_s": float("nan")}], "models[0].request_timeout_s"),
        (
            [{"name": "a", "autoscaling": {"min_replicas": -1}}],
            "models[0].autoscaling.min_replicas",
        ),
    ]
    + [([{"name": "a", key: None}], f"models[0].{key}") for key in INGRESS_ONLY],
)
def test_a_bad_models_list_names_the_field(models, field):
    with pytest.raises(ValueError, match=rf"invalid raylm app args: {re.escape(field)}:"):
        FleetConfig.from_args({"models": models})


def test_a_key_names_one_tenant_across_models():
    models = [
        {"name": "a", "api_keys": {"k": {"tenant": "t1"}}},
        {"name": "b", "api_keys": {"k": {"tenant": "t2"}}},
    ]
    with pytest.raises(ValueError, match=r"models\[1\]\.api_keys: .*one key, one tenant"):
        FleetConfig.from_args({"models": models})
    models[1]["api_keys"] = {"k": {"tenant": "t1", "max_priority": 5}}  # its own ceiling: fine
    assert FleetConfig.from_args({"models": models}).key_profiles()["k"].tenant == "t1"


def test_beyond_loopback_every_model_needs_keys():
    fleet = FleetConfig.from_args(TWO)
    with pytest.raises(ValueError, match="api_keys: Serve listens on 0.0.0.0.*'small/v1'"):
        check_exposure("0.0.0.0", fleet)
    check_exposure("127.0.0.1", fleet)


def _table(args: dict) -> ModelTable:
    """The table over configs alone: resolve reads names and keys, never a tokenizer."""
    fleet = FleetConfig.from_args(args)
    return ModelTable(
        [
            ServedModel(
                config=c,
                replica=None,
                frontend=None,
                metrics=None,
                texts=None,
                grammars=None,
                tool_format=None,
                renders_tools=False,
                reasoning=None,
                lora_admin=None,
                keys=c.key_profiles(),
            )
            for c in fleet.models
        ]
    )


def test_a_request_finds_its_model_by_name_or_path_and_the_first_when_it_names_none():
    table = _table(TWO)
    caller = table.authenticate("Bearer k-chat")
    assert table.resolve("chat", caller)[0].name == "chat"
    assert table.resolve("small/v1", caller)[0].name == "small/v1"
    assert table.resolve("/models/tiny", caller)[0].name == "small/v1"
    assert table.resolve(None, caller)[0].name == "chat"
    with pytest.raises(ModelNotFoundError, match="`gpt-4` does not exist") as exc:
        table.resolve("gpt-4", caller)
    assert exc.value.status == 404 and "`chat`, `small/v1`" in str(exc.value)


def test_keys_are_per_model():
    table = _table(
        {
            "models": [
                {"name": "a", "api_key": "ka"},
                {"name": "b", "api_keys": {"kb": {"tenant": "bee", "max_priority": 3}}},
                {"name": "open"},
            ]
        }
    )
    anonymous, a_key, b_key = (table.authenticate(h) for h in ("", "Bearer ka", "bearer kb"))
    assert anonymous.key is None and a_key.key == "ka" and b_key.tenant == "bee"
    assert table.resolve("open", anonymous)[0].name == "open"
    with pytest.raises(AuthenticationError):  # a keyed model, no key
        table.resolve("a", anonymous)
    with pytest.raises(ModelNotFoundError, match="`a` does not exist or you do not have access"):
        table.resolve("a", b_key)  # another model's key: as if it did not exist
    model, caller = table.resolve("b", b_key)
    assert model.name == "b" and caller.profile is not None and caller.profile.max_priority == 3
    assert [m.name for m in table.visible(b_key)] == ["b", "open"]
    assert [m.name for m in table.visible(anonymous)] == ["open"]
    assert table.authenticate("Bearer wrong").key is None  # the open model still serves it


def test_without_an_open_model_a_wrong_key_is_a_401():
    table = _table({"models": [{"name": "a", "api_key": "ka"}, {"name": "b", "api_key": "kb"}]})
    for header in ("", "Bearer wrong", "Bearer ka-and-more", "ka"):
        with pytest.raises(AuthenticationError):
            table.authenticate(header)


@given(st.text(max_size=300), st.text(max_size=300))
def test_resolve_never_fails_but_with_an_openai_error(name, header):
    table = _table(TWO)
    try:
        table.resolve(name, table.authenticate(header))
    except (AuthenticationError, ModelNotFoundError):
        return
    assert name in ("chat", "default", "small/v1", "/models/tiny")


def test_an_adapter_is_named_under_its_model_or_alone_when_one_model_serves_adapters():
    table = _table(
        {"models": [{"name": "chat", "max_loras": 2}, {"name": "plain", "model": "/models/p"}]}
    )
    caller = table.authenticate("")
    assert table.resolve("chat:sql", caller)[0].name == "chat"
    assert table.resolve("sql", caller)[0].name == "chat"  # the only model serving adapters
    assert table.models[0].adapter("chat:sql") == "sql"
    assert table.models[0].adapter("chat") is None
    with pytest.raises(ModelNotFoundError):
        table.resolve("nobody:sql", caller)
