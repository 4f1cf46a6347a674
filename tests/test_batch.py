"""`goinfer batch` as a user runs it: a real process on the real default model, killed and resumed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--temp", "0", "--max", "3"]  # greedy everywhere; lines without max_tokens get 3


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "goinfer_cli.app", "batch", *args]


def _env() -> dict:
    return dict(os.environ, NO_COLOR="1")


def goinfer_batch(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())


def start_batch(*args: str) -> subprocess.Popen:
    return subprocess.Popen(_cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=_env())


def chat(cid: str, text: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": text}], **body}}


def cmpl(cid: str, prompt: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


LINES = [
    cmpl("c1", "Once upon a time", max_tokens=4),
    chat("c2", "What is the capital of France?", max_tokens=3, logprobs=True, top_logprobs=2),
    cmpl("c3", "The sky is", temperature=0),
    cmpl("c4", "1, 2, 3,"),
    cmpl("c5", "Hello, my name", max_tokens=4, logprobs=1),
    cmpl("c6", "In 1999 the", max_tokens=4),
    cmpl("c7", "Water boils at", max_tokens=4),
    cmpl("c8", "My favourite food", max_tokens=4),
]


def write_input(path: Path, lines: list) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def comparable(body: dict) -> dict:
    """A response body without what differs between two runs of the same request."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def one_error_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def clean(tmp_path_factory, smollm2_gguf) -> dict:
    """One uninterrupted run of LINES: custom_id -> response body (the reference the resumed runs must equal)."""
    d = tmp_path_factory.mktemp("clean")
    inp, out = write_input(d / "in.jsonl", LINES), d / "out.jsonl"
    r = goinfer_batch(str(inp), "-o", str(out), "--model", str(smollm2_gguf), *FLAGS)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""  # data only in the output files
    progress = [ln for ln in r.stderr.splitlines() if re.match(r"goinfer: \[\d+/8\] c\d ok \d+ tok", ln)]
    assert len(progress) == 8, r.stderr  # one plain line per finished request when stderr is not a terminal
    assert not (d / "out.errors.jsonl").exists()
    recs = records(out)
    assert [rec["custom_id"] for rec in recs] == [ln["custom_id"] for ln in LINES]
    return {"dir": d, "out": out, "bodies": {rec["custom_id"]: rec["response"]["body"] for rec in recs}}


def test_clean_run_writes_openai_batch_records(clean):
    rec = records(clean["out"])[1]
    assert rec["id"].startswith("batch_req_") and rec["error"] is None
    assert rec["response"]["status_code"] == 200 and rec["response"]["request_id"].startswith("req_")
    chat_body = clean["bodies"]["c2"]
    assert chat_body["object"] == "chat.completion"
    assert chat_body["choices"][0]["message"]["content"] and chat_body["usage"]["completion_tokens"] == 3
    content = chat_body["choices"][0]["logprobs"]["content"]  # logprobs in a line are honoured
    assert content and all(len(c["top_logprobs"]) == 2 for c in content)
    assert clean["bodies"]["c5"]["choices"][0]["logprobs"]["token_logprobs"]
    # sampling precedence: the body's max_tokens wins; the --max flag fills in where the body says nothing
    assert clean["bodies"]["c1"]["usage"]["completion_tokens"] == 4
    assert clean["bodies"]["c4"]["usage"]["completion_tokens"] == 3
    assert clean["bodies"]["c4"]["choices"][0]["finish_reason"] == "length"


def _wait_for_finished_lines(proc: subprocess.Popen, n: int) -> None:
    seen = 0
    while seen < n:
        line = proc.stderr.readline()
        if not line:
            return  # the process ended first
        if re.match(r"goinfer: \[\d+/\d+\] \S+ (ok|error)", line):
            seen += 1


def _check_whole_lines(out: Path) -> list[str]:
    """custom_ids in out; every line but a torn last one (which a rerun cuts) must parse."""
    if not out.exists():
        return []
    text = out.read_text()
    lines = text.split("\n")
    whole = lines[:-1]  # after the last newline: "" or a torn line
    ids = [json.loads(ln)["custom_id"] for ln in whole]
    assert len(ids) == len(set(ids)), ids
    return ids


@pytest.mark.parametrize("parallel", [1, 3])
def test_sigkill_anywhere_then_rerun_equals_a_clean_run(tmp_path, smollm2_gguf, clean, parallel):
    # --parallel 3: lines decoded together, recorded as they end; the answers are the sequential run's
    inp, out = write_input(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"
    args = (str(inp), "-o", str(out), "--model", str(smollm2_gguf), *FLAGS, "--parallel", str(parallel))

    # 1. killed while starting up, before any line finished
    p = start_batch(*args)
    time.sleep(0.3)
    p.kill()
    p.wait()
    assert _check_whole_lines(out) == []

    # 2. killed just after the first line finished: the second is in flight
    p = start_batch(*args)
    _wait_for_finished_lines(p, 1)
    p.send_signal(signal.SIGKILL)
    p.wait()
    after_first_kill = _check_whole_lines(out)
    assert 1 <= len(after_first_kill) < len(LINES), after_first_kill

    # 3. resumed, then killed in the middle of a later line
    p = start_batch(*args)
    _wait_for_finished_lines(p, 2)
    p.kill()
    p.wait()
    after_second_kill = _check_whole_lines(out)
    assert after_second_kill[: len(after_first_kill)] == after_first_kill  # nothing written is ever rewritten
    assert len(after_second_kill) > len(after_first_kill)

    # 4. Ctrl-C: the line in flight is abandoned cleanly, exit 130
    p = start_batch(*args)
    _wait_for_finished_lines(p, 1)
    p.send_signal(signal.SIGINT)
    p.wait(timeout=120)
    # read through the text wrapper: readline above may hold more of stderr in its buffer (communicate() reads the
    # pipe itself and would lose it: CI once saw an empty stderr)
    stderr = p.stderr.read()
    ids = _check_whole_lines(out)
    if p.returncode != 0:  # 0 only if the run had already finished when the signal came
        assert p.returncode == 130, stderr
        assert "Traceback" not in stderr
        assert "interrupted" in stderr or len(ids) == len(LINES), stderr  # (or the signal met a finished run)
        assert out.read_text().endswith("\n")  # never a torn line after Ctrl-C

    # 5. rerun: it finishes what is left
    r = goinfer_batch(*args)
    assert r.returncode == 0, r.stderr
    recs = records(out)  # every line parses
    got = [rec["custom_id"] for rec in recs]
    assert sorted(got) == sorted(ln["custom_id"] for ln in LINES) and len(got) == len(set(got))
    assert len(ids) <= len(got)
    for rec in recs:
        assert rec["error"] is None and rec["response"]["status_code"] == 200
        assert comparable(rec["response"]["body"]) == comparable(clean["bodies"][rec["custom_id"]]), rec["custom_id"]
    assert not (tmp_path / "out.errors.jsonl").exists()


def test_torn_last_line_is_cut_and_redone(tmp_path, smollm2_gguf, clean):
    inp, out = write_input(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"
    data = clean["out"].read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    out.write_bytes(data[: last_start + (len(data) - last_start) // 2])  # the process died mid-write
    r = goinfer_batch(str(inp), "-o", str(out), "--model", str(smollm2_gguf), *FLAGS)
    assert r.returncode == 0, r.stderr
    assert "7 already in" in r.stderr and "1 to run" in r.stderr
    recs = records(out)
    assert [rec["custom_id"] for rec in recs] == [ln["custom_id"] for ln in LINES]
    assert comparable(recs[-1]["response"]["body"]) == comparable(clean["bodies"]["c8"])


def test_nothing_left_to_do_exits_without_loading_the_model(tmp_path, clean):
    inp, out = write_input(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"
    shutil.copy(clean["out"], out)
    before = out.read_bytes()
    r = goinfer_batch(str(inp), "-o", str(out), "--model", str(tmp_path / "no-such-model.gguf"), *FLAGS)
    assert r.returncode == 0, r.stderr  # the missing model file is never opened
    assert "nothing to do" in r.stderr
    assert out.read_bytes() == before


def test_duplicate_custom_id_is_refused_before_any_work(tmp_path):
    inp = write_input(tmp_path / "in.jsonl", [cmpl("a", "x"), cmpl("b", "y"), "", cmpl("a", "z")])
    out = tmp_path / "out.jsonl"
    r = goinfer_batch(str(inp), "-o", str(out), "--model", str(tmp_path / "no-such-model.gguf"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [f"goinfer: error: {inp}:4: duplicate custom_id 'a' on lines 1 and 4",
                                     f"goinfer: error: nothing was run: fix this line of {inp} and run again"]
    assert not out.exists()


def bad_lines(r: subprocess.CompletedProcess, inp: Path) -> dict[int, str]:
    """The refusal of a file with bad lines: exit 2, line number -> problem, one stderr line each."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    *problems, last = r.stderr.splitlines()
    assert last == f"goinfer: error: nothing was run: fix these {len(problems)} lines of {inp} and run again", last
    found = {}
    for line in problems:
        m = re.fullmatch(rf"goinfer: error: {re.escape(str(inp))}:(\d+): (.+)", line)
        assert m, line
        found[int(m[1])] = m[2]
    return found


def test_bad_lines_stop_the_run_before_it_starts_each_named_by_its_line(tmp_path, smollm2_gguf, clean):
    lines = [
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        LINES[0],
        json.dumps({"custom_id": "m4", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}),
        json.dumps({"custom_id": "m5", "method": "POST", "url": "/v1/images/generations", "body": {"prompt": "x"}}),
        json.dumps({"custom_id": "m6", "method": "POST", "url": "/v1/completions"}),
        json.dumps({"custom_id": "m7", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": "hi"}}),
        json.dumps({"custom_id": "m8", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "x", "temperature": -1}}),
        json.dumps({"custom_id": "m9", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "x", "frobnicate": True}}),
        json.dumps(["a", "list"]),
        # a role that is not a string once raised out of the parser and ended the run with a traceback
        json.dumps({"custom_id": "m10", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": {}, "content": "x"}]}}),
        '{"custom_id": "m12", "method": "POST" "url": "/v1/completions"}',
        LINES[1],
        json.dumps(cmpl("m4", "the custom_id of line 4 again")),
    ]
    inp, out = write_input(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    # the model is never loaded: the file is refused first, and nothing is written
    r = goinfer_batch(str(inp), "-o", str(out), "--model", str(tmp_path / "no-such-model.gguf"), *FLAGS)
    found = bad_lines(r, inp)
    assert sorted(found) == [1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14]  # 3 and 13 are good lines
    assert not out.exists() and not (tmp_path / "out.errors.jsonl").exists()
    assert "not valid JSON" in found[1] and "column 2" in found[1]
    assert "custom_id is missing" in found[2]
    assert "'GET'" in found[4] and "'/v1/images/generations'" in found[5] and "body is missing" in found[6]
    assert "messages" in found[7] and "temperature" in found[8] and "frobnicate" in found[9]
    assert "JSON object" in found[10] and "role" in found[11]
    assert "Expecting ',' delimiter at column 39" in found[12]
    assert found[14] == "duplicate custom_id 'm4' on lines 4 and 14"

    # more than 20: the first 20 named, then how many more
    many = write_input(tmp_path / "many.jsonl", [LINES[0]] + [f"{{broken {i}" for i in range(25)])
    r = goinfer_batch(str(many), "-o", str(out), "--model", str(tmp_path / "no-such-model.gguf"), *FLAGS)
    assert r.returncode == 2 and not out.exists(), r.stderr
    shown = r.stderr.splitlines()
    assert len(shown) == 22 and shown[0].startswith(f"goinfer: error: {many}:2: not valid JSON")
    assert shown[19].startswith(f"goinfer: error: {many}:21: ") and shown[20] == "goinfer: error: ... and 5 more"
    assert shown[21] == f"goinfer: error: nothing was run: fix these 25 lines of {many} and run again"

    # the lines fixed, the file runs
    write_input(inp, [LINES[0], LINES[1]])
    r = goinfer_batch(str(inp), "-o", str(out), "--model", str(smollm2_gguf), *FLAGS)
    assert r.returncode == 0, r.stderr
    assert [comparable(rec["response"]["body"]) for rec in records(out)] == \
        [comparable(clean["bodies"][c]) for c in ("c1", "c2")]


def test_a_line_that_fails_while_running_is_named_and_a_rerun_retries_only_it(tmp_path, smollm2_gguf, clean):
    # valid as a request, refused only by the model: a prompt longer than its context window
    lines = [LINES[0], cmpl("long", "hello " * 9000), LINES[2]]
    inp, out = write_input(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    errors = tmp_path / "out.errors.jsonl"
    for _ in range(2):  # the rerun retries the failed line (and fails it the same way), nothing else
        r = goinfer_batch(str(inp), "-o", str(out), "--model", str(smollm2_gguf), *FLAGS)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert [rec["custom_id"] for rec in records(out)] == ["c1", "c3"]
        (err,) = records(errors)
        assert err["custom_id"] == "long" and "context window" in err["error"]["message"]
        summary = r.stderr.splitlines()[-1]
        assert "1 failed: input line 2 " in summary and str(errors) in summary, summary
        assert "retries only them" in summary and "unless their cause is fixed" in summary, summary
        assert "rerun the same command to retry" not in r.stderr
    assert "0 done, 1 failed" in summary  # c1 and c3 were not run again


def test_lines_asking_for_what_the_runner_cannot_do_are_refused_by_name(tmp_path):
    lines = [
        chat("t1", "weather?", tools=[{"type": "function", "function": {"name": "get_weather",
                                                                          "parameters": {"type": "foo"}}}]),
        {"custom_id": "t2", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}},
        chat("t3", "Say hi", n=17),
        cmpl("t4", "Say hi", n=20),
    ]
    inp, out = write_input(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    r = goinfer_batch(str(inp), "-o", str(out), "--model", str(tmp_path / "no-such-model.gguf"))
    found = bad_lines(r, inp)
    # tools are run (as the server runs them); a schema that cannot be enforced is refused by name
    assert "tools[0].function.parameters" in found[1]
    assert "image" in found[2] and "messages[0].content[1]" in found[2]
    assert "at most 16 choices" in found[3] and "got 17" in found[3]
    assert "at most 16 choices" in found[4]
    assert not out.exists()


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_input_is_refused(tmp_path, content):
    inp = tmp_path / "in.jsonl"
    inp.write_text(content)
    out = tmp_path / "out.jsonl"
    one_error_line(goinfer_batch(str(inp), "-o", str(out)), "no requests")
    assert not out.exists()


def test_missing_input_is_refused(tmp_path):
    one_error_line(goinfer_batch(str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl")), "no such file")


@pytest.mark.parametrize("where", ["missing_dir", "directory", "under_a_file", "same_as_input"])
def test_unwritable_output_is_refused_before_loading_the_model(tmp_path, where):
    inp = write_input(tmp_path / "in.jsonl", LINES[:1])
    (tmp_path / "plain").write_text("x")
    out = {"missing_dir": tmp_path / "no" / "such" / "out.jsonl", "directory": tmp_path,
           "under_a_file": tmp_path / "plain" / "out.jsonl", "same_as_input": inp}[where]
    before = inp.read_bytes()
    r = goinfer_batch(str(inp), "-o", str(out), "--model", str(tmp_path / "no-such-model.gguf"))
    one_error_line(r, str(out))
    assert "no-such-model" not in r.stderr
    assert inp.read_bytes() == before


def test_output_that_is_not_a_batch_file_is_refused(tmp_path):
    inp = write_input(tmp_path / "in.jsonl", LINES[:1])
    out = tmp_path / "out.jsonl"
    out.write_text("these are my notes\n")
    one_error_line(goinfer_batch(str(inp), "-o", str(out), "--model", str(tmp_path / "m.gguf")),
                   "not a batch output record")
    assert out.read_text() == "these are my notes\n"


def test_bad_flag_value(tmp_path):
    inp = write_input(tmp_path / "in.jsonl", LINES[:1])
    one_error_line(goinfer_batch(str(inp), "-o", str(tmp_path / "o.jsonl"), "--temp", "-1"), "--temp")


def test_a_slow_request_off_a_terminal_says_it_is_still_running(monkeypatch, capsys, tmp_path):
    from commands import batch
    from engine.batch.runner import BatchPlan, LineResult

    clock = [1000.0]
    monkeypatch.setattr(batch.time, "monotonic", lambda: clock[0])
    view = batch._ProgressView()
    view._tty = False
    view.plan(BatchPlan(total=3, done=1, to_run=2, output=tmp_path / "o.jsonl", errors=tmp_path / "e.jsonl"))
    for second in range(1, 150):  # a request generating a token a second for two and a half minutes
        clock[0] = 1000.0 + second
        view.token(second)
    view.line(LineResult("q2", 2, True, 149, 149.0))
    lines = capsys.readouterr().err.strip().splitlines()
    still = [x for x in lines if "still running" in x]
    assert len(still) == 2 and still[0].startswith("goinfer: [1/3] still running: 60 tok into the current request")
    assert "elapsed 1m" in still[0] and lines[-1].startswith("goinfer: [2/3] q2 ok 149 tok")


def test_a_messages_line_is_answered_with_an_anthropic_message(tmp_path, smollm2_gguf):
    import engine
    from engine.batch.runner import run_batch

    src = tmp_path / "in.jsonl"
    body = {"max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/messages", "body": body}) + "\n")
    model = engine.load_model(str(smollm2_gguf), selftest=False)
    summary = run_batch(src, tmp_path / "out.jsonl", lambda: model)
    record = json.loads((tmp_path / "out.jsonl").read_text())
    message = record["response"]["body"]
    assert summary.succeeded == 1 and message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["type"] == "text" and message["usage"]["output_tokens"] >= 1


def test_the_eta_shows_a_time_once_a_line_has_finished():
    from commands.batch import eta

    assert eta(5.0, 0, 4) == "-:--:--"  # nothing finished yet: no pace to go by
    assert eta(30.0, 1, 3) == "1m30s" and eta(10.0, 2, 1) == "5s" and eta(10.0, 2, 0) == "0s"


def test_the_progress_bar_on_a_terminal_shows_an_eta_after_the_first_line(monkeypatch, tmp_path):
    import io

    from rich.console import Console

    from commands import batch
    from engine.batch.runner import BatchPlan, LineResult

    screen = io.StringIO()
    monkeypatch.setattr(batch, "err", Console(file=screen, force_terminal=True, width=120, no_color=True))
    clock = [1000.0]
    monkeypatch.setattr(batch.time, "monotonic", lambda: clock[0])
    view = batch._ProgressView()
    view.plan(BatchPlan(total=5, done=1, to_run=4, output=tmp_path / "o.jsonl", errors=tmp_path / "e.jsonl"))
    view.token(1)
    view._progress.refresh()
    assert "eta -:--:--" in screen.getvalue()  # before any line finished
    clock[0] += 20.0  # the first line takes 20 s: three left, about a minute
    view.line(LineResult("q2", 2, True, 8, 20.0))
    view._progress.refresh()
    assert "eta 1m00s" in screen.getvalue()
    clock[0] += 5.0  # and it counts down while the next line runs
    view.token(3)
    view._progress.refresh()
    view.close()
    assert "eta 55s" in screen.getvalue() and "-:--:--" not in screen.getvalue().split("eta 1m00s", 1)[1]
