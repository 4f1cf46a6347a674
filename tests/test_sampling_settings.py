"""The sampling settings declared in one place: `goinfer chat`'s flags and an OpenAI chat body with the same settings
come, through requests.prepare, to the same SamplingParams (and the same prompt), as a server's request would."""

from __future__ import annotations

import inspect

import pytest
import typer

import engine
from commands.chat import ChatState, sampling_options
from commands.options import thinking_settings
from engine.api.openai import parse_chat_request
from engine.generation.sampling import SamplingParams
from engine.requests.request import apply_defaults, prepare
from goinfer_cli.app import build

ASK = "Name three colours."


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return engine.load_model(smollm2_gguf, selftest=False)


def _chat_prepared(model, *args: str):
    """The reply `goinfer chat ARGS` would prepare for ASK: the flags parsed by the CLI itself, then chat's own
    state and request."""
    command = typer.main.get_command(build(("chat",))).commands["chat"]
    params = command.make_context("chat", list(args)).params
    options = sampling_options(**{k: params[k] for k in inspect.signature(sampling_options).parameters})
    state = ChatState(params["system"], options, messages=[{"role": "user", "content": ASK}],
                      thinking=thinking_settings(params["thinking"], params["reasoning_budget"]))
    return prepare(model, state.request(), thinking=state.thinking)


def _server_prepared(model, body: dict, flags=None):
    req = parse_chat_request({"messages": [{"role": "user", "content": ASK}], **body})
    return prepare(model, apply_defaults(req, flags))


def test_chat_flags_and_a_chat_body_with_the_same_settings_sample_alike(smol):
    cli = _chat_prepared(smol, "--temp", "0.6", "--top-p", "0.8", "--top-k", "12", "--min-p", "0.05", "--seed", "9",
                         "--repeat-penalty", "1.1", "--presence-penalty", "0.3", "--frequency-penalty", "-0.2",
                         "--max", "40")
    server = _server_prepared(smol, {"temperature": 0.6, "top_p": 0.8, "top_k": 12, "min_p": 0.05, "seed": 9,
                                     "repetition_penalty": 1.1, "presence_penalty": 0.3, "frequency_penalty": -0.2,
                                     "max_tokens": 40})
    (c,), (s,) = cli.choices, server.choices
    assert c.sampling == s.sampling == SamplingParams(temperature=0.6, top_k=12, top_p=0.8, min_p=0.05, seed=9,
                                                      repetition_penalty=1.1, presence_penalty=0.3,
                                                      frequency_penalty=-0.2)
    assert cli.ids == server.ids and c.max_tokens == s.max_tokens  # the same prompt, the same room to answer


def test_chat_defaults_are_a_body_that_states_them(smol):
    # What chat samples with when no flag is given: its documented defaults, stated as any request would state them.
    cli = _chat_prepared(smol)
    server = _server_prepared(smol, {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "max_tokens": 512})
    assert cli.choices[0].sampling == server.choices[0].sampling
    assert cli.choices[0].sampling.seed is None  # no --seed: a random one each reply
    # A body that leaves them unset gets the API's defaults instead (temperature 1, no top-k), not chat's.
    assert _server_prepared(smol, {}).choices[0].sampling == SamplingParams(temperature=1.0)


def test_a_changed_setting_is_a_different_sampler(smol):
    one, two = (_chat_prepared(smol, "--seed", seed).choices[0].sampling for seed in ("1", "2"))
    assert one != two
    # A serve flag fills what the body leaves unset, as chat's flag does.
    flags = sampling_options(temp=0.2, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, presence_penalty=0.0,
                             frequency_penalty=0.0, seed=3, max_tokens=512)
    assert _server_prepared(smol, {}, flags).choices[0].sampling == \
        _chat_prepared(smol, "--temp", "0.2", "--top-k", "0", "--top-p", "1", "--seed", "3").choices[0].sampling
