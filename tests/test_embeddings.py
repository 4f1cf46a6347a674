"""Embeddings: the built-in sentence encoder (minilm-l6, all-MiniLM-L6-v2 from PyPI) against the reference vectors of
../shared/families/embeddings-minilm (transformers float32), and /v1/embeddings over HTTP with the official openai
SDK: single input, a batch, dimensions, base64, token ids, and every bad input a 400 naming its field."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest

from engine.embeddings import load_embedding_model
from tests.conftest import HAVE_KIT, KIT, SERVER_KEY, in_kit, needs_kit
from tests.test_server import start_server, stop

# transformers' vectors (the family kit's; the tests that read them skip without it)
STRINGS = json.loads((KIT / "embeddings-minilm" / "reference.json").read_text())["strings"] if HAVE_KIT else []


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def minilm():
    return load_embedding_model("minilm-l6")


def test_the_builtin_encoder_is_minilm(minilm):
    assert (minilm.dimension, minilm.pooling, minilm.normalize, minilm.context) == (384, "mean", True, 256)


@needs_kit
def test_tokens_are_the_reference_tokens(minilm):
    assert minilm.tokenize([s["text"] for s in STRINGS]) == [s["hf_tokens"] for s in STRINGS]


@needs_kit
def test_every_reference_vector_is_matched_at_f32(minilm):
    ours = minilm.embed(minilm.tokenize([s["text"] for s in STRINGS]))
    reference = np.array([s["embedding"] for s in STRINGS], np.float32)
    assert _cosines(ours, reference).min() >= 0.99999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


@needs_kit
def test_a_batch_gives_each_input_the_vector_it_gets_alone(minilm):
    texts = [s["text"] for s in STRINGS[:8]]
    together = minilm.embed(minilm.tokenize(texts))  # one pass: the sequences share the matrices
    alone = np.concatenate([minilm.embed(minilm.tokenize([t])) for t in texts])
    assert _cosines(together, alone).min() >= 0.999999


@pytest.fixture(scope="module")
def bert_ggufs(tmp_path_factory, minilm):
    """The built-in encoder written as `bert` GGUFs the way llama.cpp's converter writes them (f16, Q8_0)."""
    from testdata.make_bert_gguf import write_bert_gguf

    root = tmp_path_factory.mktemp("bert-gguf")
    return {kind: write_bert_gguf(minilm.path, root / f"minilm.{kind}.gguf", kind) for kind in ("f16", "q8_0")}


@needs_kit
@pytest.mark.parametrize("kind,floor", [("f16", 0.99999), ("q8_0", 0.999)])
def test_the_gguf_form_gives_the_same_vectors(bert_ggufs, kind, floor):
    model = load_embedding_model(str(bert_ggufs[kind]))
    assert (model.dimension, model.pooling, model.normalize) == (384, "mean", True)
    tokens = model.tokenize([s["text"] for s in STRINGS])
    assert tokens == [s["hf_tokens"] for s in STRINGS]  # the WordPiece vocabulary read back from phantom form
    reference = np.array([s["embedding"] for s in STRINGS], np.float32)
    assert _cosines(model.embed(tokens), reference).min() >= floor


@needs_kit
def test_every_reference_vector_is_matched_at_q8():
    """--embed-quant q8: the encoder's matrices as Q8_0 blocks. A batch (dequantized blocks, f32 activations) and
    each input alone (the short ones take the integer matvec, int8 activations) both hold the issue's floor."""
    model = load_embedding_model("minilm-l6", quant="q8")
    matrices = [layer[i] for layer in model.encoder.layers for i in (0, 2, 5, 7)]  # q|k|v, output, up, down
    assert sum(m.q.rows * m.q.cols for m in matrices) == 6 * (4 * 384 * 384 + 2 * 384 * 1536)
    assert sum(m.q.nbytes for m in matrices) * 32 == sum(m.q.rows * m.q.cols for m in matrices) * 34  # Q8_0
    tokens = model.tokenize([s["text"] for s in STRINGS])
    reference = np.array([s["embedding"] for s in STRINGS], np.float32)
    assert _cosines(model.embed(tokens), reference).min() >= 0.999
    assert min(map(len, tokens)) <= 12  # some go through the integer matvec alone
    alone = np.concatenate([model.embed([t]) for t in tokens])
    assert _cosines(alone, reference).min() >= 0.999


def test_a_q8_0_gguf_at_q8_keeps_its_own_blocks(bert_ggufs):
    from engine.embeddings.bert import Q8Matrix

    model = load_embedding_model(str(bert_ggufs["q8_0"]), quant="q8")
    assert isinstance(model.encoder.layers[0][0], Q8Matrix)
    import gguf
    reader = gguf.GGUFReader(str(bert_ggufs["q8_0"]))
    stored = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    assert np.array_equal(model.encoder.layers[0][5].q.raw.reshape(-1), np.asarray(stored.data).reshape(-1))


@needs_kit
def test_concurrent_requests_share_passes_and_get_their_own_vectors(minilm):
    import threading
    import time

    from engine.embeddings import model as embedding_model
    from engine.embeddings.batcher import EmbeddingQueue

    queue = EmbeddingQueue(minilm)
    requests = [minilm.tokenize([s["text"], STRINGS[-1 - i]["text"]]) for i, s in enumerate(STRINGS[:8])]
    results: dict[int, np.ndarray] = {}
    with embedding_model._COMPUTE:  # the first pass waits on the model: the other requests queue behind it
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, queue.embed(requests[i])))
                   for i in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while queue.waiting < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(60)
    assert queue.passes == 2  # the first request alone, then the seven that queued meanwhile, together
    for i, lists in enumerate(requests):
        assert _cosines(results[i], minilm.embed(lists)).min() >= 0.999999


def _with_pooling(src, dst, pooling_type: int):
    """A copy of a GGUF whose metadata declares a pooling type (llama.cpp's: 1 mean, 3 last)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {f"{arch}.pooling_type": MetadataDetails(gguf.GGUFValueType.UINT32,
                                                                                    pooling_type)}, [])
    return dst


@pytest.mark.parametrize("pooling_type,pooling", [(3, "last"), (1, "mean")])
def test_a_decoder_that_declares_a_pooling_type_embeds_fast_as_exact(tmp_path, pooling_type, pooling):
    from engine.errors import UnsupportedModel

    kit = in_kit("qwen3", "tiny-qwen3-a.Q8_0.gguf")
    path = _with_pooling(kit, tmp_path / "qwen3-embed.gguf", pooling_type)
    fast, exact = load_embedding_model(str(path), quant="q8"), load_embedding_model(str(path))
    assert (fast.pooling, fast.dimension, fast.name) == (pooling, 256, "qwen3-embed")
    texts = ["The cat sat on the mat.", "Hello world, this is a longer sentence to embed.", "x"]
    a, b = fast.embed(fast.tokenize(texts)), exact.embed(exact.tokenize(texts))
    assert _cosines(a, b).min() >= 0.999  # the int8 fast path against the exact f32 path's pooled states
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5) and _cosines(a[:1], a[1:2])[0] < 0.99
    with pytest.raises(UnsupportedModel, match="declares no pooling type"):
        load_embedding_model(str(kit))  # a chat model is not an embedder


# ---------------------------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def embed_server(tmp_path_factory, smollm2_gguf):
    s = start_server(tmp_path_factory.mktemp("serve-embed") / "serve.log", "--model", str(smollm2_gguf),
                     "--embed-model", "minilm-l6", "--api-key", SERVER_KEY)
    yield s
    stop(s)


@pytest.fixture(scope="module")
def sdk(embed_server):
    return openai.OpenAI(base_url=embed_server.url + "/v1", api_key=SERVER_KEY, max_retries=0, timeout=300)


@needs_kit
def test_the_sdk_embeds_one_input_and_a_batch(sdk):
    one = sdk.embeddings.create(model="minilm-l6", input=STRINGS[0]["text"])  # the SDK asks base64, decodes it
    reference = np.array([s["embedding"] for s in STRINGS[:5]], np.float32)
    assert len(one.data) == 1 and _cosines(np.array([one.data[0].embedding]), reference[:1])[0] >= 0.99999
    assert one.usage.prompt_tokens == len(STRINGS[0]["hf_tokens"]) and one.model == "minilm-l6"
    batch = sdk.embeddings.create(model="minilm-l6", input=[s["text"] for s in STRINGS[:5]])
    assert [d.index for d in batch.data] == list(range(5))
    assert _cosines(np.array([d.embedding for d in batch.data]), reference).min() >= 0.99999
    ids = sdk.embeddings.create(model="minilm-l6", input=[STRINGS[0]["hf_tokens"], STRINGS[1]["hf_tokens"]])
    assert _cosines(np.array([d.embedding for d in ids.data]), reference[:2]).min() >= 0.99999


def test_dimensions_and_base64(sdk):
    full = np.array(sdk.embeddings.create(model="minilm-l6", input="a cat").data[0].embedding)
    short = sdk.embeddings.create(model="minilm-l6", input="a cat", dimensions=64, encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(short.data[0].embedding), "<f4")
    assert len(vector) == 64 and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert np.allclose(vector, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


def test_models_lists_the_embedding_model_with_its_dimension(sdk):
    entries = {m.id: m for m in sdk.models.list().data}
    assert entries["minilm-l6"].model_extra["dimensions"] == 384
    assert entries["minilm-l6"].model_extra["type"] == "embedding"


@pytest.mark.parametrize("body,param", [
    ({"model": "minilm-l6"}, "input"),
    ({"model": "minilm-l6", "input": ""}, "input"),
    ({"model": "minilm-l6", "input": []}, "input"),
    ({"model": "minilm-l6", "input": ["a", ""]}, "input[1]"),
    ({"model": "minilm-l6", "input": ["a", 5]}, "input[1]"),
    ({"model": "minilm-l6", "input": {"text": "a"}}, "input"),
    ({"model": "minilm-l6", "input": ["a"] * 2049}, "input"),
    ({"model": "minilm-l6", "input": "word " * 300}, "input"),
    ({"model": "minilm-l6", "input": [1, 2, 10 ** 6]}, "input"),
    ({"model": "minilm-l6", "input": "a", "dimensions": 385}, "dimensions"),
    ({"model": "minilm-l6", "input": "a", "dimensions": 0}, "dimensions"),
    ({"model": "minilm-l6", "input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"model": "minilm-l6", "input": "a", "input_type": "poem"}, "input_type"),
    ({"model": "minilm-l6", "input": "a", "truncate": True}, "truncate"),
    ({"model": "nope", "input": "a"}, "model"),
    ({"model": "SmolLM2-135M-Instruct.Q4_1", "input": "a"}, "model"),  # a chat model does not embed
])
def test_bad_input_is_a_client_error_naming_the_field(embed_server, body, param):
    r = httpx.post(embed_server.url + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {SERVER_KEY}"},
                   timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


# ---------------------------------------------------------------------------------------------- batch lines

@needs_kit
def test_batch_runs_embeddings_lines_beside_chat_lines_and_resumes(tmp_path, smollm2_gguf):
    from tests.test_cli import goinfer

    lines = [{"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "minilm-l6", "input": [STRINGS[0]["text"], STRINGS[1]["text"]]}},
             {"custom_id": "e2", "method": "POST", "url": "/v1/embeddings", "body": {"input": ""}},
             {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    refused = goinfer("batch", str(src), "-o", str(out), "--model", str(smollm2_gguf))
    # e2 breaks a rule: the check of every line refuses the file before anything runs, naming the line
    assert refused.returncode == 2 and f"{src}:2: input" in refused.stderr and not out.exists(), refused.stderr
    src.write_text("".join(json.dumps(x) + "\n" for x in lines if x["custom_id"] != "e2"))
    r = goinfer("batch", str(src), "-o", str(out), "--model", str(smollm2_gguf))
    assert r.returncode == 0, r.stderr
    records = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"e1", "c1"}
    body = records["e1"]["response"]["body"]
    vectors = np.array([d["embedding"] for d in body["data"]], np.float32)
    reference = np.array([s["embedding"] for s in STRINGS[:2]], np.float32)
    assert _cosines(vectors, reference).min() >= 0.99999 and body["model"] == "minilm-l6"
    assert records["c1"]["response"]["body"]["object"] == "chat.completion"
    again = goinfer("batch", str(src), "-o", str(out), "--model", str(smollm2_gguf))
    assert again.returncode == 0 and len(out.read_text().splitlines()) == 2  # done lines are not done twice


def test_input_type_puts_the_models_instruction_prefix_before_the_text(tmp_path, minilm):
    import shutil

    from engine.api.embeddings import parse_embeddings_request, token_lists

    prompted = tmp_path / "prompted"
    shutil.copytree(minilm.path, prompted)
    (prompted / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "document": "passage: "}, "default_prompt_name": "document"}))
    model = load_embedding_model(str(prompted))
    ask = lambda **body: token_lists(model, parse_embeddings_request({"input": "a cat", **body}))[0]  # noqa: E731
    assert ask(input_type="query") == model.tokenize(["query: a cat"])[0]
    assert ask() == ask(input_type="document") == model.tokenize(["passage: a cat"])[0]
    plain = token_lists(minilm, parse_embeddings_request({"input": "a cat", "input_type": "query"}))[0]
    assert plain == minilm.tokenize(["a cat"])[0]  # no prefixes: nothing changes


@needs_kit
def test_embed_quant_q8_runs_batch_lines_and_a_bad_one_is_refused_in_one_line(tmp_path):
    from tests.test_cli import goinfer

    line = {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings", "body": {"input": STRINGS[0]["text"]}}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps(line) + "\n")
    r = goinfer("batch", str(src), "-o", str(out), "--embed-quant", "q8")
    assert r.returncode == 0, r.stderr
    (record,) = map(json.loads, out.read_text().splitlines())
    vector = np.array([record["response"]["body"]["data"][0]["embedding"]], np.float32)
    assert _cosines(vector, np.array([STRINGS[0]["embedding"]], np.float32))[0] >= 0.999
    for command in (["serve", "--embed-model", "minilm-l6"], ["batch", str(src), "-o", str(tmp_path / "x.jsonl")]):
        bad = goinfer(*command, "--embed-quant", "q4")
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
        assert "--embed-quant must be one of f32, q8, got 'q4'" in bad.stderr


def test_embeddings_have_their_own_64_mib_body_limit(embed_server):
    auth = {"Authorization": f"Bearer {SERVER_KEY}", "Content-Type": "application/json"}
    health = httpx.get(embed_server.url + "/health", headers=auth, timeout=30).json()["limits"]
    assert health["max_embeddings_body_bytes"] == 64 << 20 and health["max_body_bytes"] == 4 << 20

    def body(size: int) -> bytes:  # a small request padded with JSON whitespace to `size` bytes
        data = json.dumps({"model": "minilm-l6", "input": ["hello"],
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        return data[:-1] + b" " * (size - len(data)) + b"}"

    r = httpx.post(embed_server.url + "/v1/embeddings", content=body(6 << 20), headers=auth, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"  # read and parsed: past the 4 MiB
    chat = httpx.post(embed_server.url + "/v1/chat/completions", content=body(6 << 20), headers=auth, timeout=60)
    assert chat.status_code == 413  # the decoders' routes keep theirs
    huge = httpx.post(embed_server.url + "/v1/embeddings", content=body(65 << 20), headers=auth, timeout=120)
    assert huge.status_code == 413
