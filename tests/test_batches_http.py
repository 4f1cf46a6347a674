"""OpenAI's Files and Batch APIs over real HTTP with the official SDK (engine/server/files.py, batches.py): a
batch's answers equal the same requests sent one by one; cancel keeps what finished; a server killed mid-batch
resumes it at its next start on the same --batch-dir with nothing lost and nothing done twice."""

from __future__ import annotations

import io
import json
import signal
import time

import openai
import pytest

from tests.test_server import start_server, stop

SYSTEM = "You are a storyteller."


def lines(n: int, max_tokens: int, topic: str = "a lighthouse") -> list[dict]:
    return [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": f"Tell story number {i} about {topic}."}],
                      "max_tokens": max_tokens, "temperature": 0}} for i in range(n)]


def upload(client, records: list[dict]):
    data = "\n".join(json.dumps(r) for r in records).encode()
    return client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")


def wait(client, batch_id: str, done=("completed", "failed", "cancelled"), timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in done:
            return batch
        time.sleep(0.2)
    pytest.fail(f"batch {batch_id} still {batch.status} after {timeout} s")


def answers(client, file_id: str) -> dict[str, str]:
    records = [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)), "a line was answered twice"
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in records}


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_gguf):
    s = start_server(tmp_path_factory.mktemp("serve-batches") / "serve.log", "--model", str(smollm2_gguf),
                     "--no-selftest")
    yield s, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    stop(s)


def test_a_batch_answers_as_the_requests_sent_one_by_one(served, name):
    _, client = served
    records = lines(3, 12)
    f = upload(client, records)
    assert f.purpose == "batch" and f.bytes > 0 and client.files.retrieve(f.id).filename == "requests.jsonl"
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
    batch = wait(client, batch.id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 3, 0)
    got = answers(client, batch.output_file_id)
    for r in records:
        alone = client.chat.completions.create(model=name, **r["body"]).choices[0].message.content
        assert got[r["custom_id"]] == alone
    assert batch.id in [b.id for b in client.batches.list().data]
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_bad_batches_and_uploads_are_refused_naming_the_field(served):
    server, client = served
    good = upload(client, lines(1, 4))
    for kwargs, param in (({"input_file_id": "file-" + "0" * 24}, "input_file_id"),
                          ({"endpoint": "/v1/images"}, "endpoint"),
                          ({"completion_window": "1h"}, "completion_window")):
        args = {"input_file_id": good.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(**args)
        assert e.value.body["param"] == param
    other = upload(client, [{**lines(1, 4)[0], "body": {**lines(1, 4)[0]["body"], "model": "nope"}}])
    with pytest.raises(openai.APIStatusError) as e:
        client.batches.create(input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.status_code in (400, 404) and e.value.body["param"] == "model"
    mixed = upload(client, [lines(1, 4)[0], {**lines(2, 4)[1], "url": "/v1/completions"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert "line 2" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 24)


def test_cancel_keeps_what_finished(served):
    _, client = served
    batch = client.batches.create(input_file_id=upload(client, lines(12, 96, "a harbour")).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        time.sleep(0.1)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait(client, batch.id)
    assert batch.status == "cancelled" and 1 <= batch.request_counts.completed < 12
    assert len(answers(client, batch.output_file_id)) == batch.request_counts.completed


def test_a_server_killed_mid_batch_resumes_it_with_nothing_lost_or_done_twice(tmp_path, smollm2_gguf, name):
    records = lines(10, 96, "a mountain")
    args = ("--model", str(smollm2_gguf), "--no-selftest", "--batch-dir", str(tmp_path / "batches"))
    s = start_server(tmp_path / "first.log", *args)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    batch = client.batches.create(input_file_id=upload(client, records).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        time.sleep(0.05)
    stop(s, signal.SIGKILL)  # no shutdown at all: lines in flight are lost mid-write
    kept = json.loads((tmp_path / "batches" / "batches" / f"{batch.id}.json").read_text())
    assert kept["status"] == "in_progress" and kept["request_counts"]["completed"] < 10  # killed mid-batch
    s = start_server(tmp_path / "second.log", *args)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        done = wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.total == 10
        got = answers(client, done.output_file_id)
        assert sorted(got) == sorted(r["custom_id"] for r in records)
        for r in records[:3] + records[-2:]:
            alone = client.chat.completions.create(model=name, **r["body"]).choices[0].message.content
            assert got[r["custom_id"]] == alone
    finally:
        stop(s)


# ---------------------------------------------------------------------------------------- Anthropic's Message Batches

def test_anthropic_message_batches_answer_as_messages_sent_one_by_one(served, name):
    import anthropic

    server, _ = served
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    params = [{"model": name, "max_tokens": 10, "temperature": 0,
               "messages": [{"role": "user", "content": f"Name a colour, number {i}."}]} for i in range(3)]
    requests = [{"custom_id": f"m{i}", "params": p} for i, p in enumerate(params)]
    batch = claude.messages.batches.create(requests=requests + [{"custom_id": "bad", "params": {"messages": []}}])
    assert batch.id.startswith("msgbatch_") and batch.processing_status == "in_progress"
    deadline = time.monotonic() + 300
    while (batch := claude.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.processing, counts.canceled) == (3, 1, 0, 0)
    results = list(claude.messages.batches.results(batch.id))
    assert [r.custom_id for r in results] == ["m0", "m1", "m2", "bad"]  # the order they came in
    for r, p in zip(results, params):
        alone = claude.messages.create(**{k: v for k, v in p.items() if k != "temperature"},
                                       extra_body={"temperature": 0})  # the SDK no longer takes it by name
        assert r.result.type == "succeeded" and r.result.message.content[0].text == alone.content[0].text
    assert results[3].result.type == "errored" and "max_tokens" in results[3].result.error.error.message
    assert batch.id in [b.id for b in claude.messages.batches.list()]
    assert claude.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve(batch.id)


def test_anthropic_message_batches_refuse_bad_requests_in_anthropic_shape(served):
    import anthropic

    server, _ = served
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    one = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for requests in ([], [{"custom_id": "a b", "params": one}],
                     [{"custom_id": "a", "params": one}, {"custom_id": "a", "params": one}]):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.batches.create(requests=requests)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve("msgbatch_" + "0" * 24)
