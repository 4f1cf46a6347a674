"""Tool calls read while they are generated (engine.templates.tool_stream, json_stream) and the three streams
built on them, without a model: whatever the split into pieces, what a client receives joins up to what the
whole-answer parser (parse_tool_calls, the non-streamed path) reads, and the arguments arrive piece by piece,
before the block's closing markup is even generated."""

from __future__ import annotations

import json
import random

import pytest

from engine.api import anthropic, responses, sse
from engine.requests.request import Delta
from engine.templates.json_stream import JsonLexer, dumps
from engine.templates.tool_stream import CallArguments, CallEnd, CallStart, Text, ToolCallStream
from engine.templates.tools import parse_tool_calls

NAMES = {"get_weather", "get_time"}
# What a Hermes-prompted model writes: text, then two calls spaced and escaped its own way.
HERMES = ('Let me look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "S\\u00e3o Paulo", '
          '"unit": "celsius", "days": [1, 2.50, 1e2], "alerts": true, "note": "a<b \\"q\\" \\ud83c\\udf27"}}\n'
          '</tool_call>\n<tool_call>\n{"name":"get_time","arguments":{"zone":"America/Sao_Paulo"}}\n</tool_call>')


def read(pieces: list[str], names=NAMES) -> tuple[str, list[tuple[str, str]], list]:
    """(content, [(name, arguments)], events) as a client would join them up."""
    stream = ToolCallStream(names)
    events = [e for p in pieces for e in stream.push(p)] + stream.finish()
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArguments):
            calls[e.index][1] += e.text
    content = "".join(e.text for e in events if isinstance(e, Text))
    return content, [(n, a) for n, a in calls.values()], events


def parsed(text: str, names=NAMES) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, names)
    return content, [(c.name, c.arguments) for c in calls]


def splits(text: str) -> list[list[str]]:
    """The text cut in two at every position, one character at a time, and at random places."""
    rng = random.Random(7)
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, 24)))
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


def test_two_calls_read_alike_at_every_split_point():
    want = parsed(HERMES)
    assert want[0] == "Let me look both up." and [n for n, _ in want[1]] == ["get_weather", "get_time"]
    for pieces in splits(HERMES):
        content, calls, events = read(pieces)
        assert (content, calls) == want, pieces
        ends = [e for e in events if isinstance(e, CallEnd)]
        starts = [e for e in events if isinstance(e, CallStart)]
        assert [e.call.id for e in ends] == [e.id for e in starts] and len(set(e.id for e in starts)) == 2
        assert [e.call.arguments for e in ends] == [a for _, a in want[1]]
        assert not any("tool_call" in e.text for e in events if isinstance(e, CallArguments))


def test_arguments_stream_token_by_token_before_the_close_is_generated():
    stream, seen = ToolCallStream(NAMES), []
    for i, ch in enumerate(HERMES):
        seen += [(i, e) for e in stream.push(ch)]
    seen += [(len(HERMES), e) for e in stream.finish()]
    first_close = HERMES.index("</tool_call>")
    weather_args = [(i, e) for i, e in seen if isinstance(e, CallArguments) and e.index == 0]
    assert len(weather_args) > 20 and all(i < first_close for i, _ in weather_args)
    start = next(i for i, e in seen if isinstance(e, CallStart))
    assert start == HERMES.index('"get_weather"') + len('"get_weather"') - 1  # as soon as the name is read
    # each call: start, arguments..., end; the second starts after the first ends
    calls = [(type(e).__name__, e.index) for _, e in seen if not isinstance(e, Text)]
    for index in (0, 1):
        kinds = [k for k, i in calls if i == index]
        assert kinds[0] == "CallStart" and kinds[-1] == "CallEnd" and set(kinds[1:-1]) == {"CallArguments"}
    assert calls.index(("CallEnd", 0)) < calls.index(("CallStart", 1))


def test_only_what_may_be_markup_is_held_back():
    stream = ToolCallStream(NAMES)
    assert stream.push("2 <") == [Text("2")]  # " <" may open a call
    assert stream.push(" 3, surely") == [Text(" < 3, surely")]
    assert stream.push(" <tool") == []
    assert stream.push("s> are fine") == [Text(" <tools> are fine")]
    assert stream.finish() == [] and not stream.started
    stream = ToolCallStream(NAMES)
    start, args = stream.push('<tool_call>{"name":"get_time","arguments":{"zone":"UTC"}}</tool')
    assert (start.name, args) == ("get_time", CallArguments(0, '{"zone": "UTC"}'))  # the close may still come
    assert [type(e) for e in stream.push("_call>")] == [CallEnd] and stream.finish() == []
    assert read(["Hi ", "<tool_call>", "nothing</tool_call>"])[0] == "Hi <tool_call>nothing</tool_call>"


def test_what_the_parser_refuses_stays_text_at_every_split_point():
    for text in ['I will call <tool_call>{"name": "get_stock", "arguments": {}}</tool_call> now',  # not a given tool
                 "<tool_call>Sorry, I cannot.</tool_call>",  # not JSON
                 "No calls here, 1 < 2 <tool but not a call.  ",
                 '{"name": "get_time", "parameters": {"zone": "UTC"}}',  # Llama 3: held, parsed whole
                 '  [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',  # Mistral
                 '[TOOLS] is not Mistral\'s marker',
                 '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>',  # name last: whole
                 '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',  # a string
                 '<tool_call>{"name": "get_time"}</tool_call>',  # no arguments: {}
                 'x <tool_call>{"name": "get_time", "arguments": {}}</tool_call> dropped <tool_call>'
                 '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> dropped too']:
        want = parsed(text)
        for pieces in splits(text):
            assert read(pieces)[:2] == want, (text, pieces)


def test_a_call_cut_off_still_arrives_with_what_it_got():
    # Once sent, a call cannot be taken back: cut off by max_tokens it ends with the arguments it got (OpenAI
    # does the same), where the non-streamed parser, seeing no complete call, returns the text.
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    content, calls, events = read(list(text))
    assert content == "" and calls == [("get_weather", '{"city": "Par')]
    assert isinstance(events[-1], CallEnd)


def test_json_is_rewritten_as_json_dumps_writes_it_at_every_split_point():
    text = (' {"a" :1,"b":[ -0, 2.50,1E400,NaN, true,null,{} ,[]],"c":"\\u00e9\\n\\t\\"\\\\\\/\\ud83d\\ude00\\ud800x",'
            '"d" : {"e": "<\\/tool_call>"}} ')
    want = json.dumps(json.loads(text), ensure_ascii=False)
    for pieces in splits(text):
        lexer = JsonLexer()
        assert "".join(dumps(lexer.feed(p)) for p in pieces) == want, pieces


# ---------------------------------------------------------------------------------------------- on the wire

def deltas(text: str, finish: str = "stop") -> list[Delta]:
    return [Delta(0, ch, None, finish if i == len(text) - 1 else None, 1) for i, ch in enumerate(text)]


def test_chat_chunks_send_id_and_name_first_then_the_arguments_piece_by_piece():
    info = sse.Stream("chat", "chatcmpl-1", 0, "m", tool_names=frozenset(NAMES))
    chunks = [c for i, d in enumerate(deltas(HERMES)) for c in info.chunks(d, first=i == 0)]
    content, calls, finish = "", {}, None
    for c in chunks:
        delta, finish = c["choices"][0]["delta"], c["choices"][0]["finish_reason"] or finish
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            if tc["index"] not in calls:
                assert set(tc) == {"index", "id", "type", "function"} and tc["function"]["arguments"] == ""
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]][1] += tc["function"]["arguments"]
    assert (content, [tuple(v) for v in calls.values()]) == parsed(HERMES) and finish == "tool_calls"
    assert sum(1 for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])) > 20


def named_events(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            name, payload = block.split("\n", 1)
            out.append((name.removeprefix("event: "), json.loads(payload.removeprefix("data: "))))
    return out


def test_anthropic_tool_use_blocks_stream_input_json_deltas():
    info = anthropic.MessageStream("msg_1", "m", 5, frozenset(NAMES))
    events = named_events(info.start() + b"".join(info.events(d) for d in deltas(HERMES)))
    kinds = [k for k, _ in events]
    assert kinds[:4] == ["message_start", "content_block_start", "ping", "content_block_delta"]
    starts = [e for k, e in events if k == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use", "tool_use"]
    assert starts[1]["content_block"]["input"] == {} and starts[1]["content_block"]["id"].startswith("toolu_")
    for block in (1, 2):
        pieces = [e["delta"]["partial_json"] for k, e in events
                  if k == "content_block_delta" and e["index"] == block]
        assert len(pieces) >= 2 and "".join(pieces) == parsed(HERMES)[1][block - 1][1]
    assert [e["index"] for k, e in events if k == "content_block_stop"] == [0, 1, 2]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use" and kinds[-1] == "message_stop"


def test_responses_function_calls_stream_argument_deltas():
    tools = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in sorted(NAMES)]
    rr = responses.parse_responses_request({"model": "m", "input": "hi", "tools": tools, "stream": True},
                                           lambda _: None)
    info = responses.ResponseStream(rr, "resp_1", "m", 0, frozenset(NAMES))
    events = named_events(b"".join(info.events(d) for d in deltas(HERMES)))
    added = [e for k, e in events if k == "response.output_item.added"]
    assert [(a["output_index"], a["item"]["type"]) for a in added] == [(0, "message"), (1, "function_call"),
                                                                      (2, "function_call")]
    assert added[1]["item"]["arguments"] == "" and added[1]["item"]["status"] == "in_progress"
    kinds = [k for k, _ in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    for i, (name, args) in enumerate(parsed(HERMES)[1], start=1):
        pieces = [e["delta"] for k, e in events if k == "response.function_call_arguments.delta"
                  and e["output_index"] == i]
        done = [e for k, e in events if k.endswith(".done") and e.get("output_index") == i]
        assert len(pieces) >= 2 and "".join(pieces) == args
        assert done[0]["arguments"] == args and done[1]["item"]["arguments"] == args and done[1]["item"]["name"] == name
        assert {e["item_id"] for k, e in events if k.startswith("response.function_call_arguments")
                and e["output_index"] == i} == {added[i]["item"]["id"]}
    assert [e["sequence_number"] for _, e in events] == sorted(e["sequence_number"] for _, e in events)


@pytest.mark.parametrize("text", ["Just text.", ""])
def test_without_calls_the_streams_are_as_before(text):
    info = anthropic.MessageStream("msg_1", "m", 5, frozenset(NAMES))
    data = b"".join(info.events(d) for d in deltas(text)) if text else info.events(Delta(0, "", None, "stop", 1))
    kinds = [k for k, _ in named_events(data)]
    assert kinds.count("content_block_start") == 1 and "input_json_delta" not in data.decode()
    assert named_events(data)[-2][1]["delta"]["stop_reason"] == "end_turn"


# ------------------------------------------------------------------------------- Qwen3.5's own (XML) form

SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"},
    "alerts": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "integer"}},
    "unit": {"type": ["string", "null"]}}}, "get_time": {"type": "object", "properties": {}}}
# As Qwen3.5's template asks for it (and writes history calls back): a line per tag, values unquoted.
XML = ("I will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
       "<parameter=zip>\n01310\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=alerts>\ntrue\n"
       "</parameter>\n<parameter=hours>\n[6, 12]\n</parameter>\n<parameter=note>\nline one\nline two\n"
       "</parameter>\n<parameter=unit>\n123\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
       "<function=get_time>\n</function>\n</tool_call>")


def test_the_xml_form_is_typed_by_each_tools_schema():
    content, calls = parsed(XML, SCHEMAS)
    assert content == "I will check." and [n for n, _ in calls] == ["get_weather", "get_time"]
    # a string parameter keeps its text ("01310", "123" stay strings); the others are read as JSON; a parameter
    # the schema does not name is text unless it is JSON of another kind
    assert json.loads(calls[0][1]) == {"city": "São Paulo", "zip": "01310", "days": 3, "alerts": True,
                                       "hours": [6, 12], "note": "line one\nline two", "unit": "123"}
    assert json.loads(calls[1][1]) == {}
    assert parsed(XML, {"get_time": {}})[1] == []  # a tool that was not given is not a call: all stays text
    assert parsed(XML, None)[1][0][0] == "get_weather"  # no names to check against: any call is read


def test_the_xml_form_streams_like_the_whole_answer_at_every_split_point():
    want = parsed(XML, SCHEMAS)
    for pieces in splits(XML):
        content, calls, _ = read(pieces, SCHEMAS)
        assert (content, calls) == want, pieces


def test_a_broken_xml_block_is_text():
    broken = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
    assert parsed(broken, SCHEMAS) == (broken, [])
    assert read([broken[:30], broken[30:]], SCHEMAS)[:2] == (broken, [])


def history_block(template: str, args: dict, opener: str, closer: str) -> str:
    """The call block a real template writes for an earlier assistant call with `args` (sent as a JSON string)."""
    from engine.templates import ChatTemplate
    from engine.templates.tools import render_messages
    from tests import reference_templates as ref

    source = ref.reference_template(template)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]}
    messages, _ = render_messages([{"role": "user", "content": "Weather?"}, call], None, source)
    text = ChatTemplate(source).render(messages, add_generation_prompt=False)
    return text[text.index(opener):text.index(closer) + len(closer)]


def test_a_history_call_rendered_by_qwen35s_template_reads_back():
    args = {"city": "São Paulo", "zip": "01310", "days": 3, "hours": [6, 12]}
    block = history_block("Qwen3.5-4B", args, "<tool_call>", "</tool_call>")
    assert "<function=get_weather>" in block and json.loads(parsed(block, SCHEMAS)[1][0][1]) == args


# ------------------------------------------------------------------------------ Gemma 4's own form

GEMMA4 = ('Checking.<|tool_call>call:get_weather{alerts:true,city:<|"|>São Paulo, SP<|"|>,days:3,hours:[6,12],'
          'opts:{deep:false,tags:[<|"|>a:b<|"|>]},zip:<|"|>01310<|"|>}<tool_call|>'
          '<|tool_call>call:get_time{}<tool_call|>')


def test_gemma4_calls_read_whole_and_at_every_split_point():
    want = parsed(GEMMA4)
    assert want[0] == "Checking." and [n for n, _ in want[1]] == ["get_weather", "get_time"]
    assert json.loads(want[1][0][1]) == {"alerts": True, "city": "São Paulo, SP", "days": 3, "hours": [6, 12],
                                         "opts": {"deep": False, "tags": ["a:b"]}, "zip": "01310"}
    for pieces in splits(GEMMA4):
        assert read(pieces)[:2] == want, pieces


def test_a_broken_or_unknown_gemma4_call_is_text():
    broken = "<|tool_call>call:get_weather{city:<|\"|>Paris}<tool_call|>"  # an unclosed string
    assert parsed(broken) == (broken, []) and read([broken[:20], broken[20:]])[:2] == (broken, [])
    other = '<|tool_call>call:launch{target:<|"|>moon<|"|>}<tool_call|>'
    assert parsed(other) == (other, [])  # a tool that was not given


def test_a_history_call_rendered_by_gemma4s_template_reads_back():
    args = {"city": "São Paulo", "days": 3, "hours": [6, 12], "opts": {"deep": True}}
    block = history_block("google-gemma-4-31B-it", args, "<|tool_call>", "<tool_call|>")
    assert json.loads(parsed(block)[1][0][1]) == args


def test_an_unwrapped_call_with_text_after_it_is_that_one_call():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}\nI have asked for the weather.'
    assert parsed(text) == ("", [("get_weather", '{"city": "Paris"}')])
    for pieces in splits(text)[::7]:
        assert read(pieces)[:2] == parsed(text)
    assert parsed(text, None)[1] == []  # with no tools to check against, never a call
    other = '{"name": "launch", "arguments": {}} and more'
    assert parsed(other) == (other, [])  # a name not given stays prose
    assert parsed('{"name": "get_weather", "arguments": "Paris"} ok')[1] == []  # arguments not an object
