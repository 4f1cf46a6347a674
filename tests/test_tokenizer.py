"""Tokenizers built from GGUF metadata against llama.cpp's token ids (../shared/reference).

tokenizer/<model>.json: 200 awkward strings per model with llama_tokenize's ids (BOS per the model, special
tokens parsed); <model>.json: the prompts of the fidelity cases, chat template text included.
"""

from __future__ import annotations

import json
import random
import warnings

import numpy as np
import pytest

from engine.errors import UnsupportedModel
from engine.formats.gguf import GGUFFile
from engine.tokenizer import IncrementalDecoder, Tokenizer
from tests.conftest import HAVE_REFERENCE, REFERENCE, in_kit, needs_reference

MODELS = {  # name -> (fixture, reference file stem)
    "smollm2": ("smollm2_gguf", "SmolLM2-135M-Instruct.Q4_1"),
    "gemma3": ("gemma_gguf", "gemma-3-270m-q4_k_m"),
}
# llama.cpp's token ids (../shared/reference; the tests that read them skip without it)
STRINGS = {m: json.loads((REFERENCE / "tokenizer" / f"{stem}.json").read_text())
           for m, (_, stem) in MODELS.items()} if HAVE_REFERENCE else {}
PROMPTS = {m: json.loads((REFERENCE / f"{stem}.json").read_text())["cases"]
           for m, (_, stem) in MODELS.items()} if HAVE_REFERENCE else {}

# Multi-byte text for the streaming decoder: emoji (ZWJ, skin tone, flags), CJK, and characters outside Gemma's
# vocabulary (hieroglyphs, U+1FAE8, a tag character, NBSP) that come out as byte-fallback tokens.
MULTIBYTE = [
    "Café, naïve, façade — 日本語のテキスト and emoji 😀🎉👍🏽 together",
    "👨‍👩‍👧‍👦 family, 🇯🇵 flag, 🧑‍💻 coder",
    "中文字符：你好，世界！한국어 텍스트 ไทย",
    "𓀀𓁐 hieroglyphs, \U0001FAE8 shaking face, tag\U000E0001, nbsp\xa0end",
    "  leading spaces 🙂\n\tand a tab ✓",
]

_meta: dict[str, dict] = {}
_tok: dict[str, Tokenizer] = {}


def _metadata(request, model: str) -> dict:
    if model not in _meta:
        _meta[model] = GGUFFile(request.getfixturevalue(MODELS[model][0])).metadata
    return _meta[model]


def _tokenizer(request, model: str) -> Tokenizer:
    """Built once per session: Gemma's 262k vocabulary takes a second or two."""
    if model not in _tok:
        _tok[model] = Tokenizer.from_gguf_metadata(_metadata(request, model))
    return _tok[model]


@pytest.fixture(params=list(MODELS))
def model(request) -> str:
    return request.param


@pytest.fixture
def tok(request, model) -> Tokenizer:
    return _tokenizer(request, model)


# ---------------------------------------------------------------- llama.cpp's ids


@needs_reference
@pytest.mark.real_model
def test_every_reference_string_encodes_like_llama_cpp(tok, model):
    ref = STRINGS[model]
    assert ref["parse_special"] and ref["add_bos"] == tok.add_bos
    wrong = [(c["text"], tok.encode(c["text"]), c["tokens"]) for c in ref["cases"]
             if tok.encode(c["text"]) != c["tokens"]]
    assert len(ref["cases"]) == 200
    assert not wrong, f"{len(wrong)} of 200 differ, first: {wrong[0]!r}"


@needs_reference
@pytest.mark.real_model
def test_every_reference_string_decodes_back(tok, model):
    ref = STRINGS[model]
    wrong = []
    for c in ref["cases"]:
        ids = c["tokens"][1:] if ref["add_bos"] else c["tokens"]
        if tok.decode(ids) != c["text"]:
            wrong.append((c["text"], tok.decode(ids)))
    assert not wrong, f"{len(wrong)} of 200 differ, first: {wrong[0]!r}"


@needs_reference
@pytest.mark.real_model
def test_fidelity_prompts_encode_like_llama_cpp(tok, model):
    cases = PROMPTS[model]
    assert any("chat" in c["name"] for c in cases)
    for c in cases:
        assert tok.encode(c["prompt"], add_bos=c["add_bos"]) == c["tokens"], c["name"]


@pytest.mark.real_model
def test_bos_follows_the_metadata_unless_asked(tok, model):
    if model == "gemma3":
        assert tok.add_bos and tok.bos_id == 2
        assert tok.encode(" everyone") == [2, 4677]  # no SentencePiece space prefix: add_space_prefix is false
        assert tok.encode(" everyone", add_bos=False) == [4677]
    else:
        assert not tok.add_bos and tok.bos_id == 1
        assert tok.encode("Hello")[0] != tok.bos_id
        assert tok.encode("Hello", add_bos=True)[0] == tok.bos_id
    assert tok.encode("") == ([tok.bos_id] if tok.add_bos else [])


def _spm_oracle(tokens: list[str], scores: np.ndarray, vocab: dict[str, int], text: str) -> list[int]:
    """llama.cpp's SentencePiece loop written plainly: merge the adjacent pair whose concatenation is a token
    with the best score (leftmost on ties) until none is left; characters outside the vocab become bytes."""
    sym = list(text.replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(sym) - 1):
            j = vocab.get(sym[i] + sym[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        sym[i:i + 2] = [sym[i] + sym[i + 1]]
    out = []
    for piece in sym:
        out.extend([vocab[piece]] if piece in vocab else [vocab[f"<0x{b:02X}>"] for b in piece.encode()])
    return out


@needs_reference
@pytest.mark.real_model
def test_gemma_merges_from_scores_agree_with_the_plain_algorithm(request):
    """Beyond the 200 reference strings: random splices of them, against a direct SentencePiece loop."""
    tok, meta = _tokenizer(request, "gemma3"), _metadata(request, "gemma3")
    tokens, scores = meta["tokenizer.ggml.tokens"], np.asarray(meta["tokenizer.ggml.scores"])
    vocab = {t: i for i, t in enumerate(tokens)}
    texts = [c["text"] for c in STRINGS["gemma3"]["cases"]] + [c["prompt"][:400] for c in PROMPTS["gemma3"]]
    rng = random.Random(1234)
    checked = 0
    for _ in range(300):
        a, b = rng.choice(texts), rng.choice(texts)
        text = a[rng.randrange(len(a)):][:40] + b[:rng.randrange(1, 40)]
        fragments = [p for p in text.replace("\n", "\0").replace("\t", "\0").split("\0") if p.strip(" ")]
        for frag in fragments:
            if "  " in frag or "<" in frag or "[" in frag:  # may hold user-defined / control token text
                continue
            assert tok.encode(frag, add_bos=False) == _spm_oracle(tokens, scores, vocab, frag), frag
            checked += 1
    assert checked > 200


def _tiny_spm(add_space_prefix: bool) -> Tokenizer:
    """A Llama-2 style SentencePiece vocabulary (space prefix, byte fallback) small enough to reason about."""
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    pieces += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    pieces += [("\u2581ab", -1.0, 1), ("\u2581a", -2.0, 1), ("ab", -3.0, 1), ("\u2581", -10.0, 1), ("a", -11.0, 1),
               ("b", -12.0, 1)]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [p[0] for p in pieces],
            "tokenizer.ggml.scores": np.array([p[1] for p in pieces], dtype=np.float32),
            "tokenizer.ggml.token_type": np.array([p[2] for p in pieces], dtype=np.int32),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.add_space_prefix": add_space_prefix}
    return Tokenizer.from_gguf_metadata(meta)


def test_sentencepiece_space_prefix_like_llama_cpp():
    tok = _tiny_spm(add_space_prefix=True)
    ab, a, b = tok.token_to_id("\u2581ab"), tok.token_to_id("a"), tok.token_to_id("b")
    assert tok.add_bos and tok.eog_ids == {2}
    assert tok.encode("ab ab") == [1, ab, ab]  # " ab ab": ▁a wins first (best score), then ▁a+b
    assert tok.encode("</s>ab", add_bos=False) == [2, ab]  # a space is prefixed after a special token too
    assert tok.decode([1, ab, ab]) == "<s>ab ab"  # the space encode added goes again on decode
    assert tok.decode([1, ab, ab], skip_special=True) == "ab ab"
    assert tok.decode([ab, a, b]) == "abab"
    ids = tok.encode("ab é")  # é is not in the vocab: two byte-fallback tokens
    assert [tok.id_to_token(i) for i in ids[-2:]] == ["<0xC3>", "<0xA9>"]
    assert tok.decode(ids[1:]) == "ab é"
    assert "".join(_stream(tok, ids)) == "ab é" and "".join(_stream(tok, ids[1:])) == "ab é"


def test_sentencepiece_without_space_prefix():
    tok = _tiny_spm(add_space_prefix=False)
    ab = tok.token_to_id("ab")
    assert tok.encode("ab", add_bos=False) == [ab]
    assert tok.encode(" ab", add_bos=False) == [tok.token_to_id("\u2581ab")]
    assert tok.decode([tok.token_to_id("\u2581ab")]) == " ab"


# ---------------------------------------------------------------- special tokens


@pytest.mark.real_model
def test_special_tokens_are_parsed_and_known(tok, model):
    if model == "smollm2":
        start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
        text = "<|im_start|>user\nHi there<|im_end|>\n"
        assert tok.eos_id == end == 2
        assert tok.eog_ids == {0, 2}  # <|endoftext|> and <|im_end|> (the eos), as llama.cpp lists them
    else:
        start, end = tok.token_to_id("<start_of_turn>"), tok.token_to_id("<end_of_turn>")
        text = "<start_of_turn>user\nHi there<end_of_turn>\n"
        assert tok.eos_id == 1
        assert tok.eog_ids == {1, end}  # <eos> and <end_of_turn>
    ids = tok.encode(text, add_bos=False)
    assert ids[0] == start and end in ids
    assert tok.is_special(start) and tok.is_special(end) and tok.is_special(tok.bos_id)
    assert not any(tok.is_special(i) for i in tok.encode("Hi there", add_bos=False))
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "user\nHi there\n"
    assert tok.id_to_token(start) in text and tok.token_to_id("no such token, surely") is None


@pytest.mark.real_model
def test_vocabulary_facts(tok, model):
    assert tok.vocab_size == {"smollm2": 49152, "gemma3": 262144}[model]
    for i in (0, 1000, tok.vocab_size - 1):
        assert tok.token_to_id(tok.id_to_token(i)) == i


# ---------------------------------------------------------------- streaming


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool = True) -> list[str]:
    dec = IncrementalDecoder(tok, skip_special=skip_special)
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.real_model
@pytest.mark.parametrize("text", MULTIBYTE)
def test_incremental_decoder_never_splits_a_character(tok, model, text):
    ids = tok.encode(text)
    if model == "gemma3" and "\U0001FAE8" in text:
        assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # byte fallback really happens
    parts = _stream(tok, ids)
    assert not any("\ufffd" in p for p in parts)
    assert "".join(parts) == tok.decode(ids, skip_special=True) == text


@pytest.mark.real_model
def test_incremental_decoder_holds_back_partial_bytes(tok, model):
    ids = tok.encode("\U0001FAE8", add_bos=False)
    assert len(ids) > 1  # one character in several tokens: byte-level (SmolLM) or byte fallback (Gemma)
    parts = _stream(tok, ids)
    assert parts == [""] * (len(ids) - 1) + ["\U0001FAE8", ""]


@needs_reference
@pytest.mark.real_model
def test_incremental_decoder_matches_decode_on_every_reference_string(tok, model):
    for c in STRINGS[model]["cases"]:
        for skip in (True, False):
            parts = _stream(tok, c["tokens"], skip_special=skip)
            assert "".join(parts) == tok.decode(c["tokens"], skip_special=skip), c["text"]
            if "\ufffd" not in c["text"]:
                assert not any("\ufffd" in p for p in parts), c["text"]


@pytest.mark.real_model
def test_incremental_decoder_flushes_an_unfinished_character(tok, model):
    ids = tok.encode("é\U0001FAE8", add_bos=False)[:-1]  # the emoji's last byte is missing
    expected = tok.decode(ids, skip_special=True)
    assert expected.startswith("é") and expected.endswith("\ufffd")
    dec = IncrementalDecoder(tok)
    shown = "".join(dec.push(i) for i in ids)
    assert "\ufffd" not in shown
    assert shown + dec.flush() == expected


# ---------------------------------------------------------------- metadata handling


@pytest.mark.real_model
def test_unknown_tokenizer_model_is_refused(request):
    meta = dict(_metadata(request, "smollm2"), **{"tokenizer.ggml.model": "wordpiece-9000"})
    with pytest.raises(UnsupportedModel, match="wordpiece-9000"):
        Tokenizer.from_gguf_metadata(meta)


@needs_reference
@pytest.mark.real_model
def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning(request):
    meta = dict(_metadata(request, "smollm2"), **{"tokenizer.ggml.pre": "mystery-pre"})
    with pytest.warns(UserWarning, match="mystery-pre"):
        tok = Tokenizer.from_gguf_metadata(meta)
    gpt2 = Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.pre": "gpt2"}))
    for c in STRINGS["smollm2"]["cases"]:
        assert tok.encode(c["text"]) == gpt2.encode(c["text"])
        assert tok.decode(tok.encode(c["text"])) == c["text"]


@pytest.mark.real_model
def test_known_pre_tokenizers_build_without_warning(request):
    for pre in ("gpt2", "default", "llama-bpe", "qwen2"):
        meta = dict(_metadata(request, "smollm2"), **{"tokenizer.ggml.pre": pre})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tok = Tokenizer.from_gguf_metadata(meta)
        assert tok.decode(tok.encode("It's 2024: naïve café!", add_bos=False)) == "It's 2024: naïve café!"


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_a_gemma4_vocabulary_tokenizes_as_llama_cpp(quant):
    # GGUF tokenizer model `gemma4` (../shared/families/gemma4): BPE over U+2581-spaced text with byte fallback,
    # split only at newlines; the kit's four prompts (the chat one full of <|turn> specials) as llama.cpp's ids
    kit = in_kit("gemma4")
    tok = Tokenizer.from_gguf_metadata(dict(GGUFFile(kit / f"tiny-gemma4-a.{quant}.gguf").metadata))
    assert tok.kind == "gemma4" and tok.add_bos
    for case in json.loads((kit / f"tiny-gemma4-a.{quant}.json").read_text())["cases"]:
        assert tok.encode(case["prompt"], add_bos=case["add_bos"]) == case["tokens"], case["name"]
    text = "Zürich\n\n  naïve 😀 tabs\there"  # characters outside the 2k vocabulary come back from their bytes
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_end_of_generation_by_text_as_llama_cpp_lists_it():
    from engine.tokenizer.gguf_tokenizer import end_of_generation
    from engine.tokenizer.hf_build import CONTROL, NORMAL, USER_DEFINED

    def eog(names: list[str], eos: int | None = None) -> tuple[set[str], dict[str, int]]:
        vocab = {n: i for i, n in enumerate(names)}
        attrs = np.full(len(names), NORMAL, np.int32)
        ids = end_of_generation(vocab, attrs, eos, lambda key, default: default)
        return {names[i] for i in ids}, {n: int(attrs[i]) for n, i in vocab.items()}

    # Gemma 4 (a real GGUF's eos is <eos>): the turn's end and the tool-response opener end a reply too
    ends, attrs = eog(["<pad>", "<eos>", "<turn|>", "<|tool_response>", "</s>", "<|tool_call>", '<|"|>'], eos=1)
    assert ends == {"<eos>", "<turn|>", "<|tool_response>"} and attrs["<turn|>"] == CONTROL
    assert attrs["<|tool_call>"] == attrs['<|"|>'] == USER_DEFINED  # its calls are read from the reply's text
    # gpt-oss: <|end|> goes on where <|return|> and <|call|> end; the Harmony markers are text
    ends, attrs = eog(["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"])
    assert ends == {"<|return|>", "<|call|>"} and attrs["<|end|>"] == attrs["<|channel|>"] == USER_DEFINED
    assert eog(["<|end|>", "<|endoftext|>"])[0] == {"<|end|>", "<|endoftext|>"}  # Phi-3: <|end|> ends
