"""goinfer_confidence: per-field confidence of a json_schema answer on the real default model, held to the model's
own next-token probabilities, and over HTTP (the array in the answer, one event after the finish chunk in a
stream, the refusals)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from tests.conftest import SERVER_KEY

SCHEMA = {"type": "object", "properties": {
    "category": {"type": "string", "enum": ["billing", "shipping", "technical"]},
    "urgent": {"type": "boolean"}, "priority": {"type": "integer"},
    "fixed": {"type": "string", "enum": ["only"]}, "note": {"type": "string", "maxLength": 30},
    "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3}},
    "required": ["category", "urgent", "priority", "fixed", "note", "tags"], "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "enum": ["refund", "delay", "bug"]}}}
BODY = {"messages": [{"role": "user", "content": "My package is late and I want a refund! Classify this ticket."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA}},
        "temperature": 0, "max_tokens": 120}


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    from engine import load_model

    return load_model(str(smollm2_gguf))


@pytest.fixture(scope="module")
def answered(smol):
    from engine.api.openai import parse_request
    from engine.requests.request import execute

    return execute(smol, parse_request("/v1/chat/completions", {**BODY, "goinfer_confidence": True}))


def test_enum_boolean_and_integer_fields_are_reported_and_forced_or_free_text_ones_are_not(smol, answered):
    from engine.api.openai import parse_request
    from engine.requests.request import execute

    doc = json.loads(answered.text)
    records = {r["path"]: r for r in answered.confidence}
    assert {"category", "urgent", "priority"} <= set(records) and not {"fixed", "note"} & set(records)
    assert all(p.startswith("tags[") for p in set(records) - {"category", "urgent", "priority"})
    for path, r in records.items():
        assert r["value"] == (doc[path] if "[" not in path else doc["tags"][int(path[5:-1])])
        assert 0 < r["confidence"] <= 1 and r["free_tokens"] >= 1 and r["calibrated"] is False
    cat, urgent, priority = records["category"], records["urgent"], records["priority"]
    # the distribution's keys are exactly the schema's options; the undecided mass is a number of its own beside it
    assert cat["kind"] == "enum" and list(cat["distribution"]) == SCHEMA["properties"]["category"]["enum"]
    assert urgent["kind"] == "boolean" and list(urgent["distribution"]) == ["true", "false"]
    tags = [r for path, r in records.items() if path.startswith("tags[")]
    assert all(list(r["distribution"]) == SCHEMA["$defs"]["tag"]["enum"] for r in tags)
    for r in (cat, urgent, *tags):
        assert isinstance(r["undecided"], float) and 0 <= r["undecided"] <= 1
        assert abs(sum(r["distribution"].values()) + r["undecided"] - 1) < 1e-5
    assert cat["confidence"] == cat["distribution"][doc["category"]]
    assert priority["kind"] == "integer" and priority["distribution"] is None and priority["undecided"] is None
    plain = execute(smol, parse_request("/v1/chat/completions", BODY))
    assert plain.text == answered.text and plain.confidence is None  # the answer itself is unchanged


def test_the_enum_distribution_is_the_models_own_next_token_probabilities(smollm2_gguf):
    """At the position that decided `category`, the model's probabilities (an independent pass) of the tokens that
    spell each option, renormalised over the options, equal the record's distribution. On the exact (f32) path: the
    fast path's int8 activations round a one-shot prompt pass and the generation's prompt + decode steps apart, and at
    this near-tie that moved the options' shares by up to 0.03 (the exact path's lay between the two; its own two
    agree to 1e-4)."""
    from engine import load_model
    from engine.api.openai import parse_request
    from engine.requests.prompts import encode_prompt, render_request
    from engine.requests.request import execute

    smol = load_model(str(smollm2_gguf), quant="f32")
    answered = execute(smol, parse_request("/v1/chat/completions", {**BODY, "goinfer_confidence": True}))
    req = parse_request("/v1/chat/completions", BODY)
    prompt = encode_prompt(smol, render_request(smol, req).text)
    text = answered.text
    head = text[:text.index('"category":"') + len('"category":"')]
    generated = smol.tokenizer.encode(text, add_bos=False)
    n = next(k for k in range(len(generated) + 1) if smol.tokenizer.decode(generated[:k]) == head
             or len(smol.tokenizer.decode(generated[:k])) > len(head))
    assert smol.tokenizer.decode(generated[:n]).startswith(head[:-1])
    consumed = smol.tokenizer.decode(generated[:n])
    prefix = consumed[text.index('"category":') + len('"category":'):]  # the value's text before the deciding token
    logprobs = smol.next_logprobs(prompt + generated[:n]).astype(np.float64)
    mass = {}
    for option in ("billing", "shipping", "technical"):
        literal = json.dumps(option)
        others = [json.dumps(o) for o in ("billing", "shipping", "technical") if o != option]
        pieces = ((t, smol.tokenizer.piece_bytes(t).decode("utf-8", "ignore")) for t in range(smol.vocab_size))
        ids = [t for t, piece in pieces if piece and literal.startswith(prefix + piece)
               and not any(o.startswith(prefix + piece) for o in others)]
        mass[option] = float(np.exp(logprobs[ids]).sum())
    total = sum(mass.values())
    record = next(r for r in answered.confidence if r["path"] == "category")["distribution"]
    decided = sum(record[o] for o in mass)
    for option in mass:
        assert record[option] / decided == pytest.approx(mass[option] / total, abs=2e-3)


# ---------------------------------------------------------------------------------------------- over HTTP

def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {SERVER_KEY}"}, timeout=300,
                      **kw)


def test_the_answer_carries_the_array_and_a_stream_sends_it_after_the_finish_chunk(server):
    r = _post(server, "/v1/chat/completions", {**BODY, "goinfer_confidence": True})
    assert r.status_code == 200, r.text
    records = r.json()["goinfer_confidence"]
    assert {x["path"] for x in records} >= {"category", "urgent", "priority"}
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**BODY, "goinfer_confidence": True,
                      "stream": True}, headers={"Authorization": f"Bearer {SERVER_KEY}"}, timeout=300) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    finish = next(i for i, e in enumerate(events) if e.get("choices") and e["choices"][0].get("finish_reason"))
    (extra,) = [e for e in events if "goinfer_confidence" in e]
    assert events.index(extra) == finish + 1 and extra["id"] == events[0]["id"]
    assert extra["goinfer_confidence"] == records
    plain = _post(server, "/v1/chat/completions", BODY).json()
    assert "goinfer_confidence" not in plain


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/chat/completions", {"messages": BODY["messages"], "goinfer_confidence": True}, "json_schema"),
    ("/v1/chat/completions", {**BODY, "goinfer_confidence": True, "n": 2}, "n = 1"),
    ("/v1/chat/completions", {**BODY, "goinfer_confidence": True, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ("/v1/completions", {"prompt": "x", "goinfer_confidence": True, "response_format": {"type": "json_object"}},
     "json_schema"),
    ("/v1/responses", {"input": "x", "goinfer_confidence": True}, "goinfer_confidence"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "goinfer_confidence": True},
     "goinfer_confidence"),
])
def test_it_is_refused_where_it_cannot_be_answered(server, path, body, needle):
    r = _post(server, path, body)
    assert r.status_code == 400 and needle in r.text, r.text


def test_a_batch_line_asking_for_it_is_refused(tmp_path, smollm2_gguf):
    from tests.test_cli import goinfer

    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {**BODY, "goinfer_confidence": True}}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps(line) + "\n")
    r = goinfer("batch", str(src), "-o", str(out), "--model", str(smollm2_gguf))
    # refused by the check of every line before any runs: nothing is run or written
    assert r.returncode == 2 and not out.exists()
    assert f"{src}:1: goinfer_confidence: not available in batches" in r.stderr, r.stderr
