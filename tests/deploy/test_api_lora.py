"""LoRA adapters over HTTP, driven by the official openai client against real Ray Serve on loopback:
`model` selects an adapter, /v1/models lists them, run-time loads and unloads reach both replicas,
and bad or unknown adapters get OpenAI errors while the replicas keep serving."""

import json
import os
import shutil

import httpx
import openai
import pytest
from openai import OpenAI

from tests.deploy.conftest import delete_app, run_app
from tests.random_lora import write_random_lora

pytestmark = pytest.mark.slow

NAME = "tiny-lora"
ADMIN = "admin-key"
USER = "user-key"
SCOPED = "scoped-key"  # may name and see adapter a1 only
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def lora_app(ray_cluster, http_port, tiny_model_dir, tmp_path_factory):
    """Two replicas of the tiny Llama, adapter a1 declared, run-time loads allowed under root."""

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
        "api_keys": {
            ADMIN: {"tenant": "ops", "admin": True},
            USER: {"tenant": "users"},
            SCOPED: {"tenant": "scoped", "loras": ["a1"]},
        },
    }
    run_app(build_app(args), "lora", "/lora")
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
    if refused.status_code != 200:
        assert refused.status_code == 400 and "unfinished requests" in refused.text
        # The replicas listed before the refusing one have dropped it (deploy/lora.LoraAdmin):
        # as its contract says, the caller retries once the adapter's requests have ended.
        assert _admin(url, "unload", {"lora_name": "a1"}).status_code == 200
    r = _admin(url, "load", {"lora_name": "a1", "lora_path": str(lora_app[1] / "a1")})
    assert r.status_code == 200
    assert _text(client, "a1")


def _load(url: str, name: str, path) -> httpx.Response:
    return _admin(url, "load", {"lora_name": name, "lora_path": str(path)})


def _copy(root, source: str, name: str):
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(root / source, path)
    return path


def _stream(client: OpenAI, model: str, max_tokens: int):
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return iter(stream)


def _rest(chunks, first) -> tuple[str, str | None]:
    """The stream's whole text and its finish reason, once it ends."""
    rest = [first, *chunks]
    text = "".join(c.choices[0].text for c in rest if c.choices)
    reasons = [c.choices[0].finish_reason for c in rest if c.choices]
    return text, reasons[-1]


def _reference(url: str, root, source: str, prompt: str = PROMPT) -> str:
    """The greedy text of the adapter in directory `source`, loaded for the purpose."""
    client = OpenAI(base_url=f"{url}/v1", api_key=USER, max_retries=0, timeout=120)
    assert _load(url, "ref", root / source).status_code == 200
    try:
        r = client.completions.create(model="ref", prompt=prompt, max_tokens=8, temperature=0)
        return r.choices[0].text
    finally:
        assert _admin(url, "unload", {"lora_name": "ref"}).status_code == 200


def test_an_adapter_whose_directory_is_deleted_keeps_answering_on_every_replica(lora_app, client):
    url, root = lora_app
    path = _copy(root, "a2", "gone")
    assert _load(url, "gone", path).status_code == 200
    shutil.rmtree(path)  # the replicas kept what they read at load
    texts = {_text(client, "gone") for _ in range(4)}  # both replicas
    assert texts == {_reference(url, root, "a2")}
    assert _admin(url, "unload", {"lora_name": "gone"}).status_code == 200


def test_a_fifo_config_is_refused_at_load_while_a_neighbours_stream_goes_on(lora_app, client):
    url, root = lora_app
    path = root / "fifo"
    path.mkdir()
    shutil.copy(root / "a1" / "adapter_model.safetensors", path)
    os.mkfifo(path / "adapter_config.json")  # no writer: a blocking open never returns
    chunks = _stream(client, "a1", 64)
    first = next(chunks)
    refused = _load(url, "fifo", path)
    assert refused.status_code == 400, refused.text
    assert "adapter_config.json is not a regular file" in refused.json()["error"]["message"]
    text, reason = _rest(chunks, first)
    assert reason == "length" and text
    assert [m.id for m in client.models.list().data] == [NAME, "a1"]
    assert _text(client, "a1")


def test_a_name_reloaded_from_rewritten_files_serves_the_new_weights_and_no_old_kv(
    lora_app, client
):
    url, root = lora_app
    prompt = PROMPT * 12  # several full blocks

    def complete(model: str):
        return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)

    # Texts are compared between cold prompts only: a prefix hit computes the prompt's last rows
    # in other shapes, whose rounding may flip a near tie of the tiny random model.
    path = _copy(root, "a1", "re")
    assert _load(url, "re", path).status_code == 200
    old = complete("re")
    assert old.usage.prompt_tokens_details.cached_tokens == 0
    assert old.choices[0].text == complete("a1").choices[0].text
    for _ in range(3):  # cached on the replicas it reaches
        complete("re")
    assert _admin(url, "unload", {"lora_name": "re"}).status_code == 200
    _copy(root, "a2", "re")
    assert _load(url, "re", path).status_code == 200
    first = complete("re")
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # none of a1's KV
    assert first.choices[0].text == _reference(url, root, "a2", prompt)
    assert first.choices[0].text != old.choices[0].text
    assert _admin(url, "unload", {"lora_name": "re"}).status_code == 200


def test_an_alpha_that_overflows_is_a_400_naming_lora_alpha(lora_app, client):
    url, root = lora_app
    path = _copy(root, "a1", "huge-alpha")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1e308}))
    r = _load(url, "huge-alpha", path)
    assert r.status_code == 400 and "lora_alpha=1e+308" in r.json()["error"]["message"], r.text
    assert [m.id for m in client.models.list().data] == [NAME, "a1"]


@pytest.mark.parametrize("where", ["outside", "missing", "bad", "not-json"])
def test_admin_errors_name_no_absolute_path(lora_app, where):
    url, root = lora_app
    if where == "not-json":
        _copy(root, "a1", "not-json")
        (root / "not-json" / "adapter_config.json").write_text("{")
    path = {"outside": "/etc", "missing": str(root / "missing")}.get(where, str(root / where))
    r = _load(url, "x", path)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith(("lora_path", "lora adapter")), r.text
    assert str(root) not in message and "/etc" not in message and "/tmp" not in message


def test_a_scoped_key_sees_and_names_only_its_adapters(lora_app, client):
    url, root = lora_app
    scoped = OpenAI(base_url=f"{url}/v1", api_key=SCOPED, max_retries=0, timeout=120)
    assert _load(url, "a2", root / "a2").status_code == 200
    try:
        assert [m.id for m in client.models.list().data] == [NAME, "a1", "a2"]
        assert [m.id for m in scoped.models.list().data] == [NAME, "a1"]
        for model in ("a2", f"{NAME}:a2", "nope"):
            with pytest.raises(openai.NotFoundError) as info:
                _text(scoped, model)
            assert info.value.body["code"] == "model_not_found"
        assert _text(scoped, "a1") == _text(client, "a1") and _text(scoped, NAME)
    finally:
        assert _admin(url, "unload", {"lora_name": "a2"}).status_code == 200


def test_an_unknown_adapter_is_named_once(lora_app, client):
    with pytest.raises(openai.NotFoundError) as info:
        _text(client, "nope")
    assert info.value.body["message"] == "lora_name: no LoRA adapter named 'nope' is loaded"
    r = _admin(lora_app[0], "unload", {"lora_name": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "lora_name: no LoRA adapter named 'nope' is loaded"
