"""Thinking over HTTP, with the official SDKs against `goinfer serve`.

The default model (SmolLM2: its template does not think) takes every thinking control and replayed reasoning with
a 200, and continues a trailing assistant message. The kit's tiny qwen3 GGUF (its template switches thinking with
enable_thinking; random weights, greedy) shows the split on every route: an assistant prefill opens the block, the
reasoning comes apart from the answer, streamed and not, the same on chat/completions, messages and responses.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.conftest import KIT as FAMILIES, SERVER_KEY, in_kit
from tests.test_server import start_server, stop

ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PREFILL = {"role": "assistant", "content": "The capital of France is"}
KIT_QWEN3 = FAMILIES / "qwen3" / "tiny-qwen3-a.Q8_0.gguf"
GREEDY = {"temperature": 0}  # the anthropic SDK has no sampling arguments any more; the API still takes them
THINK = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "<think>\nOk"}]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=SERVER_KEY, max_retries=0, timeout=300)


# ---------------------------------------------------------------------------------------------- default model

def test_openai_thinking_controls_and_replayed_reasoning_are_accepted(client, name):
    history = [ASK[0], {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy: Paris."},
               {"role": "user", "content": "And of Italy?"}]
    for extra in ({"chat_template_kwargs": {"enable_thinking": True}}, {"thinking_token_budget": 16},
                  {"reasoning_format": "deepseek"}):
        r = client.chat.completions.create(model=name, messages=history, temperature=0, max_tokens=8,
                                           extra_body=extra)
        assert r.choices[0].message.content
    r = client.chat.completions.create(model=name, messages=history, temperature=0, max_tokens=8,
                                       reasoning_effort="high")
    assert r.choices[0].message.content and getattr(r.choices[0].message, "reasoning_content", None) is None


def test_anthropic_thinking_and_replayed_blocks_are_accepted(claude, name):
    m = claude.messages.create(model=name, max_tokens=2048, messages=ASK, extra_body=GREEDY,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["text"] and "Paris" in m.content[0].text  # the model does not think
    history = [ASK[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Easy.", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "text", "text": "Paris."}]}, {"role": "user", "content": "And of Italy?"}]
    m = claude.messages.create(model=name, max_tokens=16, messages=history, extra_body=GREEDY,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content[0].type == "text" and m.content[0].text


def test_a_trailing_assistant_message_is_continued(client, claude, name):
    r = client.chat.completions.create(model=name, messages=ASK + [PREFILL], temperature=0, max_tokens=12)
    assert r.choices[0].message.content.strip().startswith("Paris")  # only the continuation
    m = claude.messages.create(model=name, max_tokens=12, messages=ASK + [PREFILL], extra_body=GREEDY)
    assert m.content[0].text.strip().startswith("Paris")


# ---------------------------------------------------------------------------------------------- a thinking model

@pytest.fixture(scope="module")
def kit_server(tmp_path_factory):
    model = in_kit("qwen3", KIT_QWEN3.name)
    s = start_server(tmp_path_factory.mktemp("serve-kit") / "serve.log", "--model", str(model), "--no-selftest")
    yield s
    stop(s)


@pytest.fixture(scope="module")
def kit_openai(kit_server):
    return openai.OpenAI(base_url=kit_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


KIT = KIT_QWEN3.stem


def test_chat_completions_split_streamed_and_not(kit_openai):
    r = kit_openai.chat.completions.create(model=KIT, messages=THINK, temperature=0, max_tokens=20)
    message = r.choices[0].message
    reasoning = message.reasoning_content
    assert reasoning and "<think>" not in message.content and "</think>" not in message.content
    assert r.usage.completion_tokens_details.reasoning_tokens >= 1
    pieces = list(kit_openai.chat.completions.create(model=KIT, messages=THINK, temperature=0, max_tokens=20,
                                                     stream=True, stream_options={"include_usage": True}))
    assert pieces[-1].usage.completion_tokens_details.reasoning_tokens == \
        r.usage.completion_tokens_details.reasoning_tokens
    deltas = [c.choices[0].delta for c in pieces if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content


def test_messages_split_into_a_thinking_block_streamed_and_not(kit_server):
    claude = anthropic.Anthropic(base_url=kit_server.url, api_key="none", max_retries=0, timeout=300)
    m = claude.messages.create(model=KIT, max_tokens=20, messages=THINK, extra_body=GREEDY)
    assert [b.type for b in m.content][0] == "thinking" and m.content[0].thinking
    text = "".join(b.text for b in m.content if b.type == "text")
    with claude.messages.stream(model=KIT, max_tokens=20, messages=THINK, extra_body=GREEDY) as s:
        events = list(s)
        final = s.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "thinking_delta" for e in events)
    assert final.content[0].thinking == m.content[0].thinking
    assert "".join(b.text for b in final.content if b.type == "text") == text


def test_responses_put_the_reasoning_in_its_own_item(kit_openai):
    r = kit_openai.responses.create(model=KIT, input=THINK, temperature=0, max_output_tokens=20)
    kinds = [item.type for item in r.output]
    assert kinds[0] == "reasoning" and r.output[0].content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens >= 1
    events = list(kit_openai.responses.create(model=KIT, input=THINK, temperature=0, max_output_tokens=20,
                                              stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == r.output[0].content[0].text
    done = events[-1].response
    assert [item.type for item in done.output] == kinds and done.output_text == r.output_text


def test_a_running_reply_told_to_end_its_thinking_answers_at_once(kit_server):
    import json as _json

    import httpx

    body = {"model": KIT, "messages": THINK, "temperature": 0, "max_tokens": 1500, "thinking_token_budget": 1400,
            "stream": True, "stream_options": {"include_usage": True}}
    reasoning, content, told, usage = "", "", None, None
    with httpx.stream("POST", kit_server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = _json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
            if reasoning and told is None:  # thinking has begun: tell it to stop
                told = httpx.post(kit_server.url + "/v1/chat/completions/control", timeout=30,
                                  json={"id": chunk["id"], "action": "reasoning_end"})
    assert told.status_code == 200 and told.json()["applied"] is True and told.json()["success"] is True
    thought = usage["completion_tokens_details"]["reasoning_tokens"]
    assert thought < 1000 and content  # it stopped thinking long before its budget, and answered
    gone = httpx.post(kit_server.url + "/v1/chat/completions/control", json={"id": chunk["id"],
                                                                               "action": "reasoning_end"}, timeout=30)
    assert gone.status_code == 404  # the reply has ended
    bad = httpx.post(kit_server.url + "/v1/chat/completions/control", json={"id": "x", "action": "pause"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "action"
