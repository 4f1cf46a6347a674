"""Every field of Ollama's /api/chat and /api/generate bodies does what docs/server.md's table says (the Ollama API
section): mapped onto goinfer's request, accepted without effect, accepted at a neutral value only, or refused
naming the field. Parsing only: no model, no server (tests/test_ollama.py runs the real clients)."""

from __future__ import annotations

import pytest

from engine.api.ollama import NO_LIMIT, loads_only, parse_chat, parse_embed, parse_embeddings, parse_generate
from engine.errors import RequestError

ASK = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return parse_chat({"model": "m", "messages": ASK, **fields})


@pytest.mark.parametrize("option, value, field, expected", [
    ("temperature", 0.3, "temperature", 0.3), ("top_p", 0.9, "top_p", 0.9), ("top_k", 7, "top_k", 7),
    ("min_p", 0.05, "min_p", 0.05), ("seed", 42, "seed", 42), ("stop", ["\n", "END"], "stop", ("\n", "END")),
    ("presence_penalty", 0.5, "presence_penalty", 0.5), ("frequency_penalty", 0.25, "frequency_penalty", 0.25),
    ("repeat_penalty", 1.1, "repetition_penalty", 1.1), ("repeat_last_n", 32, "penalty_last_n", 32),
    ("repeat_last_n", -1, "penalty_last_n", -1), ("num_predict", 12, "max_tokens", 12),
    ("num_predict", -1, "max_tokens", NO_LIMIT), ("num_predict", -2, "max_tokens", NO_LIMIT),
])
def test_sampling_options_map_onto_the_request(option, value, field, expected):
    assert getattr(chat(options={option: value}).options, field) == expected


def test_without_num_predict_it_generates_to_the_end_as_ollama_does():
    assert chat().options.max_tokens == NO_LIMIT


@pytest.mark.parametrize("option, value", [
    ("num_ctx", 8192), ("num_batch", 512), ("num_gpu", 99), ("main_gpu", 0), ("low_vram", True), ("numa", False),
    ("num_thread", 8), ("use_mmap", True), ("use_mlock", False), ("vocab_only", False), ("logits_all", False),
    ("embedding_only", False), ("f16_kv", True), ("num_keep", 4), ("penalize_newline", True),
    ("typical_p", 1.0), ("tfs_z", 1.0), ("mirostat", 0), ("mirostat_tau", 5.0), ("mirostat_eta", 0.1),
])
def test_runtime_options_and_neutral_samplers_are_accepted_without_effect(option, value):
    assert chat(options={option: value}) == chat()


def test_tail_free_sampling_is_refused_away_from_neutral():
    with pytest.raises(RequestError, match="options.tfs_z: this sampler is not supported") as e:
        chat(options={"tfs_z": 0.5})
    assert e.value.param == "options.tfs_z"


def test_typical_p_and_mirostat_run_llamacpps_samplers():
    chain = chat(options={"typical_p": 0.9}).options.chain
    assert chain.typical_p == 0.9 and chain.needed
    chain = chat(options={"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2}).options.chain
    assert (chain.mirostat, chain.mirostat_tau, chain.mirostat_eta) == (2, 3.0, 0.2)
    with pytest.raises(RequestError) as e:
        chat(options={"mirostat": 4})
    assert e.value.param == "options.mirostat"


@pytest.mark.parametrize("options, param", [
    ({"num_predictt": 3}, "options.num_predictt"), ({"num_predict": 0}, "options.num_predict"),
    ({"num_predict": "5"}, "options.num_predict"), ({"temperature": "hot"}, "options.temperature"),
    ({"repeat_penalty": 0}, "options.repeat_penalty"), ({"top_p": 2}, "options.top_p"),
    ({"repeat_last_n": -5}, "options.repeat_last_n"),
])
def test_bad_options_are_refused_by_their_ollama_name(options, param):
    with pytest.raises(RequestError) as e:
        chat(options=options)
    assert e.value.param == param and param in str(e.value)


def test_top_level_fields():
    assert chat(stream=False).stream is False and chat().stream is True  # Ollama streams by default
    assert chat(model="m:latest").model == "m"  # the default tag names the same model
    assert chat(keep_alive="10m") == chat() and chat(keep_alive=0) == chat()
    assert chat(format="json").grammar.what == "json_object" and chat(format="").grammar is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(format=schema).grammar.what == "json_schema"
    assert chat(think=True).thinking == "on" and chat(think=False).thinking == "off"
    assert chat(think="high").thinking == "on" and chat(think="high").reasoning_effort == "high"
    assert chat().thinking is None
    r = chat(logprobs=True, top_logprobs=3)
    assert r.logprobs and r.top_logprobs == 3
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    assert chat(tools=tools).tool_names == {"f"} and not chat(tools=[]).calls_tools


@pytest.mark.parametrize("fields, param", [
    ({"format": "yaml"}, "format"), ({"think": "max"}, "think"), ({"tools": "f"}, "tools"),
    ({"format": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "format"), ({"n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "messages[0].images"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages[0].name"),
])
def test_chat_refusals_name_ollamas_field(fields, param):
    with pytest.raises(RequestError) as e:
        parse_chat({"model": "m", "messages": ASK, **fields})
    assert e.value.param == param


def test_messages_tool_calls_thinking_and_tool_results():
    r = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "thinking": "Call it.",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]})
    assistant, tool = r.messages[1], r.messages[2]
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert assistant["reasoning_content"] == "Call it." and tool["content"] == "sunny"


def test_generate_fields():
    r = parse_generate({"model": "m", "prompt": "Hi", "system": "Be brief."})
    assert r.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    raw = parse_generate({"model": "m", "prompt": "Hi", "system": "ignored", "raw": True})
    assert raw.prompt == "Hi" and raw.messages is None  # raw: the prompt as it is, no template, no system
    assert parse_generate({"model": "m", "prompt": "Hi", "images": [], "context": []}).messages[-1]["content"] == "Hi"
    lp = parse_generate({"model": "m", "prompt": "Hi", "raw": True, "logprobs": True, "top_logprobs": 2})
    assert lp.logprobs and lp.top_logprobs == 2
    for body, param in (({"suffix": "end"}, "suffix"), ({"template": "{{ .Prompt }}"}, "template"),
                        ({"context": [1, 2]}, "context"), ({"images": ["aGk="]}, "images"),
                        ({"raw": "yes"}, "raw"), ({"raw": True, "think": True}, "think"),
                        ({"system": 3}, "system"), ({"width": 512}, "width")):
        with pytest.raises(RequestError) as e:
            parse_generate({"model": "m", "prompt": "Hi", **body})
        assert e.value.param == param


def test_a_body_without_a_prompt_only_loads():
    assert loads_only("/api/generate", {"model": "m"}) and loads_only("/api/generate", {"model": "m", "prompt": ""})
    assert loads_only("/api/chat", {"model": "m", "messages": []}) and loads_only("/api/chat", {"model": "m"})
    assert not loads_only("/api/generate", {"model": "m", "prompt": "Hi"})
    assert not loads_only("/api/chat", {"model": "m", "messages": ASK})


def test_embed_fields():
    r = parse_embed({"model": "e", "input": ["a", "b"], "truncate": True, "keep_alive": "1m", "dimensions": 8,
                     "options": {"num_thread": 2}})
    assert r.inputs == ("a", "b") and r.dimensions == 8 and r.model == "e"
    assert parse_embeddings({"model": "e", "prompt": "a"}).inputs == ("a",)
    with pytest.raises(RequestError) as e:
        parse_embeddings({"model": "e"})
    assert e.value.param == "prompt"
    with pytest.raises(RequestError) as e:
        parse_embed({"model": "e", "input": "a", "encoding_format": "base64"})
    assert e.value.param == "encoding_format"
