"""Whose cached blocks a request may reuse: the salt the ingress builds from the app's
prefix_cache_scope, the key's tenant, `cache_salt` and `prompt_cache_key`; and the bounds of the
two request fields and the setting."""

import json

import pytest
from pydantic import ValidationError

from deploy.cache_scope import request_salt
from deploy.config import AppConfig
from deploy.errors import error_response
from deploy.responses import ResponsesRequest
from deploy.schemas import MAX_MESSAGES, ChatCompletionRequest, CompletionRequest

BAD = [2**64, -1, float("nan"), "x" * 1025, "x" * 10_000_000, ["a"], {"a": 1}]


def test_the_tenant_scope_salts_every_request_by_its_tenant():
    a, b = request_salt("tenant", "a"), request_salt("tenant", "b")
    assert a is not None and b is not None and a != b
    assert request_salt("tenant", "a") == a  # the same tenant's requests share
    assert len(a) == 32


def test_the_shared_scope_leaves_hashes_unsalted_unless_the_request_asks():
    assert request_salt("shared", "a") is None and request_salt("shared", "b") is None
    # vLLM's cache_salt: requests naming the same salt share, whoever sends them.
    assert request_salt("shared", "a", cache_salt="s") == request_salt(
        "shared", "b", cache_salt="s"
    )
    assert request_salt("shared", "a", cache_salt="s") != request_salt(
        "shared", "a", cache_salt="t"
    )


def test_prompt_cache_key_is_always_the_tenants_own():
    for scope in ("tenant", "shared"):
        mine = request_salt(scope, "a", prompt_cache_key="k")
        assert mine != request_salt(scope, "b", prompt_cache_key="k")
        assert mine != request_salt(scope, "a")
        assert mine == request_salt(scope, "a", prompt_cache_key="k")


def test_no_cache_salt_spells_another_tenants_salt():
    """The parts are encoded before they are hashed: a salt holding a separator and a tenant's
    name is not that tenant."""
    assert request_salt("shared", "x", cache_salt='a"],["tenant","b') != request_salt("tenant", "b")
    assert request_salt("tenant", "a", cache_salt="b") != request_salt("tenant", "ab")


def test_an_unknown_scope_is_a_value_error_naming_the_setting():
    with pytest.raises(ValueError, match="^prefix_cache_scope: must be one of"):
        request_salt("nobody", "a")


def test_the_scope_defaults_to_tenant_once_keys_are_configured():
    assert AppConfig.from_args({}).cache_scope == "shared"
    assert AppConfig.from_args({"api_key": "k"}).cache_scope == "tenant"
    assert AppConfig.from_args({"api_keys": {"k": {"tenant": "t"}}}).cache_scope == "tenant"
    keyed_shared = AppConfig.from_args({"api_key": "k", "prefix_cache_scope": "shared"})
    assert keyed_shared.cache_scope == "shared"


@pytest.mark.parametrize("value", [2**64, -1, float("nan"), "x" * 10_000_000, "everyone"])
def test_a_bad_prefix_cache_scope_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="^invalid raylm app args: prefix_cache_scope: must be"):
        AppConfig.from_args({"prefix_cache_scope": value})


@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("name", ["cache_salt", "prompt_cache_key"])
@pytest.mark.parametrize("bad", BAD)
def test_a_bad_cache_field_is_a_400_naming_it(schema, name, bad):
    _refused(schema, name, bad)


def test_an_empty_cache_salt_is_refused_as_vllm_refuses_it():
    _refused(CompletionRequest, "cache_salt", "")


def _refused(schema: type, name: str, bad: object) -> None:
    body = {"model": "m", name: bad}
    if schema is ResponsesRequest:
        body["input"] = "x"
    else:
        body.update(prompt="x", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(ValidationError) as info:
        schema.model_validate(body)
    response = error_response(info.value)
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and error["param"] == name, error
    assert error["message"].startswith(name)


def test_the_longest_cache_fields_are_taken():
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "cache_salt": "s" * 1024, "prompt_cache_key": "k" * 1024}
    )
    assert body.cache_salt == "s" * 1024 and body.prompt_cache_key == "k" * 1024


def test_the_responses_api_passes_both_fields_to_its_chat_request():
    body = ResponsesRequest.model_validate(
        {"model": "m", "input": "x", "cache_salt": "s", "prompt_cache_key": "k"}
    )
    chat = body.as_chat(MAX_MESSAGES)
    assert (chat.cache_salt, chat.prompt_cache_key) == ("s", "k")


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_cache_salt_of_the_responses_api_is_a_400_naming_it(bad):
    _refused(ResponsesRequest, "cache_salt", bad)
