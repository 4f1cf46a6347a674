"""Prompt-prefix reuse (engine/sessions/pool.py) in process, on the real models: a reply is the same, token for token
and logprob for logprob, whether its prompt's prefix came from a warm session, a session file or a cold prefill; also
when the prompt leaves the cached one mid-way, and on a hybrid family whose recurrent state reuses only from a
snapshot. `cached_tokens` is exactly what was reused. Session files: a round trip restores a session; a corrupt,
truncated or foreign file is skipped with one warning. `goinfer chat`'s conversation (engine/running/conversation.py)
evaluates each turn's new message only, and its replies are the cold ones."""

from __future__ import annotations

import time
import zipfile

import numpy as np
import pytest

import engine
from engine.running.conversation import WarmConversation
from engine.requests.prompts import continuation_ids, encode_prompt
from engine.requests.request import Collector, GenerationRequest, SamplingOptions, execute, prepare
from engine.running.scheduler import Finished, Job, Scheduler
from engine.sessions.disk import SessionDir, identity, key_of
from engine.sessions.pool import SessionPool, shared_prefix
from tests.conftest import in_kit

SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about bread, pastry, opening "
          "hours and orders. Keep answers short and friendly, and never invent prices. ") * 8
TURNS = ["What bread do you recommend for sandwiches?", "And for breakfast?", "Is rye bread healthy?",
         "How long does a sourdough starter take?", "Thanks! When do you open on Sunday?"]


def chat_request(messages, n: int = 1, **opts) -> GenerationRequest:
    opts = {"max_tokens": 24, "temperature": 0.0, **opts}
    return GenerationRequest(messages=tuple(messages), options=SamplingOptions(**opts), logprobs=True,
                             top_logprobs=2, n=n)


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return engine.load_model(smollm2_gguf)


@pytest.fixture(scope="module")
def gemma(gemma_gguf):
    return engine.load_model(gemma_gguf)


def served(model, **kw):
    pool = SessionPool(model, **kw)
    return Scheduler(model, "m", max_queue=8, sessions=pool, log=lambda line: None), pool


def run(scheduler, model, req):
    """The request's result, once the scheduler has also done its idle-time warming (engine/sessions/warming.py): what
    the next request finds in the pool is then known."""
    prep = prepare(model, req)
    job = Job(prep)
    scheduler.submit(job)
    out = Collector(prep)
    while True:
        item = job.events.get(timeout=300)
        if isinstance(item, Finished):
            if item.error is not None:
                raise item.error
            break
        out.add(item)
    deadline = time.monotonic() + 300
    while scheduler.health().get("warming") and time.monotonic() < deadline:
        time.sleep(0.01)
    return out.result()


def session_tokens(model, req, result) -> list[int]:
    """The tokens a finished one-choice request leaves warm: its prompt, and after the idle-time warming the
    conversation as the next turn will start (continuation_ids)."""
    return continuation_ids(model, req, result.text) or prepare(model, req).ids


def same(a, b) -> None:
    assert [(c.text, c.finish_reason, c.completion_tokens) for c in a.choices] == \
           [(c.text, c.finish_reason, c.completion_tokens) for c in b.choices]
    for x, y in zip(a.choices, b.choices):
        assert [(t.token, t.logprob, t.top) for t in x.logprobs] == [(t.token, t.logprob, t.top) for t in y.logprobs]


def expected_reuse(model, cached_ids, prompt_ids) -> int:
    tile = model.backend.prompt_tile
    return min(shared_prefix(cached_ids, prompt_ids), len(prompt_ids) - 1) // tile * tile


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_a_chat_reuses_its_history_and_every_turn_is_the_cold_reply(which, request):
    model = request.getfixturevalue(which)
    scheduler, pool = served(model)
    try:
        messages, last_ids = [{"role": "system", "content": SYSTEM}], None
        for turn, question in enumerate(TURNS):
            messages.append({"role": "user", "content": question})
            req = chat_request(messages)
            ids = prepare(model, req).ids
            warm = run(scheduler, model, req)
            same(warm, execute(model, req))  # cold: requests.run, a new cache
            want = expected_reuse(model, last_ids, ids) if last_ids is not None else 0
            assert warm.cached_tokens == want
            if turn:  # the history, the last reply included, came from the session: the new message is evaluated,
                new = len(encode_prompt(model, model.render_chat(messages[-1:], add_generation_prompt=True)))
                assert len(ids) - want <= new + model.backend.prompt_tile  # and at most one tile before it
            messages.append({"role": "assistant", "content": warm.text})
            last_ids = session_tokens(model, req, warm)
        assert pool.stats()["reuse_hits"] == len(TURNS) - 1
    finally:
        scheduler.close("done")


def test_a_prompt_that_leaves_a_cached_one_mid_way_reuses_the_shared_part_only(smol):
    scheduler, pool = served(smol)
    try:
        long_doc = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
        first = chat_request([{"role": "user", "content": long_doc + " Summarize."}])
        a_ids = session_tokens(smol, first, run(scheduler, smol, first))
        # the same document with one word changed near its middle, then another question
        changed = long_doc.replace("Line 30: the quick", "Line 30: the slow")
        second = chat_request([{"role": "user", "content": changed + " Which line is odd?"}])
        b_ids = prepare(smol, second).ids
        split = shared_prefix(a_ids, b_ids)
        assert 300 < split < len(b_ids) - 100
        warm = run(scheduler, smol, second)
        assert warm.cached_tokens == split // smol.backend.prompt_tile * smol.backend.prompt_tile
        same(warm, execute(smol, second))
        b_ids = session_tokens(smol, second, warm)
        # a prompt longer than two chunks that continues a cached one (chunks of 512 from the reused position)
        third = chat_request([{"role": "user", "content": changed + " Which line is odd?"},
                              {"role": "assistant", "content": warm.text},
                              {"role": "user", "content": long_doc + " And now?"}])
        c_ids = prepare(smol, third).ids
        assert len(c_ids) - expected_reuse(smol, b_ids, c_ids) > 512
        warm3 = run(scheduler, smol, third)
        assert warm3.cached_tokens == expected_reuse(smol, b_ids, c_ids) >= 640
        same(warm3, execute(smol, third))
    finally:
        scheduler.close("done")


def test_sampled_requests_with_n_choices_reuse_and_match(smol):
    scheduler, _ = served(smol)
    try:
        base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
        run(scheduler, smol, chat_request(base))
        req = chat_request(base[:1] + [{"role": "user", "content": TURNS[1]}], temperature=0.8, seed=7, n=3)
        warm = run(scheduler, smol, req)
        assert warm.cached_tokens > 0
        same(warm, execute(smol, req))
    finally:
        scheduler.close("done")


def test_conversations_with_one_system_prompt_keep_their_own_sessions(smol):
    """Two users of one system prompt, turn by turn: the second's first turn starts from the first's system
    prompt without taking the first's session, so each next turn continues its own history. Replies are cold's."""
    scheduler, pool = served(smol)
    try:
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
        req = chat_request(first)
        reply = run(scheduler, smol, req)
        first_tokens = session_tokens(smol, req, reply)
        other = chat_request(first[:1] + [{"role": "user", "content": TURNS[3]}])
        assert run(scheduler, smol, other).cached_tokens == tile_of(smol, prepare(smol, other).marks[0]) > 0
        again = chat_request(first + [{"role": "assistant", "content": reply.text},
                                      {"role": "user", "content": TURNS[1]}])
        warm = run(scheduler, smol, again)
        assert warm.cached_tokens == expected_reuse(smol, first_tokens, prepare(smol, again).ids)
        assert warm.cached_tokens > len(first_tokens) - smol.backend.prompt_tile
        same(warm, execute(smol, again))
    finally:
        scheduler.close("done")


def tile_of(model, position: int) -> int:
    return position // model.backend.prompt_tile * model.backend.prompt_tile


def test_the_pool_keeps_at_most_its_limits_and_evicts_the_least_recently_used(smol):
    evicted = []
    pool = SessionPool(smol, max_sessions=2, on_evict=evicted.append)
    prompts = [np.arange(10 + i, 310 + i, dtype=np.int64) for i in range(3)]
    for ids in prompts:
        cache = pool.take(ids, 400).cache
        smol.prefill(ids, cache)
        pool.give(cache, ids)
    assert pool.stats()["sessions"] == 2 and [len(s.tokens) for s in evicted] == [300]
    assert shared_prefix(evicted[0].tokens, prompts[0]) == 300  # the oldest left first
    budget = SessionPool(smol, max_sessions=8, budget_bytes=pool.stats()["session_bytes"] // 2 + 1)
    for s in pool.drain():
        budget.add(s)
    assert budget.stats()["sessions"] == 1 and budget.stats()["session_bytes"] <= budget.budget_bytes


def test_a_recurrent_model_reuses_only_from_its_snapshot():
    hybrid = engine.load_model(in_kit("qwen3_5", "tiny-qwen3-5-a.Q8_0.gguf"))
    assert hybrid.new_cache(8).state  # it does carry recurrent state
    scheduler, pool = served(hybrid)
    try:
        first = GenerationRequest(prompt=list(range(5, 305)), options=SamplingOptions(max_tokens=8, temperature=0))
        run(scheduler, hybrid, first)
        again = GenerationRequest(prompt=list(range(5, 305)) + [7, 8, 9], options=first.options)
        warm = run(scheduler, hybrid, again)
        assert warm.cached_tokens == 256  # the snapshot: the first prompt's last whole tile
        cold = execute(hybrid, again)
        assert warm.text == cold.text
        # shares 200 tokens only: less than the snapshot, so a cold prefill
        apart = GenerationRequest(prompt=list(range(5, 205)) + list(range(900, 1000)), options=first.options)
        assert run(scheduler, hybrid, apart).cached_tokens == 0
    finally:
        scheduler.close("done")


@pytest.fixture(scope="module")
def hybrid():
    return engine.load_model(in_kit("qwen3_5", "tiny-qwen3-5-a.Q8_0.gguf"))


def test_a_recurrent_chat_keeps_snapshots_before_its_user_messages(hybrid):
    """Another conversation with the same system prompt, and the same conversation with its last message edited,
    continue from the snapshots taken before the first and the last user message; their replies are the cold
    ones."""
    scheduler, pool = served(hybrid)
    try:
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]},
                   {"role": "assistant", "content": "Sourdough, or a soft white loaf. " * 12}]
        first = chat_request(history + [{"role": "user", "content": TURNS[1]}], max_tokens=8)
        marks = prepare(hybrid, first).marks
        assert len(marks) == 2 and marks[0] > hybrid.backend.prompt_tile and marks[1] - marks[0] > 64
        run(scheduler, hybrid, first)
        for messages, mark in ((history[:1] + [{"role": "user", "content": TURNS[4]}], marks[0]),  # same system
                               (history + [{"role": "user", "content": TURNS[2]}], marks[1])):  # last one edited
            req = chat_request(messages, max_tokens=8)
            warm = run(scheduler, hybrid, req)
            assert warm.cached_tokens == tile_of(hybrid, mark) > 0
            same(warm, execute(hybrid, req))
    finally:
        scheduler.close("done")


def test_a_recurrent_prompt_pauses_where_it_left_the_closest_session(hybrid):
    """Plain prompts have no messages: one that leaves a session before its snapshot is cold, but keeps a snapshot
    where they parted, and a third prompt sharing that much continues from it."""
    scheduler, pool = served(hybrid)
    opts = SamplingOptions(max_tokens=8, temperature=0)
    try:
        run(scheduler, hybrid, GenerationRequest(prompt=list(range(5, 305)), options=opts))
        apart = GenerationRequest(prompt=list(range(5, 205)) + list(range(900, 1000)), options=opts)
        assert run(scheduler, hybrid, apart).cached_tokens == 0  # shares 200: less than the first's snapshot (256)
        third = GenerationRequest(prompt=list(range(5, 255)) + [7, 8, 9], options=opts)
        warm = run(scheduler, hybrid, third)
        assert warm.cached_tokens == 192  # where the second left the first, cut back to its tile
        assert warm.text == execute(hybrid, third).text
        assert max(len(s.snapshots) for s in pool.drain()) <= 4
    finally:
        scheduler.close("done")


def test_a_recurrent_session_file_keeps_every_snapshot(tmp_path, hybrid):
    scheduler, pool = served(hybrid)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    try:
        run(scheduler, hybrid, chat_request(history, max_tokens=8))
    finally:
        scheduler.close("done")
    store = SessionDir(tmp_path, hybrid, print)
    (session,) = pool.drain()
    assert len(session.snapshots) == 2  # before the (first and last) user message, and the last whole tile
    store.save(session)
    (restored,) = SessionDir(tmp_path, hybrid, print).load_all()
    assert [at for at, _ in restored.snapshots] == [at for at, _ in session.snapshots]
    for (_, a), (_, b) in zip(restored.snapshots, session.snapshots):
        assert all(np.array_equal(a[k], b[k]) for k in b)
    pool = SessionPool(hybrid)
    pool.add(restored)
    scheduler = Scheduler(hybrid, "m", max_queue=8, sessions=pool, log=lambda line: None)
    try:
        req = chat_request(history[:1] + [{"role": "user", "content": TURNS[3]}], max_tokens=8)
        warm = run(scheduler, hybrid, req)
        assert warm.cached_tokens == session.snapshots[0][0]
        same(warm, execute(hybrid, req))
    finally:
        scheduler.close("done")


# ---------------------------------------------------------------------------------------------- session files

def warm_pool(model, messages):
    """A pool holding the session one chat request leaves, and that session's tokens."""
    scheduler, pool = served(model)
    try:
        req = chat_request(messages)
        tokens = session_tokens(model, req, run(scheduler, model, req))
    finally:
        scheduler.close("done")
    return pool, tokens


def test_a_session_file_restores_the_session_and_the_reply_is_the_cold_one(tmp_path, smol):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    warnings = []
    store = SessionDir(tmp_path, smol, warnings.append)
    pool, tokens = warm_pool(smol, messages)
    for s in pool.drain():
        store.save(s)
    assert len(list(tmp_path.iterdir())) == 1
    restored = SessionDir(tmp_path, smol, warnings.append).load_all()
    assert len(restored) == 1 and not warnings and not list(tmp_path.iterdir())  # read, then removed
    pool = SessionPool(smol)
    pool.add(restored[0])
    scheduler = Scheduler(smol, "m", max_queue=8, sessions=pool, log=lambda line: None)
    try:
        req = chat_request(messages + [{"role": "assistant", "content": "Sourdough."},
                                       {"role": "user", "content": TURNS[1]}])
        warm = run(scheduler, smol, req)
        assert warm.cached_tokens == expected_reuse(smol, tokens, prepare(smol, req).ids) >= 256
        same(warm, execute(smol, req))
    finally:
        scheduler.close("done")


def _saved_file(tmp_path, smol):
    store = SessionDir(tmp_path, smol, print)
    for s in warm_pool(smol, [{"role": "user", "content": SYSTEM}])[0].drain():
        store.save(s)
    (path,) = tmp_path.iterdir()
    return path


@pytest.mark.parametrize("damage", ["flipped", "truncated", "empty", "foreign"])
def test_a_damaged_or_foreign_session_file_is_skipped_with_one_warning(tmp_path, smol, gemma, damage):
    path = _saved_file(tmp_path, smol)
    data = bytearray(path.read_bytes())
    if damage == "flipped":  # one byte inside the keys: the member's CRC no longer holds
        with zipfile.ZipFile(path) as z:
            info = z.getinfo("keys.npy")
        data[info.header_offset + 30 + len(info.filename) + info.file_size // 2] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[: len(data) * 2 // 3]))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # gemma's session under smollm2's name: its header says whose it is
        other = _saved_file(tmp_path / "g", gemma)
        path.write_bytes(other.read_bytes())
    warnings = []
    assert SessionDir(tmp_path, smol, warnings.append).load_all() == []
    assert len(warnings) == 1 and str(path) in warnings[0] and "skipped" in warnings[0]
    assert "\n" not in warnings[0]


def test_a_session_file_is_keyed_by_the_model_file_identity(smol, gemma):
    a, b = identity(smol), identity(gemma)
    assert a["model"] == smol.path.name and a["digest"] != b["digest"] and key_of(a) != key_of(b)


# ---------------------------------------------------------------------------------------------- goinfer chat

def test_a_chat_conversation_evaluates_each_new_message_only_and_answers_as_cold(tmp_path, smol):
    path = tmp_path / "talk.kvsession"
    conv = WarmConversation(smol, path=path)
    messages = [{"role": "system", "content": SYSTEM}]
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        prep = conv.prepare(chat_request(messages))  # the turn prepared as a server's request
        assert prep.ids == encode_prompt(smol, smol.render_chat(messages, add_generation_prompt=True))
        reply = "".join(ev.text for ev in conv.reply(prep))
        cold = execute(smol, chat_request(messages))
        assert reply == cold.text
        new = len(encode_prompt(smol, smol.render_chat(messages[-1:], add_generation_prompt=True)))
        evaluated = conv.prompt_tokens - conv.cached_tokens
        if len(messages) > 2:  # after the first turn: the new message (and the template's marks around it), and
            assert evaluated <= new + smol.backend.prompt_tile  # at most one tile before it
        messages.append({"role": "assistant", "content": reply})
        text = smol.render_chat(messages, add_generation_prompt=False)
        conv.absorb(encode_prompt(smol, text), {"system": None, "messages": messages})
    conv.wait()
    # --session FILE: the conversation and its cache come back
    again = WarmConversation(smol, path=path)
    meta = again.load()
    assert meta["messages"] == messages
    messages.append({"role": "user", "content": "One more question: do you bake baguettes?"})
    prep = again.prepare(chat_request(messages))
    reply = "".join(ev.text for ev in again.reply(prep))
    assert again.cached_tokens >= len(prep.ids) - smol.backend.prompt_tile - 30
    assert reply == execute(smol, chat_request(messages)).text



def test_a_recurrent_model_chat_reuses_its_snapshots_and_its_session_file(tmp_path):
    hybrid = engine.load_model(in_kit("qwen3_5", "tiny-qwen3-5-a.Q8_0.gguf"))
    path = tmp_path / "hybrid.kvsession"
    conv = WarmConversation(hybrid, path=path)
    messages = [{"role": "system", "content": SYSTEM}]
    for question in TURNS[:3]:
        messages.append({"role": "user", "content": question})
        reply = "".join(ev.text for ev in conv.reply(conv.prepare(chat_request(messages, max_tokens=8))))
        assert reply == execute(hybrid, chat_request(messages, max_tokens=8)).text
        if len(messages) > 2:
            assert conv.cached_tokens > 0 and conv.cached_tokens % hybrid.backend.prompt_tile == 0
        messages.append({"role": "assistant", "content": reply})
        conv.absorb(encode_prompt(hybrid, hybrid.render_chat(messages, add_generation_prompt=False)),
                    {"messages": messages})
    conv.wait()
    warnings = []
    again = WarmConversation(hybrid, path=path, warn=warnings.append)
    assert again.load()["messages"] == messages and not warnings
    messages.append({"role": "user", "content": TURNS[3]})
    reply = "".join(ev.text for ev in again.reply(again.prepare(chat_request(messages, max_tokens=8))))
    assert again.cached_tokens > 0
    assert reply == execute(hybrid, chat_request(messages, max_tokens=8)).text
