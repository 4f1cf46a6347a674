"""gpt-oss's Harmony replies: the tokenizer's end of generation, the reply read by channels, reasoning_effort, the
budget's forced final channel, tool calls, and the real gpt-oss template's rendering against transformers'.

Models: the kit's tiny gpt-oss (random weights) as GGUF and as its HF directory given the real template
(openai-gpt-oss-120b.jinja, tests/reference_templates.py). Random weights never write Harmony on their own, so
what a real model writes is scripted where it matters: `Generation` is handed one-hot logits that pick the tokens
of a reply (the model's part is the input; what is read from it is the code under test), and the server tests
check what holds for any output: no markup reaches the user, streamed and whole answers agree, and the budget
forces the final channel at its token.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import openai
import pytest

import engine
from engine.api.openai import parse_chat_request
from engine.generation.generate import Generation
from engine.requests.prompts import render_request, thinking_plan
from engine.thinking.budget import thinking_budget
from engine.thinking.plan import ThinkingSettings
from engine.requests.request import execute
from engine.thinking.harmony import FINAL, HarmonySplitter, is_harmony
from engine.templates.tool_stream import CallArguments, CallStart, ToolCallStream
from engine.templates.tools import parse_tool_calls
from tests import reference_templates as ref
from tests.conftest import in_kit
from tests.test_server import start_server, stop

TEMPLATE = "openai-gpt-oss-120b"
HELLO = [{"role": "user", "content": "Hello"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}

# Replies as gpt-oss writes them after the generation prompt's `<|start|>assistant` (the format of OpenAI's
# harmony documentation), and what the user is to see of each: (reasoning, content).
REPLIES = {
    "answer": ("<|channel|>analysis<|message|>User says hello. Reply politely.<|end|><|start|>assistant"
               "<|channel|>final<|message|>Hello! How can I help you today?",
               ("User says hello. Reply politely.", "Hello! How can I help you today?")),
    "two analyses": ("<|channel|>analysis<|message|>First thought.<|end|><|start|>assistant<|channel|>analysis"
                     "<|message|>Second thought.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
                     ("First thought.\n\nSecond thought.", "Done.")),
    "preamble": ("<|channel|>analysis<|message|>Check.<|end|><|start|>assistant<|channel|>commentary<|message|>"
                 "Let me look that up.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.",
                 ("Check.", "Let me look that up.\n\nIt is sunny.")),
    "no header": ('{"city": "Paris"}', ("", '{"city": "Paris"}')),  # a grammar's JSON from the first token
}
CALL = ("<|channel|>analysis<|message|>Need the weather in Tokyo.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Tokyo"}')


def split(reply: str, size: int) -> tuple[str, str]:
    s = HarmonySplitter("<|start|>assistant")
    parts = [s.push(reply[i:i + size]) for i in range(0, len(reply), size)] + [s.flush()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


@pytest.mark.parametrize("name", list(REPLIES))
def test_a_reply_is_read_by_channels_in_any_pieces(name):
    reply, want = REPLIES[name]
    for size in (1, 2, 3, 5, 11, len(reply)):
        assert split(reply, size) == want, size


def test_a_call_message_is_a_tool_call_whole_and_streamed():
    for size in (1, 4, len(CALL)):
        reasoning, answer = split(CALL, size)
        assert reasoning == "Need the weather in Tokyo."
        content, calls = parse_tool_calls(answer, {"get_weather"})
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                                          {"city": "Tokyo"})]
        reader, events = ToolCallStream({"get_weather"}), []
        for i in range(0, len(answer), size):
            events += reader.push(answer[i:i + size])
        events += reader.finish()
        assert [e.name for e in events if isinstance(e, CallStart)] == ["get_weather"]
        assert json.loads("".join(e.text for e in events if isinstance(e, CallArguments))) == {"city": "Tokyo"}


def test_the_budget_may_close_only_the_analysis():
    s = HarmonySplitter("<|start|>assistant")
    assert s.thinking and s.can_close  # nothing written yet
    s.push("<|channel|>analy")
    assert s.thinking and not s.can_close  # a header half written waits for its <|message|>
    s.push("sis<|message|>Hmm")
    assert s.thinking and s.can_close
    s.push("<|end|><|start|>assistant<|channel|>final<|message|>Hi")
    assert not s.thinking and not s.can_close


# ------------------------------------------------------------------------------------------------- the tokenizer

@pytest.fixture(scope="module")
def kit_gguf():
    return engine.load_model(str(in_kit("gpt_oss", "tiny-gpt-oss-a.Q8_0.gguf")), selftest=False)


@pytest.fixture(scope="module")
def kit_dir(tmp_path_factory):
    """The kit's gpt-oss HF directory, speaking the real gpt-oss template."""
    path = tmp_path_factory.mktemp("gptoss") / "gpt-oss"
    shutil.copytree(in_kit("gpt_oss", "hf"), path)
    config_path = path / "tokenizer_config.json"
    config_path.chmod(0o644)
    config = json.loads(config_path.read_text())
    config["chat_template"] = ref.reference_template(TEMPLATE)
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def kit(kit_dir):
    return engine.load_model(str(kit_dir), selftest=False)


def test_only_return_and_call_end_a_reply_and_markers_are_text(kit_gguf, kit):
    for model in (kit_gguf, kit):  # llama.cpp's rule, from the GGUF and from the HF tokenizer
        tok = model.tokenizer
        ids = {t: tok.encode(t, add_bos=False)[0] for t in ("<|end|>", "<|return|>", "<|call|>", "<|endoftext|>")}
        assert tok.eog_ids == {ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]}
        reply = REPLIES["answer"][0]
        assert tok.decode(tok.encode(reply, add_bos=False), skip_special=True) == reply


def test_phi3s_end_still_ends_a_reply():
    phi3 = engine.load_model(str(in_kit("phi3", "tiny-phi3-a.Q8_0.gguf")), selftest=False)
    end = phi3.tokenizer.encode("<|end|>", add_bos=False)
    assert len(end) == 1 and end[0] in phi3.tokenizer.eog_ids  # no <|return|>/<|call|>: not Harmony


# --------------------------------------------------------------------------------------- scripted generation

def scripted(model, req, reply_ids: list[int], settings=ThinkingSettings()) -> tuple[list, Generation]:
    """Run one Generation of `req` on `model` where the model's logits pick `reply_ids` in turn."""
    prompt = render_request(model, req, settings)
    plan = thinking_plan(model, req, prompt, settings)
    gen = Generation(model, model.tokenizer.encode(prompt.text, add_bos=False), req.options.max_tokens or 64,
                     window=4096, thinking=plan)
    events = []
    for token in reply_ids:
        logits = np.full(model.vocab_size, -10.0, np.float32)
        logits[token] = 10.0
        events.append(gen.next(logits))
        if gen.finished:
            break
    return events, gen


def test_a_scripted_reply_is_split_and_stops_at_return(kit):
    tok = kit.tokenizer
    reply = tok.encode(REPLIES["answer"][0] + "<|return|>", add_bos=False)
    events, gen = scripted(kit, parse_chat_request({"messages": HELLO, "max_tokens": 200}), reply)
    assert gen.finished and events[-1].finish_reason == "stop" and len(events) == len(reply)  # <|end|> went on
    assert ("".join(e.reasoning for e in events), "".join(e.text for e in events)) == REPLIES["answer"][1]
    thinking = [e.thinking for e in events]
    first_answer = len(tok.encode(REPLIES["answer"][0].split("final<|message|>")[0] + "final<|message|>",
                                  add_bos=False))
    assert all(thinking[:first_answer]) and not any(thinking[first_answer:])


def test_a_scripted_call_stops_at_call_and_becomes_a_tool_call(kit):
    reply = kit.tokenizer.encode(CALL + "<|call|><|start|>assistant", add_bos=False)
    req = parse_chat_request({"messages": HELLO, "tools": [WEATHER], "max_tokens": 200})
    events, gen = scripted(kit, req, reply)
    assert events[-1].finish_reason == "stop" and len(events) == len(kit.tokenizer.encode(CALL + "<|call|>",
                                                                                          add_bos=False))
    content, calls = parse_tool_calls("".join(e.text for e in events), {"get_weather"})
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Tokyo"}


def test_the_budget_forces_the_final_channel_at_its_token(kit):
    tok = kit.tokenizer
    analysis = tok.encode("<|channel|>analysis<|message|>" + "thinking more and more " * 20, add_bos=False)
    req = parse_chat_request({"messages": HELLO, "max_tokens": 80, "thinking_token_budget": 40})
    script = analysis + tok.encode("ok", add_bos=False) * 40  # the model's own tokens, forced or not
    events, gen = scripted(kit, req, script)
    final = tok.encode(FINAL, add_bos=False)
    budget = thinking_budget(gen._plan, 80)
    assert budget == 40 - (len(final) - 1)  # the forced headers count as reasoning
    assert [e.token for e in events[budget:budget + len(final)]] == final
    reasoning, answer = "".join(e.reasoning for e in events), "".join(e.text for e in events)
    assert reasoning.startswith("thinking more") and "<|" not in reasoning + answer
    assert answer == tok.decode(script[budget + len(final):len(events)])  # the model's tokens after the forced ones
    assert len(events) == 80 and events[-1].finish_reason == "length"


# ----------------------------------------------------------------------------------------------- rendering

def hf(messages: list[dict], **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template(conversations=[messages], chat_template=ref.reference_template(TEMPLATE),
                                 **kwargs)[0][0]


def test_reasoning_effort_is_written_on_the_reasoning_line(kit):
    assert is_harmony(kit.template.source)
    for effort, line in (("high", "Reasoning: high"), ("LOW", "Reasoning: low"), (None, "Reasoning: medium"),
                         ("none", "Reasoning: medium"), ("extreme", "Reasoning: medium")):
        text = render_request(kit, parse_chat_request({"messages": HELLO, "reasoning_effort": effort})).text
        assert line in text, effort
    assert render_request(kit, parse_chat_request({"messages": HELLO})).text == hf(HELLO, add_generation_prompt=True)


def test_a_tool_loop_renders_as_transformers_renders_it(kit):
    wire = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Tokyo?"},
            {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    req = parse_chat_request({"messages": wire, "tools": [WEATHER]})
    hf_form = [wire[0], wire[1], {"role": "assistant", "thinking": "Need the weather.", "content": "",
                                  "tool_calls": [{"type": "function", "function": {
                                      "name": "get_weather", "arguments": {"city": "Tokyo"}}}]}, wire[3]]
    want = hf(hf_form, tools=[WEATHER], add_generation_prompt=True)
    assert render_request(kit, req).text == want
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Tokyo"}' \
        '<|call|>' in want and "<|channel|>analysis<|message|>Need the weather.<|end|>" in want
    later = wire + [{"role": "assistant", "content": "Clear.", "reasoning_content": "Easy."},
                    {"role": "user", "content": "Thanks"}]
    text = render_request(kit, parse_chat_request({"messages": later, "tools": [WEATHER]})).text
    assert "Easy." not in text and "<|channel|>final<|message|>Clear.<|end|>" in text  # earlier reasoning dropped


# -------------------------------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def served(kit_dir, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("serve-gptoss") / "serve.log", "--model", str(kit_dir),
                     "--no-selftest")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
    stop(s)


def test_served_replies_carry_no_markup_streamed_or_not(served, kit, kit_dir):
    name = kit_dir.name
    r = served.chat.completions.create(model=name, messages=HELLO, temperature=0, max_tokens=24)
    message = r.choices[0].message
    assert message.content and "<|" not in message.content + (getattr(message, "reasoning_content", None) or "")
    pieces = [c.choices[0].delta for c in served.chat.completions.create(
        model=name, messages=HELLO, temperature=0, max_tokens=24, stream=True) if c.choices]
    assert "".join(d.content or "" for d in pieces) == message.content
    raw = served.chat.completions.create(model=name, messages=HELLO, temperature=0, max_tokens=24,
                                         extra_body={"reasoning_format": "none"}).choices[0].message.content
    assert FINAL in raw  # the budget (3/4 of max_tokens) forced the final channel; `none` shows the raw text
    assert raw.split(FINAL)[-1] and message.content.endswith(raw.split(FINAL)[-1])
    same = execute(kit, parse_chat_request({"messages": HELLO, "temperature": 0, "max_tokens": 24}))
    assert same.choices[0].text == message.content


def test_the_anthropic_and_responses_routes_carry_no_markup(served, kit_dir):
    import anthropic

    name = kit_dir.name
    claude = anthropic.Anthropic(base_url=str(served.base_url).removesuffix("/v1/"), api_key="none", max_retries=0)
    m = claude.messages.create(model=name, max_tokens=24, messages=HELLO, extra_body={"temperature": 0})
    text = "".join(b.text for b in m.content if b.type == "text")
    with claude.messages.stream(model=name, max_tokens=24, messages=HELLO, extra_body={"temperature": 0}) as s:
        events = list(s)
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text and streamed == text and "<|" not in text
    r = served.responses.create(model=name, input=HELLO, temperature=0, max_output_tokens=24)
    assert r.output_text and "<|" not in r.output_text


def test_chat_answers_without_markup_and_checks_the_effort(kit, kit_dir):
    from tests.test_cli import goinfer

    r = goinfer("chat", "--model", str(kit_dir), "--prompt", "Hello", "--temp", "0", "--max", "24", "--no-selftest",
                "--reasoning-effort", "high")
    assert r.returncode == 0, r.stderr
    want = execute(kit, parse_chat_request({"messages": HELLO, "temperature": 0, "max_tokens": 24,
                                            "reasoning_effort": "high"})).choices[0].text
    assert r.stdout == want + "\n" and "<|" not in r.stdout + r.stderr
    bad = goinfer("chat", "--model", str(kit_dir), "--prompt", "Hello", "--reasoning-effort", "extreme")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--reasoning-effort" in bad.stderr


def test_decisions_score_gpt_oss_labels_on_its_final_channel(kit):
    from engine.api.decisions import parse_decision_request
    from engine.decisions.prompts import question_prompt

    req = parse_decision_request({"state": "The parcel arrived broken.", "questions": {
        "refund": {"type": "noul", "instructions": "Should we refund?"}}})
    prompt = question_prompt(kit, "chat-v1", req.state, req.questions[0])
    text = kit.tokenizer.decode(prompt.ids, skip_special=True)
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>") and "Reasoning: medium" in text
    assert [kit.tokenizer.decode([i]) for i in prompt.label_ids] == ["Y", "N"]  # the kit vocabulary: first tokens


def test_the_runners_reasoning_format_applies_where_a_request_sets_none(kit):
    from tests.test_cli import goinfer

    body = {"messages": HELLO, "temperature": 0, "max_tokens": 24}
    raw = execute(kit, parse_chat_request(body), thinking=ThinkingSettings(format="none")).choices[0].text
    assert FINAL in raw  # serve --reasoning-format none: the raw text, markers included
    asked = execute(kit, parse_chat_request({**body, "reasoning_format": "auto"}),
                    thinking=ThinkingSettings(format="none")).choices[0].text
    assert "<|" not in asked and asked.endswith(raw.split(FINAL)[1])  # the request's own format wins
    bad = goinfer("serve", "--reasoning-format", "raw")
    assert bad.returncode == 2 and "--reasoning-format" in bad.stderr and bad.stderr.strip().count("\n") == 0


def test_a_json_schema_reply_is_written_on_the_final_channel(kit):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    req = parse_chat_request({"messages": HELLO, "temperature": 0, "max_tokens": 30, "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
    assert render_request(kit, req).text.endswith("<|start|>assistant<|channel|>final<|message|>")
    c = execute(kit, req).choices[0]
    assert json.loads(c.text) in ({"ok": True}, {"ok": False}) and not c.reasoning
