"""Decisions (POST /v1/systemone): label scoring on the real default model, checked against the model's own
next-token probabilities, and driven over HTTP by TypeSafe's official SDK (typesafe-sdk) unchanged."""

from __future__ import annotations

import gzip
import json

import httpx
import numpy as np
import pytest

from engine.api.decisions import DecisionInvalid, parse_decision_request
from tests.conftest import SERVER_KEY
from tests.test_server import ROOT, start_server, stop

TICKET = "Help! My payouts have been failing for 3 days and my customers are asking where their money is."
QUESTIONS = {
    "department": {"type": "choice", "instructions": "Which team should handle this?",
                   "criteria": {"billing": "Payments, invoicing, refunds", "technical": "Bugs, outages",
                                "sales": None}},
    "is_urgent": {"type": "noul", "instructions": "Is this urgent?"},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["Can wait", "Needs attention this week", "Needs attention today"]},
}


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    from engine import load_model

    return load_model(str(smollm2_gguf))


def test_a_choice_is_the_models_own_next_token_probabilities_of_its_labels(smol):
    from engine.decisions.prompts import question_prompt
    from engine.decisions.scoring import score_request

    req = parse_decision_request({"state": TICKET, "questions": QUESTIONS})
    scored = score_request(smol, req, "chat-v1")
    for q in req.questions:
        prompt = question_prompt(smol, "chat-v1", req.state, q)
        assert [smol.tokenizer.decode([i]) for i in prompt.label_ids] == {
            "choice": ["A", "B", "C"], "noul": ["Yes", "No"], "score": ["0", "1", "2"]}[q.kind]
        logprobs = smol.next_logprobs(prompt.ids)[prompt.label_ids].astype(np.float64)  # an independent pass
        expected = np.exp(logprobs) / np.exp(logprobs).sum()
        assert np.allclose(scored.probabilities[q.name], expected, atol=1e-6)
        assert abs(sum(scored.probabilities[q.name]) - 1) < 1e-6


def test_the_shared_state_is_prefilled_once_and_gives_the_per_question_numbers(smol):
    from engine.decisions.scoring import score_request

    req = parse_decision_request({"state": " ".join([TICKET] * 12), "questions": QUESTIONS})
    shared = score_request(smol, req, "chat-v1")
    alone = score_request(smol, req, "chat-v1", share_state=False)
    assert shared.input_tokens < alone.input_tokens * 0.6  # the state's tiles counted (and prefilled) once
    for name in QUESTIONS:
        assert np.allclose(shared.probabilities[name], alone.probabilities[name], atol=1e-5)


def test_bare_v1_reads_the_label_after_a_space(smol):
    from engine.decisions.prompts import question_prompt

    req = parse_decision_request({"state": TICKET, "questions": QUESTIONS})
    prompt = question_prompt(smol, "bare-v1", req.state, req.questions[0])
    assert smol.tokenizer.decode(prompt.ids).endswith("Answer:")
    assert [smol.tokenizer.decode([i]) for i in prompt.label_ids] == [" A", " B", " C"]


@pytest.mark.parametrize("body,loc", [
    ({"questions": QUESTIONS}, ["body", "state"]),
    ({"state": TICKET, "questions": {}}, ["body", "questions"]),
    ({"state": TICKET, "questions": {"q": {"type": "choice", "criteria": {"only": None}}}},
     ["body", "questions", "q", "criteria"]),
    ({"state": TICKET, "questions": {"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(17)}}}},
     ["body", "questions", "q", "criteria"]),
    ({"state": TICKET, "questions": {"q": {"type": "score", "criteria": [str(i) for i in range(11)]}}},
     ["body", "questions", "q", "criteria"]),
    ({"state": TICKET, "questions": {"q": {"type": "noul"}}}, ["body", "questions", "q"]),
    ({"state": TICKET, "questions": {"q": {"type": "box", "instructions": "the dog"}}},
     ["body", "questions", "q", "type"]),
    ({"state": TICKET, "questions": {"q": {"type": "noul", "instructions": "x", "colour": 1}}},
     ["body", "questions", "q", "colour"]),
    ({"state": TICKET, "questions": QUESTIONS, "temperature": 0}, ["body", "temperature"]),
])
def test_a_question_that_breaks_a_rule_is_refused_naming_it(body, loc):
    with pytest.raises(DecisionInvalid) as e:
        parse_decision_request(body)
    assert loc in [p["loc"] for p in e.value.problems]


# ---------------------------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def decide_server(tmp_path_factory, smollm2_gguf):
    s = start_server(tmp_path_factory.mktemp("serve-decide") / "serve.log", "--model", f"local={smollm2_gguf}",
                     "--api-key", SERVER_KEY)
    yield s
    stop(s)


@pytest.fixture(scope="module")
def client(decide_server):
    from typesafe_sdk import TypeSafeClient

    with TypeSafeClient(api_key=SERVER_KEY, base_url=decide_server.url, model="local") as c:
        yield c


def test_the_sdk_gets_typed_answers_to_every_kind_in_one_request(client):
    from typesafe_sdk import Choice, Noul, Score

    result = client.system_one(state=TICKET, questions={
        "department": Choice(**{k: v for k, v in QUESTIONS["department"].items() if k != "type"}),
        "is_urgent": Noul(instructions="Is this urgent?"),
        "urgency": Score(instructions="How urgent is it?", criteria=QUESTIONS["urgency"]["criteria"])})
    choice, noul, score = result.choices["department"], result.nouls["is_urgent"], result.scores["urgency"]
    assert choice.choice in {"billing", "technical", "sales"} and set(choice.probabilities) == {
        "billing", "technical", "sales"}
    assert abs(sum(choice.probabilities.values()) - 1) < 1e-6 and 0 <= choice.confidence <= 1
    assert choice.probabilities[choice.choice] == max(choice.probabilities.values())
    assert 0 <= noul.noul <= 1
    assert set(score.probabilities) == set(score.legend) == {0, 1, 2} and score.legend[2] == "Needs attention today"
    assert abs(sum(score.probabilities.values()) - 1) < 1e-6
    assert score.score == pytest.approx(sum(k * p for k, p in score.probabilities.items()))
    assert result.model == "local" and result.usage.output_tokens == 0 and result.usage.input_tokens > 0


def test_the_sdk_surfaces_a_422_and_an_unknown_model_404(client, decide_server):
    from typesafe_sdk import Choice, Noul, TypeSafeClient
    from typesafe_sdk import TypeSafeNotFoundError, TypeSafeUnprocessableEntityError

    with pytest.raises(TypeSafeUnprocessableEntityError, match="criteria"):
        client.system_one(state=TICKET, questions={"q": Choice(criteria={"only": None})})
    with TypeSafeClient(api_key=SERVER_KEY, base_url=decide_server.url) as default:  # model: jev-latest
        with pytest.raises(TypeSafeNotFoundError, match="jev-latest.*local"):
            default.system_one(state=TICKET, questions={"q": Noul(instructions="Is it urgent?")})


def test_models_list_carries_typesafes_models_beside_openais_data(client, decide_server):
    listed = client.models.list()
    assert [m.name for m in listed.models] == ["local"] and len(listed.models[0].release_date) == 10
    raw = httpx.get(decide_server.url + "/v1/models", headers={"Authorization": f"Bearer {SERVER_KEY}"}).json()
    assert raw["data"][0]["id"] == "local" and raw["data"][0]["decisions"]["template"] == "chat-v1"


def test_the_sdk_compresses_a_large_state_with_zstd_and_it_is_answered(client, decide_server):
    from typesafe_sdk import Noul
    from typesafe_sdk._core.compression import resolve_compression

    assert resolve_compression(None) == "zstd"  # the extra is installed: bodies of 1 KiB and more go compressed
    state = " ".join([TICKET] * 15)
    assert len(state) > 1024
    seen = []
    client._http_client.event_hooks["request"].append(lambda r: seen.append(r.headers.get("Content-Encoding")))
    try:
        result = client.system_one(state=state, questions={"is_urgent": Noul(instructions="Is this urgent?")})
    finally:
        client._http_client.event_hooks["request"].clear()
    assert seen == ["zstd"] and 0 <= result.nouls["is_urgent"].noul <= 1


def test_every_route_takes_gzip_and_zstd_bodies_within_the_limit(decide_server):
    from backports.zstd import compress

    headers = {"Authorization": f"Bearer {SERVER_KEY}", "Content-Type": "application/json"}
    body = json.dumps({"model": "local", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                       "temperature": 0}).encode()
    url = decide_server.url + "/v1/chat/completions"
    plain = httpx.post(url, content=body, headers=headers, timeout=120).json()["choices"][0]["message"]["content"]
    for encoding, data in (("gzip", gzip.compress(body)), ("zstd", compress(body))):
        r = httpx.post(url, content=data, headers={**headers, "Content-Encoding": encoding}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain
    bomb = compress(b'{"state": "' + b"a" * (64 << 20) + b'"}')  # 64 MiB of text in a few KiB
    r = httpx.post(decide_server.url + "/v1/systemone", content=bomb,
                   headers={**headers, "Content-Encoding": "zstd"}, timeout=120)
    assert r.status_code == 413 and "decoded" in r.json()["error"]["message"]
    for encoding, data, status in (("zstd", b"not zstd", 400), ("br", body, 415)):
        r = httpx.post(url, content=data, headers={**headers, "Content-Encoding": encoding}, timeout=120)
        assert r.status_code == status, r.text


def test_batch_runs_decision_lines_and_resumes(tmp_path, smollm2_gguf, smol):
    from engine.decisions.scoring import score_request
    from tests.test_cli import goinfer

    lines = [{"custom_id": "d1", "method": "POST", "url": "/v1/systemone",
              "body": {"model": "local", "state": TICKET, "questions": QUESTIONS}},
             {"custom_id": "d2", "method": "POST", "url": "/v1/systemone",
              "body": {"state": TICKET, "questions": {"q": {"type": "score", "criteria": ["only"]}}}},
             {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    refused = goinfer("batch", str(src), "-o", str(out), "--model", str(smollm2_gguf))
    # d2 breaks a rule: the check of every line refuses the file before anything runs, naming the line and the rule
    assert refused.returncode == 2 and not out.exists(), refused.stderr
    assert f"{src}:2: questions.q.criteria" in refused.stderr, refused.stderr
    src.write_text("".join(json.dumps(x) + "\n" for x in lines if x["custom_id"] != "d2"))
    r = goinfer("batch", str(src), "-o", str(out), "--model", str(smollm2_gguf))
    assert r.returncode == 0, r.stderr
    records = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"d1", "c1"}
    answers = records["d1"]["response"]["body"]["answers"]
    expected = score_request(smol, parse_decision_request(lines[0]["body"]), "chat-v1").probabilities
    assert np.allclose(list(answers["department"]["probabilities"].values()), expected["department"], atol=1e-6)
    assert answers["is_urgent"]["noul"] == pytest.approx(expected["is_urgent"][0], abs=1e-6)
    again = goinfer("batch", str(src), "-o", str(out), "--model", str(smollm2_gguf))
    assert again.returncode == 0 and len(out.read_text().splitlines()) == 2  # done lines are not done twice


# ---------------------------------------------------------------------------------------------- calibration

@pytest.mark.parametrize("true_t", [0.6, 2.5])
def test_the_fitter_recovers_a_known_temperature_from_synthetic_items(true_t):
    from engine.decisions.calibration import fit_temperature, metrics

    rng = np.random.default_rng(0)
    logits, answers = [], []
    for n in range(4000):  # a kind's questions may differ in option count: half of 2, half of 4
        z = rng.normal(0, 3.0, 2 if n % 2 else 4)
        p = np.exp(z / true_t) / np.exp(z / true_t).sum()
        logits.append(z)
        answers.append(int(rng.choice(len(z), p=p)))
    fitted = fit_temperature(logits, answers)
    assert abs(fitted / true_t - 1) <= 0.05
    before, after = metrics(logits, answers), metrics(logits, answers, fitted)
    assert after["nll"] <= before["nll"] and after["ece"] < 0.03 and after["top1"] == before["top1"]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory, smollm2_gguf):
    """decisions-calibrate on the first ten reviews of the committed labelled set."""
    from tests.test_cli import goinfer

    root = tmp_path_factory.mktemp("calibrate")
    labelled = root / "ten.jsonl"
    reviews = (ROOT / "testdata" / "decisions" / "reviews.jsonl").read_text().splitlines()
    labelled.write_text("\n".join(reviews[:10]) + "\n")
    out = root / "calibration.json"
    r = goinfer("decisions-calibrate", "--model", str(smollm2_gguf), str(labelled), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "held-out" in r.stderr  # the report's table
    return json.loads(out.read_text()), out, labelled, r.stderr


def test_calibrate_writes_a_temperature_per_kind_with_before_and_after(calibration):
    data, _, _, _ = calibration
    assert data["template"] == "chat-v1" and data["model"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert set(data["kinds"]) == {"noul", "choice", "score"}
    for entry in data["kinds"].values():
        assert 0.05 <= entry["temperature"] <= 20 and entry["items"] == 8 and entry["held_out"]["items"] == 2
        assert entry["after"]["nll"] <= entry["before"]["nll"] + 1e-9


def test_serve_applies_a_calibration_and_refuses_one_for_another_template(calibration, tmp_path, smollm2_gguf):
    from tests.test_cli import goinfer

    data, path, labelled, _ = calibration
    s = start_server(tmp_path / "serve.log", "--model", f"local={smollm2_gguf}", "--decisions-calibration", str(path))
    try:
        body = json.loads(labelled.read_text().splitlines()[0])
        body.pop("answers")
        r = httpx.post(s.url + "/v1/systemone", json={**body, "model": "local"}, timeout=120).json()
    finally:
        stop(s)
    assert r["goinfer"]["calibrated"] == {"noul": True, "choice": True, "score": True}
    from engine import load_model
    from engine.decisions.scoring import score_request, softmax

    scored = score_request(load_model(str(smollm2_gguf)), parse_decision_request(body), "chat-v1")
    t = data["kinds"]["choice"]["temperature"]
    assert np.allclose(list(r["answers"]["topic"]["probabilities"].values()),
                       softmax(scored.label_logits["topic"], t), atol=1e-6)
    bad = goinfer("serve", "--model", str(smollm2_gguf), "--decisions-template", "bare-v1",
                  "--decisions-calibration", str(path))
    assert bad.returncode == 2 and "fitted under template 'chat-v1'" in bad.stderr
    assert bad.stderr.strip().count("\n") == 0


def test_calibrate_off_a_terminal_states_the_time_up_front_and_prints_progress(calibration):
    _, out, _, stderr = calibration
    lines = stderr.splitlines()
    up_front = [n for n, line in enumerate(lines) if line.startswith("goinfer: 10 items to score, about ")]
    assert up_front and "on this machine" in lines[up_front[0]]
    assert "goinfer: scored 10/10 items (" in stderr
    assert up_front[0] < lines.index(next(line for line in lines if line.startswith("goinfer: scored 10/10")))
    assert not out.with_name(out.name + ".journal").exists()  # a finished run leaves no journal


def test_a_killed_calibration_resumes_and_a_journal_of_another_run_is_refused(calibration, tmp_path, smollm2_gguf):
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.test_cli import goinfer

    data, _, labelled, _ = calibration
    out = tmp_path / "calibration.json"
    journal = tmp_path / "calibration.json.journal"
    args = ["decisions-calibrate", "--model", str(smollm2_gguf), str(labelled), "-o", str(out)]
    with open(tmp_path / "first.err", "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "goinfer_cli.app", *args], stderr=log, cwd=ROOT,
                               env=dict(os.environ, NO_COLOR="1"))
        try:
            deadline = time.monotonic() + 240
            while not (journal.exists() and journal.read_text().count("\n") >= 3):  # the header and two items
                assert run.poll() is None and time.monotonic() < deadline, "the run ended before it was killed"
                time.sleep(0.02)
        finally:
            run.send_signal(signal.SIGKILL)
            run.wait()
    assert not out.exists()
    kept = journal.read_text().count("\n") - 1  # complete item lines (a line cut in half is not one)
    assert 2 <= kept < 10

    other = tmp_path / "nine.jsonl"
    other.write_text("\n".join(labelled.read_text().splitlines()[:9]) + "\n")
    for bad_args, differs in ((args + ["--decisions-template", "bare-v1"], "its template differ"),
                              (args[:3] + [str(other), "-o", str(out)], "its labelled set differ")):
        bad = goinfer(*bad_args)
        assert bad.returncode == 2 and differs in bad.stderr and str(journal) in bad.stderr, bad.stderr
        assert bad.stderr.strip().count("\n") == 0
    assert journal.read_text().count("\n") - 1 == kept  # a refused run leaves the journal as it was

    again = goinfer(*args)
    assert again.returncode == 0, again.stderr
    assert f"goinfer: resumed {kept} of 10 items from {journal}" in again.stderr
    assert f"{10 - kept} items to score" in again.stderr and "scored 10/10 items" in again.stderr
    assert json.loads(out.read_text()) == data  # the same file as the uninterrupted run's
    assert not journal.exists()


def test_a_bad_labelled_line_is_refused_in_one_line(tmp_path):
    from tests.test_cli import goinfer

    labelled = tmp_path / "bad.jsonl"
    for answers, message in (({"department": "sports"}, "answers.department: 'sports' is not one of its options"),
                             ({"topic": "food"}, "answers must name its questions")):
        labelled.write_text(json.dumps({"state": "x", "questions": QUESTIONS, "answers": answers}) + "\n")
        r = goinfer("decisions-calibrate", "--model", "smollm2-135m", str(labelled), "-o", str(tmp_path / "c.json"))
        assert r.returncode == 2 and message in r.stderr and f"{labelled}:1:" in r.stderr
        assert r.stderr.strip().count("\n") == 0
