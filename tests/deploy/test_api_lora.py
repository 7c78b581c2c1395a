"""LoRA adapters over HTTP, driven by the official openai client against real Ray Serve on loopback:
`model` selects an adapter, /v1/models lists them, run-time loads and unloads reach both replicas,
and bad or unknown adapters get OpenAI errors while the replicas keep serving."""

import os

import httpx
import openai
import pytest
from openai import OpenAI

from tests.deploy.conftest import delete_app
from tests.random_lora import write_random_lora

pytestmark = pytest.mark.slow

NAME = "tiny-lora"
ADMIN = "admin-key"
USER = "user-key"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def lora_app(ray_cluster, http_port, tiny_model_dir, tmp_path_factory):
    """Two replicas of the tiny Llama, adapter a1 declared, run-time loads allowed under root."""
    from ray import serve

    from deploy.app import build_app

    root = tmp_path_factory.mktemp("loras")
    for i, name in enumerate(("a1", "a2")):
        write_random_lora(tiny_model_dir, str(root / name), seed=i + 1, rank=4)
    os.makedirs(root / "bad")
    (root / "bad" / "adapter_config.json").write_text("{not json")
    args = {
        "model": tiny_model_dir,
        "served_model_name": NAME,
        "max_model_len": 256,
        "num_gpu_blocks": 64,
        "kv_cache_memory_gb": 0.1,
        "num_replicas": 2,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
        "lora_modules": {"a1": str(root / "a1")},
        "lora_root": str(root),
        "max_lora_rank": 8,
        "allow_runtime_lora": True,
        "api_keys": {ADMIN: {"tenant": "ops", "admin": True}, USER: {"tenant": "users"}},
    }
    serve.run(build_app(args), name="lora", route_prefix="/lora")
    yield f"http://127.0.0.1:{http_port}/lora", root
    delete_app("lora")


@pytest.fixture(scope="module")
def client(lora_app):
    return OpenAI(base_url=f"{lora_app[0]}/v1", api_key=USER, max_retries=0, timeout=120)


def _text(client: OpenAI, model: str, max_tokens: int = 8) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


def _admin(url: str, op: str, body: dict, key: str = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/{op}_lora_adapter", json=body, headers=headers, timeout=120)


def test_model_selects_the_adapter_and_models_lists_it(client):
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == [NAME, "a1"]
    assert models["a1"].model_extra["parent"] == NAME
    adapted = _text(client, "a1")
    assert _text(client, f"{NAME}:a1") == adapted
    assert _text(client, NAME) != adapted
    chat = client.chat.completions.create(
        model=f"{NAME}:a1", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content is not None
    # A reply names the adapter as the client did; the base model's keep the served name.
    assert chat.model == f"{NAME}:a1"
    named = client.completions.create(model="a1", prompt=PROMPT, max_tokens=2, temperature=0)
    assert named.model == "a1"
    base = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    assert base.model == NAME


def test_unknown_adapters_are_404_and_the_replicas_keep_serving(client):
    for model in ("nope", f"{NAME}:nope", "other:a1", "a b"):
        with pytest.raises(openai.NotFoundError) as info:
            _text(client, model)
        assert info.value.body["code"] == "model_not_found"
    assert _text(client, "a1")


def test_runtime_load_reaches_both_replicas_and_unload_removes_it(lora_app, client):
    url, root = lora_app
    assert (
        _admin(url, "load", {"lora_name": "a2", "lora_path": str(root / "a2")}, USER).status_code
        == 403
    )
    r = _admin(url, "load", {"lora_name": "a2", "lora_path": str(root / "a2")})
    assert r.status_code == 200, r.text
    replicas = r.json()["replicas"]
    assert len(replicas) == 2 and all(v == ["a1", "a2"] for v in replicas.values())
    assert [m.id for m in client.models.list().data] == [NAME, "a1", "a2"]
    texts = {_text(client, "a2") for _ in range(4)}  # both replicas, the same adapter
    assert len(texts) == 1 and texts != {_text(client, "a1")}
    r = _admin(url, "unload", {"lora_name": "a2"})
    assert r.status_code == 200, r.text
    assert all(v == ["a1"] for v in r.json()["replicas"].values())
    with pytest.raises(openai.NotFoundError):
        _text(client, "a2")
    assert _admin(url, "unload", {"lora_name": "a2"}).status_code == 404


@pytest.mark.parametrize(
    "body,status,text",
    [
        ({"lora_name": "x", "lora_path": "/etc"}, 400, "lora_root"),
        ({"lora_name": "x", "lora_path": "bad"}, 400, ""),
        ({"lora_name": "a1", "lora_path": "a1"}, 400, "already loaded"),
        ({"lora_name": "a/b", "lora_path": "a1"}, 400, "lora_name"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ],
)
def test_bad_loads_are_400_and_change_no_replica(lora_app, client, body, status, text):
    url, root = lora_app
    if body.get("lora_path") in ("bad", "a1"):
        body = {**body, "lora_path": str(root / body["lora_path"])}
    r = _admin(url, "load", body)
    assert r.status_code == status and text in r.json()["error"]["message"], r.text
    assert [m.id for m in client.models.list().data] == [NAME, "a1"]


def test_unloading_an_adapter_in_use_is_refused_and_its_stream_ends_whole(lora_app, client):
    url, _ = lora_app
    stream = client.completions.create(
        model="a1",
        prompt=PROMPT,
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.model == "a1"
    refused = _admin(url, "unload", {"lora_name": "a1"})
    rest = list(chunks)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    assert text and rest[-1].choices[0].finish_reason == "length"
    if refused.status_code == 200:  # the stream ended first: put the adapter back
        r = _admin(url, "load", {"lora_name": "a1", "lora_path": str(lora_app[1] / "a1")})
        assert r.status_code == 200
    else:
        assert refused.status_code == 400 and "unfinished requests" in refused.text
    assert _text(client, "a1")
