"""The scheduler (engine/running/scheduler.py, stepper.py) in process: requests that run side by side get, token for
token and logprob for logprob, the reply each gets alone (requests.execute, one sequence at a time), on the real
default model and on families whose caches differ (sliding windows, a hybrid's recurrent state)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

import engine
import engine.models.base as base
from engine.constrain.grammar import json_schema_grammar
from engine.errors import Cancelled, ContextOverflow
from engine.requests.request import Collector, GenerationRequest, SamplingOptions, execute, prepare
from engine.running.scheduler import Finished, Job, QueueFull, Scheduler
from tests.conftest import in_kit


def chat(text: str, **kw) -> GenerationRequest:
    opts = {k: kw.pop(k) for k in ("max_tokens", "temperature", "seed", "stop", "top_p") if k in kw}
    return GenerationRequest(messages=({"role": "user", "content": text},), options=SamplingOptions(**opts), **kw)


REQUESTS = [
    chat("What is the capital of France?", max_tokens=24, temperature=0.0),
    chat("Write a haiku about rain.", max_tokens=30, temperature=0.8, seed=11, logprobs=True, top_logprobs=3),
    chat("Count from 1 to 10, in words.", max_tokens=40, temperature=0.0, stop=(" 5",)),
    chat("Give me a person as JSON.", max_tokens=40, temperature=0.7, seed=3,
         grammar=json_schema_grammar({"type": "object", "properties": {"name": {"type": "string"}},
                                      "required": ["name"]})),
    chat("Say hi.", max_tokens=12, temperature=0.9, seed=5, n=3),
]


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return engine.load_model(smollm2_gguf)


def collect(job: Job, timeout: float = 300):
    out = Collector(job.prep)
    deadline = time.monotonic() + timeout
    while True:
        item = job.events.get(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(item, Finished):
            if item.error is not None:
                raise item.error
            return out.result()
        out.add(item)


def same(a, b) -> None:
    """Two Completions agree as a user sees them: text, finish, token count, every logprob bit for bit."""
    assert len(a.choices) == len(b.choices)
    for x, y in zip(a.choices, b.choices):
        assert (x.text, x.finish_reason, x.completion_tokens, x.stop_sequence) == \
               (y.text, y.finish_reason, y.completion_tokens, y.stop_sequence)
        if x.logprobs is not None:
            assert [(t.token, t.logprob, t.top) for t in x.logprobs] == [(t.token, t.logprob, t.top) for t in y.logprobs]


def run_together(model, reqs, **kw):
    sched = Scheduler(model, "m", max_queue=len(reqs), log=lambda line: None, **kw)
    try:
        jobs = [Job(prepare(model, r), request_id=f"r{i}") for i, r in enumerate(reqs)]
        for j in jobs:
            sched.submit(j)
        results = [collect(j) for j in jobs]
        return results, sched.health()
    finally:
        sched.close("test over")


def _stop_inside_the_reply(model, req: GenerationRequest) -> GenerationRequest:
    """req (greedy) with a stop string taken from the middle of its own reply, so that it surely stops on it:
    which words a greedy reply holds is up to ties the machine's float summation order can flip (this model
    counts "1, 2, 3" on one CPU and "123" on another), what the engine does with a stop string is not."""
    text = execute(model, dataclasses.replace(req, options=dataclasses.replace(req.options, stop=()))).choices[0].text
    middle = len(text) // 2
    return dataclasses.replace(req, options=dataclasses.replace(req.options, stop=(text[middle : middle + 2],)))


def test_side_by_side_replies_equal_the_solo_ones(smol):
    reqs = list(REQUESTS)
    reqs[2] = _stop_inside_the_reply(smol, REQUESTS[2])
    solo = [execute(smol, r) for r in reqs]
    together, health = run_together(smol, reqs, max_concurrent=4)
    for r, a, b in zip(reqs, solo, together):
        same(a, b)
    assert health["completed"] == len(reqs) and health["running_sequences"] == 0 and health["kv_bytes"] == 0
    assert health["decoded_tokens"] > 1.5 * health["decode_steps"]  # they really decoded together
    stop = reqs[2].options.stop[0]
    assert together[2].choices[0].finish_reason == "stop" and together[2].choices[0].stop_sequence == stop
    assert stop not in together[2].choices[0].text  # cut before it
    assert together[3].choices[0].text.startswith("{")
    assert len({c.text for c in together[4].choices}) > 1  # n = 3: each choice samples with its own seed


def test_a_long_prompt_enters_in_chunks_while_others_decode(smol, monkeypatch):
    # Chunks of 16: the long prompt takes several steps, each beside the running streams' decode steps; its
    # reply equals the one a lone run gets with the same chunking (requests.run prefills by PREFILL_CHUNK).
    monkeypatch.setattr(base, "PREFILL_CHUNK", 16)
    story = chat("Summarize: " + " ".join(f"Line {i}: the fox jumps over the dog." for i in range(12)),
                 max_tokens=16, temperature=0.0, logprobs=True)  # 150 tokens: its attention splits in two
    reqs = [REQUESTS[0], REQUESTS[2], story]
    solo = [execute(smol, r) for r in reqs]
    together, _ = run_together(smol, reqs, max_concurrent=4, prefill_chunk=16)
    for a, b in zip(solo, together):
        same(a, b)


@pytest.mark.parametrize("family", ["gemma4", "gpt_oss", "qwen3_5", "lfm2"])
def test_families_with_other_caches_decode_together_as_alone(family):
    # sliding windows and shared KV (gemma4), MoE routing and sinks (gpt_oss), recurrent state copied for n choices
    path = next(in_kit(family).glob("*.Q8_0.gguf"))
    model = engine.load_model(path, selftest=False)
    ids = [GenerationRequest(prompt=tuple(range(5 + 7 * i, 5 + 7 * i + 9 + 20 * i)),
                             options=SamplingOptions(max_tokens=12, temperature=0.8, seed=i), n=1 + i % 2)
           for i in range(3)]
    solo = [execute(model, r) for r in ids]
    together, _ = run_together(model, ids, max_concurrent=4)
    for a, b in zip(solo, together):
        same(a, b)


def test_a_cancelled_job_leaves_and_the_others_finish(smol):
    sched = Scheduler(smol, "m", max_queue=4, max_concurrent=4, log=lambda line: None)
    try:
        long = Job(prepare(smol, chat("Write a long story about a dragon.", max_tokens=200, temperature=0.0)),
                   request_id="long")
        short = Job(prepare(smol, REQUESTS[0]), request_id="short")
        sched.submit(long)
        sched.submit(short)
        while long.generated < 3:
            time.sleep(0.01)
        sched.withdraw(long, "client disconnected")
        with pytest.raises(Cancelled):
            collect(long)
        same(collect(short), execute(smol, REQUESTS[0]))
        h = sched.health()
        assert h["cancelled"] == 1 and h["completed"] == 1 and long.generated < 200
    finally:
        sched.close("test over")


def test_the_queue_limit_and_fifo_admission(smol):
    sched = Scheduler(smol, "m", max_queue=1, max_concurrent=1, log=lambda line: None)
    try:
        jobs = [Job(prepare(smol, chat(f"Count to {i}.", max_tokens=8, temperature=0.0)), request_id=f"j{i}")
                for i in range(3)]
        order: list[str] = []
        lock = threading.Lock()
        sched.submit(jobs[0])
        while sched.health()["running_sequences"] == 0:  # admitted: its one slot is taken
            time.sleep(0.005)
        sched.submit(jobs[1])  # waits
        with pytest.raises(QueueFull) as full:
            sched.submit(jobs[2])
        assert full.value.retry_after >= 1 and sched.health()["rejected"] == 1
        for j in jobs[:2]:
            collect(j)
            with lock:
                order.append(j.id)
        assert order == ["j0", "j1"] and jobs[0].started < jobs[1].started
    finally:
        sched.close("test over")


def test_a_job_over_the_window_fails_alone(smol):
    # A request is checked before it queues; one that still fails in the scheduler (here: its cache refuses to
    # grow) fails alone, with its error, and the batch goes on.
    sched = Scheduler(smol, "m", max_queue=4, max_concurrent=4, log=lambda line: None)
    try:
        bad = Job(prepare(smol, REQUESTS[0]), request_id="bad")
        bad.prep.choices[0].cache_tokens = 4  # a cache too small for its own prompt
        good = Job(prepare(smol, REQUESTS[2]), request_id="good")
        sched.submit(bad)
        sched.submit(good)
        with pytest.raises(ContextOverflow):
            collect(bad)
        same(collect(good), execute(smol, REQUESTS[2]))
        assert sched.health()["failed"] == 1
    finally:
        sched.close("test over")
