"""Thinking models: the prompt rendered as the model's own template renders it (thinking on / off / default, replayed
reasoning, assistant prefill), and the reply split into reasoning and answer, with the budget that leaves room to
answer.

Templates: the real Qwen3, Qwen3.5 and DeepSeek-R1-Distill-Qwen templates (tests/reference_templates.py); the
oracle for every prompt is transformers' own render_jinja_template, fed the conversation as a client sent it.
Generation: the kit's tiny qwen3 GGUF (random weights; `<think>` and `</think>` are single tokens there), greedy,
so every reply is reproducible and the split can be checked against the same reply unsplit.
"""

from __future__ import annotations

import copy
import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

import engine
from engine.api.anthropic import parse_messages_request
from engine.api.openai import parse_chat_request
from engine.api.responses import parse_responses_request
from engine.thinking.budget import thinking_budget
from engine.thinking.plan import ThinkingPlan, ThinkingSettings
from engine.thinking.stream import ReasoningSplitter
from engine.requests.prompts import render_request, thinking_of
from engine.requests.request import Collector, execute, prepare, run
from engine.templates import ChatTemplate
from tests import reference_templates as ref
from tests.conftest import in_kit

QWEN3, QWEN35, DEEPSEEK = "Qwen-Qwen3-0.6B", "Qwen3.5-4B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"
GEMMA4 = "google-gemma-4-31B-it"
TOKENS = {QWEN3: ("", "<|im_end|>"), QWEN35: ("", "<|im_end|>"),
          DEEPSEEK: ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"), GEMMA4: ("<bos>", "<turn|>")}
OPEN_ID, CLOSE_ID = 1993, 1994  # the kit tokenizer's <think> and </think>


@pytest.fixture(scope="module")
def kit():
    return engine.load_model(str(in_kit("qwen3", "tiny-qwen3-a.Q8_0.gguf")), selftest=False)


def with_template(model, name: str):
    """The kit model speaking one real template (a shallow copy: weights and backend shared)."""
    twin = copy.copy(model)
    bos, eos = TOKENS[name]
    twin.template = ChatTemplate(ref.reference_template(name), bos_token=bos, eos_token=eos)
    return twin


def hf(name: str, messages: list[dict], **kwargs) -> str:
    bos, eos = TOKENS[name]
    rendered = render_jinja_template(conversations=[messages], chat_template=ref.reference_template(name),
                                     bos_token=bos, eos_token=eos, **kwargs)
    return rendered[0][0]


def chat(messages, **body):
    return parse_chat_request({"messages": messages, **body})


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
]
EARLIER_REASONING = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
    {"role": "user", "content": "How many letters in cat?"},
]


def _hf_messages(messages):
    """The conversation as a transformers user writes it: a call's arguments as an object."""
    out = copy.deepcopy(messages)
    for m in out:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


# ---------------------------------------------------------------------------------------------- the templates

@pytest.mark.parametrize("name,switch,default", [(QWEN3, True, "free"), (QWEN35, True, "open"),
                                                 (DEEPSEEK, True, "closed")])
def test_thinking_is_read_from_the_template(kit, name, switch, default):
    thinking = thinking_of(with_template(kit, name))
    assert (thinking.open, thinking.close) == ("<think>", "</think>")
    assert (thinking.switch, thinking.default) == (switch, default)
    assert (thinking.open_id, thinking.close_id) == (OPEN_ID, CLOSE_ID)


def test_gemma4s_thought_channel_is_read_from_its_template(kit):
    thinking = thinking_of(with_template(kit, GEMMA4))
    assert (thinking.open, thinking.close) == ("<|channel>thought", "<channel|>")
    assert (thinking.switch, thinking.default) == (True, "closed")  # Gemma 4 does not think unless asked
    split = ReasoningSplitter(thinking.open, thinking.close)
    got = [split.push(p) for p in ("<|channel>", "thought\nWeigh it.", "<channel|>", "Yes.")] + [split.flush()]
    assert ("".join(r for r, _ in got), "".join(a for _, a in got)) == ("Weigh it.", "Yes.")


def test_a_template_without_thinking_is_not_read_as_one(kit, smollm2_gguf):
    assert thinking_of(engine.load_model(str(smollm2_gguf), selftest=False)) is None
    plain = copy.copy(kit)
    plain.template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}<think>x</think>")
    assert thinking_of(plain) is None  # names the delimiters, never switches or opens the block


CASES = {"user": [{"role": "user", "content": "Hello!"}], "tool_loop": TOOL_LOOP,
         "reasoning_before_last_query": EARLIER_REASONING}


# DeepSeek's template writes no tool list (our built-in tool prompt stands in): its tool loop is not compared.
@pytest.mark.parametrize("name,case", [(n, c) for n in (QWEN3, QWEN35, DEEPSEEK, GEMMA4) for c in sorted(CASES)
                                       if c != "tool_loop" or n != DEEPSEEK])
@pytest.mark.parametrize("mode,flag", [("template", None), ("on", True), ("off", False)])
def test_prompts_render_as_transformers_renders_them(kit, name, case, mode, flag):
    messages = CASES[case]
    tools = [TOOL] if case == "tool_loop" else None
    model = with_template(kit, name)
    req = chat(messages, tools=tools) if tools else chat(messages)
    ours = render_request(model, req, ThinkingSettings(mode)).text
    kwargs = {} if flag is None else {"enable_thinking": flag}
    assert ours == hf(name, _hf_messages(messages), tools=tools and [TOOL], add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("name", [QWEN3, QWEN35])
def test_the_request_fields_switch_thinking(kit, name):
    model = with_template(kit, name)
    on = hf(name, CASES["user"], add_generation_prompt=True, enable_thinking=True)
    off = hf(name, CASES["user"], add_generation_prompt=True, enable_thinking=False)
    render = lambda **body: render_request(model, chat(CASES["user"], **body), ThinkingSettings("on")).text  # noqa
    assert render(chat_template_kwargs={"enable_thinking": False}) == off
    assert render(reasoning_effort="none") == off
    assert render(reasoning_effort="high") == on  # any other effort changes nothing
    assert render(response_format={"type": "json_object"}) == off  # constrained from the first token
    body = {"model": "m", "max_tokens": 64, "messages": CASES["user"]}
    assert render_request(model, parse_messages_request({**body, "thinking": {"type": "disabled"}}),
                          ThinkingSettings("on")).text == off
    enabled = parse_messages_request({**body, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert render_request(model, enabled, ThinkingSettings("off")).text == on
    assert enabled.thinking_budget == 1024


def test_asis_writes_no_block_and_drops_replayed_reasoning(kit):
    model = with_template(kit, QWEN35)
    prompt = render_request(model, chat(EARLIER_REASONING[:2] + [{"role": "user", "content": "More?"}]),
                            ThinkingSettings("asis"))
    assert prompt.text.endswith("<|im_start|>assistant\n") and not prompt.inside
    assert "A greeting." not in prompt.text


def test_replayed_reasoning_from_anthropic_blocks_renders_as_reasoning_content(kit):
    model = with_template(kit, QWEN3)
    loop = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "18 C"}]}]
    req = parse_messages_request({"model": "m", "max_tokens": 64, "messages": loop, "tools": [
        {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]})
    text = render_request(model, req).text
    assert "<think>\nI should call the tool.\n</think>" in text and "opaque" not in text
    # Claude Code's shape: tool results and reminder text in one user turn. Not a new query: the reasoning stays.
    loop[2]["content"].append({"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"})
    req = parse_messages_request({"model": "m", "max_tokens": 64, "messages": loop, "tools": [
        {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]})
    text = render_request(model, req).text
    assert "<think>\nI should call the tool.\n</think>" in text and "Be careful." in text


@pytest.mark.parametrize("name", [QWEN3, QWEN35])
def test_a_final_assistant_message_is_continued(kit, name):
    model = with_template(kit, name)
    messages = [{"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "The capital is"}]
    prompt = render_request(model, chat(messages))
    assert prompt.text == hf(name, messages, continue_final_message=True)
    assert not prompt.inside
    opened = render_request(model, chat([messages[0], {"role": "assistant", "content": "<think>\nHmm,"}]))
    assert opened.text.endswith("<think>\nHmm,") and opened.inside  # a prefill that opens the block thinks on


# ---------------------------------------------------------------------------------------------- the split

@pytest.mark.parametrize("pieces,inside,expect", [
    (["<think>", "\nabc", "\n", "</think>", "\n\n", "Answer"], False, ("abc", "Answer")),
    (["<thi", "nk>x</th", "ink>y"], False, ("x", "y")),
    (["Hello <think>"], False, ("", "Hello <think>")),  # the block opens only first thing
    (["\nreason", "ing\n\n"], True, ("reasoning", "")),  # ended inside: all reasoning
    (["a</think>", "b"], True, ("a", "b")),
])
def test_the_splitter(pieces, inside, expect):
    split = ReasoningSplitter("<think>", "</think>", inside)
    got = [split.push(p) for p in pieces] + [split.flush()]
    assert ("".join(r for r, _ in got), "".join(a for _, a in got)) == expect


def test_the_budget_rule():
    plan = ThinkingPlan("<think>", "</think>", True, CLOSE_ID)
    assert thinking_budget(plan, 100) == 75 and thinking_budget(plan, 4) == 2 and thinking_budget(plan, 3) is None
    assert thinking_budget(ThinkingPlan("<think>", "</think>", True, CLOSE_ID, requested=10), 100) == 10
    assert thinking_budget(ThinkingPlan("<think>", "</think>", True, CLOSE_ID, server=40), 100) == 40
    assert thinking_budget(ThinkingPlan("<think>", "</think>", True, CLOSE_ID, server="unlimited"), 100) is None
    assert thinking_budget(ThinkingPlan("<think>", "</think>", True, None), 100) is None  # no single token


# ---------------------------------------------------------------------------------------------- generation

def _reply(model, messages, settings=ThinkingSettings(), **body):
    body.setdefault("temperature", 0)
    return execute(model, chat(messages, logprobs=True, **body), thinking=settings).choices[0]


def _streamed(model, messages, settings=ThinkingSettings(), **body):
    prep = prepare(model, chat(messages, temperature=0, **body), thinking=settings)
    out, pieces = Collector(prep), []
    for d in run(model, prep):
        out.add(d)
        pieces.append(d)
    return out.result().choices[0], pieces


def test_a_reply_opened_by_the_prompt_is_split_and_streams_agree(kit):
    model = with_template(kit, QWEN35)  # its prompt opens the block
    whole = _reply(model, CASES["user"], max_tokens=24)
    choice, pieces = _streamed(model, CASES["user"], max_tokens=24)
    assert whole.reasoning and "<think>" not in whole.text and "</think>" not in whole.text
    assert (choice.reasoning, choice.text) == (whole.reasoning, whole.text)
    assert "".join(d.reasoning for d in pieces) == whole.reasoning
    raw = _reply(model, CASES["user"], max_tokens=24, reasoning_format="none")
    assert raw.reasoning is None and "</think>" in raw.text  # the raw text, nothing split
    assert raw.text.split("</think>")[0].strip() == whole.reasoning
    legacy = _reply(model, CASES["user"], max_tokens=24, reasoning_format="deepseek-legacy")
    assert (legacy.reasoning, legacy.text) == (whole.reasoning, raw.text)


def test_the_budget_forces_the_close_and_an_answer_follows(kit):
    model = with_template(kit, QWEN35)
    free = _reply(model, CASES["user"], max_tokens=40, settings=ThinkingSettings(budget="unlimited"))
    assert free.finish_reason == "length" and free.text == "" and free.reasoning  # ended inside its block
    assert CLOSE_ID not in [t.token for t in free.logprobs]
    forced = _reply(model, CASES["user"], max_tokens=40)  # auto: at most 30 tokens of thinking
    assert [t.token for t in forced.logprobs].index(CLOSE_ID) == 30
    assert forced.reasoning == free.reasoning[:len(forced.reasoning)] and forced.text
    asked = _reply(model, CASES["user"], max_tokens=40, thinking_token_budget=5)
    assert [t.token for t in asked.logprobs].index(CLOSE_ID) == 5 and asked.reasoning_tokens == 6
    short = _reply(model, CASES["user"], max_tokens=3)  # a turn under 4 tokens: no budget
    assert short.text == "" and CLOSE_ID not in [t.token for t in short.logprobs]


def test_a_stop_string_inside_the_thinking_does_not_end_the_reply(kit):
    model = with_template(kit, QWEN35)
    whole = _reply(model, CASES["user"], max_tokens=24)
    stop = whole.reasoning[3:9]
    assert stop and stop not in whole.text
    stopped = _reply(model, CASES["user"], max_tokens=24, stop=[stop])
    assert (stopped.reasoning, stopped.text, stopped.finish_reason) == (whole.reasoning, whole.text,
                                                                         whole.finish_reason)
    raw = _reply(model, CASES["user"], max_tokens=24, stop=[stop], reasoning_format="none")
    assert raw.finish_reason == "stop" and stop not in raw.text  # raw text: the stop string counts


def test_a_prefill_that_opens_the_block_continues_the_thinking(kit):
    model = with_template(kit, QWEN3)
    messages = CASES["user"] + [{"role": "assistant", "content": "<think>\nLet me see."}]
    choice = _reply(model, messages, max_tokens=12)
    assert choice.reasoning and "Let me see." not in choice.reasoning  # only the continuation comes back
    assert [t.token for t in choice.logprobs].index(CLOSE_ID) == 9  # the budget holds for a prefill too


def test_json_requests_render_thinking_off(kit):
    model = with_template(kit, QWEN35)
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
              "additionalProperties": False}
    req = chat(CASES["user"], temperature=0, max_tokens=30,
               response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert render_request(model, req).text.endswith("<think>\n\n</think>\n\n")
    choice = execute(model, req).choices[0]
    assert json.loads(choice.text)["a"] in (1, 2, 3) and not choice.reasoning


def test_the_responses_api_replays_a_reasoning_item(kit):
    model = with_template(kit, QWEN3)
    rr = parse_responses_request({"input": [
        {"type": "message", "role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Greet."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "message", "role": "user", "content": "And?"}], "reasoning": {"effort": "none"}}, lambda _: None)
    assert rr.request.messages[1]["reasoning_content"] == "Greet." and rr.request.thinking == "off"
    assert render_request(model, rr.request).text.endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name,constrained", [(QWEN3, True), (QWEN35, False), (GEMMA4, False)])
def test_auto_tool_calls_are_constrained_where_the_template_asks_for_hermes_json(kit, name, constrained):
    from engine.constrain.grammar import GrammarProcessor
    from engine.requests.request import prepare

    req = chat([{"role": "user", "content": "Weather in Paris?"}], tools=[TOOL])
    procs = prepare(with_template(kit, name), req).choices[0].processors
    # Qwen3 asks for <tool_call>{"name": ...}: the grammar takes over at the opener; Qwen3.5 (XML) and Gemma 4 ask
    # for forms of their own, read afterwards
    assert any(isinstance(p, GrammarProcessor) for p in procs) == constrained
