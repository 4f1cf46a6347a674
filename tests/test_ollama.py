"""The Ollama API (/api/...) through Ollama's own Python library and LangChain's ChatOllama, against `goinfer serve`
on the real default model (SmolLM2) with the real embedding model (MiniLM) behind an API key; the kit's tiny qwen3
for `think`. What a user of those clients sees: the models listed and shown, chats and generations streamed and
not (the same text either way), tool calls, JSON by schema, thinking apart, embeddings, and errors in Ollama's
shape.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import ollama
import pytest

from tests.conftest import SERVER_KEY, in_kit
from tests.test_server import start_server, stop

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 24}
CALLING = {"temperature": 0, "num_predict": 60}  # room for a whole <tool_call> block
BEARER = {"Authorization": f"Bearer {SERVER_KEY}"}
EMBEDDER = "minilm-l6"


def get_weather(city: str) -> str:
    """Get the current weather for a city.

    Args:
      city: The name of the city
    """
    return "sunny"


def _call(city: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                           "arguments": {"city": city}}}]}


# Two earlier turns that called the tool: SmolLM2 (never trained on tools) then calls it for Paris too, greedily.
WEATHER = [{"role": "user", "content": "What is the weather in Rome?"}, _call("Rome"),
           {"role": "user", "content": "What is the weather in Berlin?"}, _call("Berlin"),
           {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_gguf):
    s = start_server(tmp_path_factory.mktemp("serve-ollama") / "serve.log", "--model", str(smollm2_gguf),
                     "--embed-model", EMBEDDER, "--api-key", SERVER_KEY)
    yield s
    stop(s)


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served.url, headers=BEARER, timeout=300)


@pytest.fixture(scope="module")
def name(smollm2_gguf) -> str:
    return smollm2_gguf.stem


# ---------------------------------------------------------------------------------------------- models

def test_list_show_ps_and_version_describe_the_served_models(client, name):
    models = {m.model: m for m in client.list().models}
    assert set(models) == {name, EMBEDDER}
    smol = models[name]
    assert smol.size > 90_000_000 and len(smol.digest) == 64 and smol.modified_at is not None
    assert (smol.details.format, smol.details.family, smol.details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert smol.details.parameter_size == "135M"
    shown = client.show(name + ":latest")  # Ollama's default tag names the same model
    assert shown.capabilities == ["completion", "tools"] and "im_start" in shown.template
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] > 0
    assert shown.modelinfo["general.parameter_count"] == 134_515_008
    assert client.show(EMBEDDER).capabilities == ["embedding"]
    running = {m.model: m for m in client.ps().models}
    assert running[name].context_length == shown.modelinfo["llama.context_length"]
    version = httpx.get(client._client.base_url.join("/api/version"), headers=BEARER).json()["version"]
    assert [int(p) for p in version.split(".")] >= [0, 9, 0]


# ---------------------------------------------------------------------------------------------- generating

def test_a_chat_streamed_says_what_it_says_whole(client, name):
    whole = client.chat(model=name, messages=ASK, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.eval_count == GREEDY["num_predict"] and whole.prompt_eval_count > 10
    assert whole.total_duration >= whole.eval_duration > 0 and whole.load_duration == 0
    parts = list(client.chat(model=name, messages=ASK, options=GREEDY, stream=True))
    assert all(p.message is not None and p.message.content is not None for p in parts)
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    last = parts[-1]
    assert last.message.content == "" and last.eval_count == whole.eval_count and last.done_reason == "length"
    assert "".join(p.message.content for p in parts) == whole.message.content != ""


def test_generate_templates_the_prompt_unless_raw(client, name):
    r = client.generate(model=name, prompt="What is the capital of France?", options=GREEDY)
    chat = client.chat(model=name, messages=ASK, options=GREEDY)
    assert r.response == chat.message.content  # a prompt is one user turn through the chat template
    parts = list(client.generate(model=name, prompt="The capital of France is", raw=True, options=GREEDY,
                                 stream=True))
    assert parts[-1].done and parts[-1].response == "" and "".join(p.response for p in parts).strip()
    system = client.generate(model=name, prompt="Hi", system="Answer in French.", options=GREEDY)
    assert system.response and system.response != client.generate(model=name, prompt="Hi", options=GREEDY).response


def test_options_reach_the_sampler(client, name):
    short = client.chat(model=name, messages=ASK, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    first = client.chat(model=name, messages=ASK, options=GREEDY).message.content
    stop_at = first.split()[1]
    stopped = client.chat(model=name, messages=ASK, options={**GREEDY, "stop": [stop_at]})
    assert stopped.done_reason == "stop" and stop_at not in stopped.message.content
    seeded = [client.chat(model=name, messages=ASK, options={"temperature": 1.5, "seed": 7, "num_predict": 12})
              .message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    # loader and runtime options are accepted and change nothing
    same = client.chat(model=name, messages=ASK, options={**GREEDY, "num_ctx": 2048, "num_thread": 2,
                                                          "num_gpu": 0, "use_mmap": True, "typical_p": 1.0})
    assert same.message.content == first


def test_a_tool_call_comes_back_as_an_object_streamed_and_not(client, name):
    # (the arguments the tiny model writes besides city depend on the CPU's rounding: an extra one is no fault of
    # the wire format; the streamed call is the same call)
    r = client.chat(model=name, messages=WEATHER, tools=[get_weather], options=CALLING)
    whole = [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls]
    assert len(whole) == 1 and whole[0][0] == "get_weather" and whole[0][1]["city"] == "Paris"
    assert r.message.content == "" and r.done_reason == "stop"
    parts = list(client.chat(model=name, messages=WEATHER, tools=[get_weather], options=CALLING, stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == whole
    # the call answered: a tool message by tool_name, and the model goes on
    after = client.chat(model=name, messages=WEATHER + [r.message, {"role": "tool", "content": "sunny",
                                                                    "tool_name": "get_weather"}], options=CALLING)
    assert after.message.content and not after.message.tool_calls


def test_format_gives_json_by_schema(client, name):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}, "country": {"type": "string"}},
              "required": ["capital", "country"]}
    r = client.chat(model=name, messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
                    format=schema, options={"temperature": 0})
    jsonschema.validate(json.loads(r.message.content), schema)
    # format "json": any object. A 135M model may run on inside one (its greedy path differs from CPU to CPU, as
    # 8-bit activations make it): a whole object when it ends, an object's start when num_predict cuts it.
    r = client.generate(model=name, prompt="Give the capital of France as JSON.", format="json",
                        options={"temperature": 0, "num_predict": 64})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.response), dict)
    else:
        assert r.done_reason == "length" and r.response.startswith("{") and r.eval_count == 64


def test_a_request_without_a_prompt_loads_the_model(client, name):
    assert client.generate(model=name).done_reason == "load"
    assert client.chat(model=name, messages=[]).done_reason == "load"
    assert client.generate(model=name, keep_alive=0).done_reason == "unload"


def test_embed_and_the_older_embeddings_route(client, served):
    texts = ["The cat sat on the mat.", "A feline rested on the rug."]
    e = client.embed(model=EMBEDDER, input=texts)
    vectors = np.array(e.embeddings)
    assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert e.prompt_eval_count > 10
    openai_side = httpx.post(served.url + "/v1/embeddings", headers=BEARER,
                             json={"model": EMBEDDER, "input": texts}, timeout=60).json()
    assert np.allclose(vectors, [d["embedding"] for d in openai_side["data"]], atol=1e-6)
    old = client.embeddings(model=EMBEDDER, prompt=texts[0])
    assert np.allclose(old.embedding, vectors[0], atol=1e-6)
    short = np.array(client.embed(model=EMBEDDER, input=texts[0], dimensions=64).embeddings)
    assert short.shape == (1, 64) and np.isclose(np.linalg.norm(short), 1, atol=1e-5)


# ---------------------------------------------------------------------------------------------- errors

def test_errors_come_in_ollamas_shape(client, served, name):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=ASK)
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=ASK, options={"tfs_z": 0.5})
    assert e.value.status_code == 400 and "options.tfs_z" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        list(client.chat(model=name, messages=ASK, options={"num_predikt": 5}, stream=True))
    assert e.value.status_code == 400 and "options.num_predikt" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])
    assert e.value.status_code == 400 and "messages[0].images" in e.value.error
    keyless = ollama.Client(host=served.url, timeout=60)
    with pytest.raises(ollama.ResponseError) as e:
        keyless.list()
    assert e.value.status_code == 401 and "API key" in e.value.error
    r = httpx.get(served.url + "/api/nothing", headers=BEARER)
    assert r.status_code == 404 and "/api/chat" in r.json()["error"]


def test_a_stream_is_ndjson_without_blank_or_keepalive_lines(served, name):
    body = {"model": name, "messages": ASK, "options": GREEDY}
    with httpx.stream("POST", served.url + "/api/chat", headers=BEARER, json=body, timeout=60) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = list(r.iter_lines())
    objects = [json.loads(line) for line in lines]  # every line is one JSON object
    assert objects[-1]["done"] is True and all(o["done"] is False for o in objects[:-1])


# ---------------------------------------------------------------------------------------------- LangChain

def test_langchain_chat_ollama_calls_a_tool(served, name):
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_ollama import ChatOllama

    chat = ChatOllama(model=name, base_url=served.url, temperature=0, num_predict=CALLING["num_predict"],
                      client_kwargs={"headers": BEARER})
    history = []
    for m in WEATHER:
        if m["role"] == "user":
            history.append(HumanMessage(m["content"]))
        else:
            args = m["tool_calls"][0]["function"]["arguments"]
            history.append(AIMessage("", tool_calls=[{"name": "get_weather", "args": args, "id": f"c{len(history)}"}]))
    reply = chat.bind_tools([get_weather]).invoke(history)
    calls = [(c["name"], c["args"]) for c in reply.tool_calls]  # (extra arguments: the CPU's rounding, see above)
    assert len(calls) == 1 and calls[0][0] == "get_weather" and calls[0][1]["city"] == "Paris"
    assert chat.invoke("What is the capital of France?").content


# ---------------------------------------------------------------------------------------------- thinking

@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    model = in_kit("qwen3", "tiny-qwen3-a.Q8_0.gguf")
    s = start_server(tmp_path_factory.mktemp("serve-ollama-think") / "serve.log", "--model", str(model),
                     "--api-key", SERVER_KEY)
    yield ollama.Client(host=s.url, headers=BEARER, timeout=300), model.stem
    stop(s)


def test_think_puts_the_reasoning_apart(thinker):
    client, kit = thinker
    inside = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "<think>\nOk"}]
    r = client.chat(model=kit, messages=inside, think=True, options={"temperature": 0, "num_predict": 20})
    assert r.message.thinking and "<think>" not in (r.message.content or "")
    parts = list(client.chat(model=kit, messages=inside, think=True, options={"temperature": 0, "num_predict": 20},
                             stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    assert "thinking" in client.show(kit).capabilities
    off = client.chat(model=kit, messages=[{"role": "user", "content": "Hello"}], think=False,
                      options={"temperature": 0, "num_predict": 8})
    assert not off.message.thinking


# ---------------------------------------------------------------------------------------------- pull and delete

@pytest.fixture(scope="module")
def admin_client(tmp_path_factory, smollm2_gguf):
    s = start_server(tmp_path_factory.mktemp("serve-ollama-admin") / "serve.log", "--model", str(smollm2_gguf),
                     "--api-key", SERVER_KEY, "--allow-admin")
    yield ollama.Client(host=s.url, headers=BEARER, timeout=300)
    stop(s)


def test_pull_serves_a_model_and_delete_stops_serving_it(admin_client):
    steps = [p.status for p in admin_client.pull("smollm2-135m", stream=True)]  # a built-in name, in the cache
    assert steps[0] == "pulling smollm2-135m" and steps[-1] == "success"
    assert "smollm2-135m" in {m.model for m in admin_client.list().models}
    assert admin_client.chat(model="smollm2-135m:latest", messages=ASK, options=GREEDY).message.content
    assert admin_client.pull("smollm2-135m").status == "success"  # served already: at once
    assert admin_client.delete("smollm2-135m").status == "success"
    assert "smollm2-135m" not in {m.model for m in admin_client.list().models}
    with pytest.raises(ollama.ResponseError) as e:
        admin_client.delete("smollm2-135m")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        admin_client.pull("llama3.2:3b", stream=False)  # Ollama's registry: not a reference goinfer takes
    assert e.value.status_code == 400 and "llama3.2" in e.value.error


def test_pull_needs_allow_admin(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("smollm2-135m", stream=False)
    assert e.value.status_code == 403 and "--allow-admin" in e.value.error
