"""Speculative decoding by prompt lookup (generation/speculation.py): a run of a token and its draft through one decode
step gives each row the numbers that token's own step gives, bit for bit, so replies are the same tokens, text and
logprobs with it on or off (greedy, seeded sampling, stops, max_tokens, grammars, n choices, side by side in the
scheduler, over HTTP), in fewer steps where the reply repeats its context; where it cannot run (recurrent state)
it is off and nothing changes."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import numpy as np
import pytest

import engine
from engine.constrain.grammar import json_schema_grammar
from engine.generation.generate import generate
from engine.requests.request import GenerationRequest, SamplingOptions, execute
from engine.generation.speculation import Drafter, Speculation, speculation_of
from engine.running.stepper import BATCH_DRAFT_RATE
from tests.conftest import SERVER_KEY, in_kit
from tests.test_scheduler import REQUESTS, chat, run_together, same

CODE = '''def parse_config(path):
    with open(path) as handle:
        lines = handle.read().splitlines()
    config = {}
    for line in lines:
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
'''
COPY = "Rewrite this Python function, renaming the variable `config` to `settings`. Output only the code.\n\n" + CODE
SPEC = Speculation()


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return engine.load_model(smollm2_gguf)


@pytest.fixture(scope="module")
def gemma(gemma_gguf):
    return engine.load_model(gemma_gguf)


def _kit(family: str):
    return engine.load_model(next(in_kit(family).glob("*.Q8_0.gguf")), selftest=False)


def _prompt(model) -> list[int]:
    return list(model.tokenizer.encode(model.render_chat([{"role": "user", "content": COPY}])))


class _Counted:
    """Counts the decode steps a model runs (decode_runs calls) and the rows they take."""

    def __init__(self, model, monkeypatch):
        self.steps = self.rows = 0
        inner = model.decode_runs

        def counted(runs, caches):
            self.steps += 1
            self.rows += sum(len(r) for r in runs)
            return inner(runs, caches)

        monkeypatch.setattr(model, "decode_runs", counted)


# ------------------------------------------------------------------------------------------------ the step's runs


@pytest.mark.parametrize("which", ["smol", "gemma", "gemma4", "gpt_oss"])
def test_a_run_gives_each_row_the_numbers_of_its_own_step(which, request):
    # SmolLM2 (packed legacy types), Gemma 3 (K-quants, sliding windows), and the kit's Gemma 4 (shared KV, per-layer
    # widths) and gpt-oss (MoE, sinks): a run of 5 beside a single token, against one step per token.
    model = request.getfixturevalue(which) if which in ("smol", "gemma") else _kit(which)
    prompt = [int(t) % model.vocab_size for t in range(7, 7 + 37 * 3, 3)]
    run, other = [11, 220, 13, 11, 99], [42]
    one, two, alone, beside = (model.new_cache(256) for _ in range(4))
    for c in (one, two, alone, beside):
        model.prefill(prompt, c)
    by_steps = np.concatenate([model.decode([t], [one]) for t in run])
    rows = model.decode_runs([run, other], [two, beside])
    assert np.array_equal(rows[0], by_steps)  # bit for bit
    assert np.array_equal(rows[1], model.decode(other, [alone]))  # the other sequence's row: as in its own step
    assert one.length == two.length == len(prompt) + len(run)
    for layer in (0, model.config.n_layer - 1):
        slot = model.config.kv_layers.index(layer) if layer in model.config.kv_layers else None
        if slot is not None:
            assert np.array_equal(one.keys(slot), two.keys(slot)) and np.array_equal(one.values(slot), two.values(slot))


# ------------------------------------------------------------------------------------------------ same replies


@pytest.mark.parametrize("which", ["smol", "gemma"])
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 5)])
def test_replies_are_the_same_tokens_in_fewer_steps(which, temperature, seed, request, monkeypatch):
    model = request.getfixturevalue(which)
    ids = _prompt(model)

    def reply(spec):
        counted = _Counted(model, monkeypatch)
        events = list(generate(model, ids, max_tokens=120, temperature=temperature, seed=seed, top_logprobs=2,
                               speculation=spec))
        monkeypatch.undo()
        return [(e.token, e.text, e.logprob, e.top_logprobs, e.finish_reason) for e in events], counted

    plain, one_each = reply(None)
    fast, drafted = reply(SPEC)
    assert fast == plain
    assert one_each.steps == one_each.rows == len(plain) - 1  # one step per token after the prompt's first
    # The steps the drafts take are those prompt lookup over this very reply calls for: each draft taken up to
    # its first miss. (How much a reply copies depends on the CPU's rounding, so the count is replayed, not fixed.)
    assert drafted.steps == _replayed_steps(ids, [e[0] for e in plain], max_tokens=120)
    if temperature == 0.0:  # the greedy reply copies the function: many tokens come two or more a step
        assert drafted.steps < one_each.steps and drafted.rows > drafted.steps, (drafted.steps, one_each.steps)


def _replayed_steps(prompt: list[int], reply: list[int], max_tokens: int) -> int:
    """The decode steps prompt lookup (SPEC) takes for a reply known in advance: each step checks the latest token
    and the draft, and gives the draft's tokens up to its first miss, and the token after them."""
    drafter, steps, done = SPEC.drafter(prompt), 0, 1  # the first token comes from the prompt's logits
    drafter.push(reply[0])
    while done < len(reply):
        run = [reply[done - 1]] + drafter.draft(max_tokens - done - 1)
        steps += 1
        for j in range(len(run)):
            drafter.push(reply[done])
            done += 1
            if done == len(reply) or j + 1 == len(run) or reply[done - 1] != run[j + 1]:
                break
        drafter.verified(len(run) - 1, j)
    return steps


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 13])
def test_max_tokens_and_stops_inside_a_run(smol, max_tokens):
    ids = _prompt(smol)
    for stop in (None, ["settings"], ["key"]):
        caches = [smol.new_cache(len(ids) + 64) for _ in range(2)]
        got = [[(e.token, e.text, e.finish_reason, e.stop_sequence)
                for e in generate(smol, ids, max_tokens=max_tokens, stop=stop, cache=c, speculation=s)]
               for c, s in zip(caches, (None, SPEC))]
        assert got[0] == got[1], (max_tokens, stop)
        assert caches[0].length == caches[1].length  # the dropped rows are gone from the cache


def test_every_request_kind_answers_the_same(smol):
    # logprobs, a stop string, a JSON-schema grammar, n = 3 seeded choices; and the copy task
    reqs = REQUESTS + [chat(COPY, max_tokens=80, temperature=0.0, logprobs=True, top_logprobs=2)]
    for r in reqs:
        same(execute(smol, r), execute(smol, r, speculation=SPEC))


def test_side_by_side_with_speculation_equal_the_solo_replies(smol):
    reqs = REQUESTS + [chat(COPY, max_tokens=80, temperature=0.0, logprobs=True),
                       chat(COPY, max_tokens=60, temperature=0.7, seed=9)]
    solo = [execute(smol, r) for r in reqs]
    together, health = run_together(smol, reqs, max_concurrent=4, speculation=SPEC)
    for a, b in zip(solo, together):
        same(a, b)
    assert health["draft_tokens"] >= health["draft_accepted_tokens"] > 20  # the copies were drafted and taken
    assert health["completed"] == len(reqs) and health["kv_bytes"] == 0


def test_a_grammar_constrained_copy_answers_the_same(smol):
    schema = {"type": "object", "properties": {"settings": {"type": "array", "items": {"type": "string"}}},
              "required": ["settings"]}
    r = chat("List the keys of this JSON as a JSON object with a 'settings' array: "
             '{"alpha": 1, "beta": 2, "gamma": 3, "delta": 4}', max_tokens=60, temperature=0.0,
             grammar=json_schema_grammar(schema))
    same(execute(smol, r), execute(smol, r, speculation=SPEC))


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_recurrent_models_do_not_draft_and_answer_the_same(family, monkeypatch):
    model = _kit(family)
    assert not model.runs_on(model.new_cache(8))  # a rejected draft would leave the state advanced
    r = GenerationRequest(prompt=tuple([5, 6, 7, 8] * 6), options=SamplingOptions(max_tokens=16, temperature=0.0))
    counted = _Counted(model, monkeypatch)
    same(execute(model, r), execute(model, r, speculation=SPEC))
    assert counted.steps == counted.rows  # never more than one token a step


# ------------------------------------------------------------------------------------------------ the drafter


def test_the_drafter_takes_the_longest_latest_match():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2]
    d = Drafter(Speculation(draft_max=4, ngram_min=2, ngram_max=3), tokens)
    assert d.draft(4) == [3, 4, 5, 9]  # "8 1 2" is new; "1 2" occurred at the start
    d.push(3)  # "1 2 3" occurred at the start (before "2 3"'s later occurrence, the longer match wins)
    assert d.draft(4) == [4, 5, 9, 2] and d.draft(2) == [4, 5]
    pairs = Drafter(Speculation(draft_max=4, ngram_min=2, ngram_max=2), tokens + [3])
    assert pairs.draft(4) == [7, 8, 1, 2]  # "2 3": its latest occurrence
    d.push(6)  # "3 6" never occurred
    assert d.draft(4) == []


def test_the_drafter_adapts_its_length_and_pauses_after_misses():
    d = Drafter(Speculation(draft_max=4), [1, 2, 3, 4, 5, 6, 7, 8] * 3)
    assert d.length == 4 and d.rate == 0.75  # hopeful at first: a sequence in a batch may draft
    d.verified(4, 0)
    assert d.length == 2 and d.rate < BATCH_DRAFT_RATE  # beside other sequences it would stop drafting
    d.verified(2, 2)
    assert d.length == 3
    for _ in range(3):
        d.verified(1, 0)
    assert d.draft(4) == []  # paused after three drafts refused at their first token
    for t in [1, 2, 3, 4, 5, 6, 7, 8] * 2:
        d.push(t)
    assert d.draft(4) == [1]  # the pause has run out; the length is back where the misses left it
    assert (d.drafted, d.accepted) == (9, 2)


def test_speculation_settings_are_checked():
    assert speculation_of("off") is None and speculation_of("ngram", 6).draft_max == 6
    with pytest.raises(ValueError, match="choose from off, ngram"):
        speculation_of("eagle")
    with pytest.raises(ValueError, match="1-16"):
        Speculation(draft_max=0)


# ------------------------------------------------------------------------------------------------ commands


def test_the_chat_command_answers_the_same_with_and_without(smollm2_gguf):
    def run(*flags):
        out = subprocess.run([sys.executable, "-m", "goinfer_cli.app", "chat", "--model", str(smollm2_gguf), "--temp",
                              "0", "--max", "60", "--prompt", COPY, *flags], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout, out.stderr

    fast, timed = run("--verbose")
    assert fast == run("--speculate", "off")[0]
    # --verbose: one line of timings on stderr after the reply (stdout keeps only the reply)
    assert re.fullmatch(r"prompt \d+ tokens \(0 reused\) in [\d.]+ s, [\d.]+ tokens/s · reply \d+ tokens in [\d.]+ s, "
                        r"[\d.]+ tokens/s", timed.strip().splitlines()[-1]), timed[-500:]
    bad = subprocess.run([sys.executable, "-m", "goinfer_cli.app", "chat", "--prompt", "hi", "--draft-max", "40"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == ["goinfer: error: --draft-max must be 1-16 "
                                                                       "tokens, got 40"]


def test_the_server_reports_what_speculation_did(server, name):
    body = {"model": name, "max_tokens": 60, "temperature": 0, "messages": [{"role": "user", "content": COPY}]}
    auth = {"Authorization": f"Bearer {SERVER_KEY}"}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth, timeout=300).status_code == 200
    text = httpx.get(server.url + "/metrics", headers=auth, timeout=30).text
    found = {k: int(v) for k, v in re.findall(r'^goinfer_(draft_tokens_total|draft_accepted_tokens_total)'
                                              rf'{{model="{re.escape(name)}"}} (\d+)$', text, re.M)}
    assert found["draft_tokens_total"] >= found["draft_accepted_tokens_total"] > 0, found
    health = httpx.get(server.url + "/health", headers=auth, timeout=30).json()
    assert health["limits"]["speculation"] == {"method": "ngram", "draft_max": 4}  # the default
