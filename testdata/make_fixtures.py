"""Tiny random-weight GGUF fixtures: one llama-family and one gemma3 model, plus two files we must reject.

Importable by tests (each writer takes an output path) and runnable as a script:

    python -m testdata.make_fixtures OUT_DIR

Everything is seeded, so the same bytes come out every time. Metadata keys and tensor names are llama.cpp's
(compare ../shared/reference/*.meta.json). The weight matrices are spread over every GGML type we support
but MXFP4 (each of the llama and gemma3 fixtures alone covers those eleven), so loading and running either one
exercises every other block decoder; MXFP4, gpt-oss's expert type, has a llama variant of its own.
gguf.quants quantizes the float, legacy and MXFP4 types; it cannot quantize K-quants, so their blocks are random
bytes under small, sane scales. Weights are small so a forward pass stays finite.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import TokenType

# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """(n,) float -> (n, 2) uint8: little-endian f16."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _k_quant_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q, amax: float) -> np.ndarray:
    """Random K-quant blocks (rows, row_bytes) whose weights stay within about +-amax."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    jitter = rng.uniform(0.5, 1.5, size=n)
    if qtype == Q.Q6_K:  # ql[128] | qh[64] | i8 scales[16] | f16 d; w = d * scale * (q - 32)
        blocks[:, 192:208] = rng.integers(-8, 9, size=(n, 16)).astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = _f16_bytes(amax / (8 * 32) * jitter)
    else:  # Q4_K / Q5_K: f16 d | f16 dmin | 6-bit scales/mins | ...; w = d * sc * q - dmin * m
        qmax = 15 if qtype == Q.Q4_K else 31
        d = amax / (63 * qmax) * jitter
        blocks[:, 0:2] = _f16_bytes(d)
        blocks[:, 2:4] = _f16_bytes(d * qmax / 2)  # centres the weights around zero on average
    return blocks.reshape(rows, -1)


# Types gguf.quants cannot quantize, beyond the K-quants above: random blocks with each f16 scale at `byte` set to
# about amax / `largest`, `largest` being what the scale multiplies at most (sub-block scale x quant).
# The lattice types (f16 d first; IQ1_M's d is the top nibbles of its four scale words at byte 48): d x group scale
# x grid point at most.
_RANDOM_BLOCK_SCALES = {Q.Q2_K: ((80, 15 * 3), (82, 15 * 3)), Q.Q3_K: ((108, 32 * 4),), Q.IQ4_NL: ((0, 127),),
                        Q.IQ4_XS: ((0, 32 * 127),), Q.IQ2_XXS: ((0, 167),), Q.IQ2_XS: ((0, 167),),
                        Q.IQ2_S: ((0, 167),), Q.IQ3_XXS: ((0, 480),), Q.IQ3_S: ((0, 465),), Q.IQ1_S: ((0, 17),),
                        Q.IQ1_M: ((48, 17),)}


def _random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q, amax: float) -> np.ndarray:
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    for byte, largest in _RANDOM_BLOCK_SCALES[qtype]:
        d = _f16_bytes(amax / largest * rng.uniform(0.5, 1.5, size=n))
        if qtype == Q.IQ1_M:  # nibble i of d's bits: the top nibble of scale word i (byte 49 + 2 i)
            bits = d.view(np.uint16).reshape(n).astype(np.int64)
            for i in range(4):
                blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4)
        else:
            blocks[:, byte:byte + 2] = d
    return blocks.reshape(rows, -1)


def _matrix(rng: np.random.Generator, rows: int, cols: int, qtype: Q, std: float) -> tuple[np.ndarray, Q | None]:
    """A (rows, cols) weight of the given type, as (array for GGUFWriter.add_tensor, raw_dtype)."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return _k_quant_blocks(rng, rows, cols, qtype, 3 * std), qtype
    if qtype in _RANDOM_BLOCK_SCALES:
        return _random_blocks(rng, rows, cols, qtype, 3 * std), qtype
    w = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
    if qtype == Q.F32:
        return w, None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, qtype), qtype


def random_weight(rng: np.random.Generator, rows: int, cols: int, qtype, std: float = 0.05) -> np.ndarray:
    """A sane random weight of any supported type as stored bytes, uint8 (rows, row_bytes). For kernel tests."""
    data, _ = _matrix(rng, rows, cols, Q(int(qtype)), std)
    return np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _add_matrix(writer: gguf.GGUFWriter, rng, name: str, rows: int, cols: int, qtype: Q, std: float) -> None:
    data, raw_dtype = _matrix(rng, rows, cols, qtype, std)
    writer.add_tensor(name, data, raw_dtype=raw_dtype)


def _write(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------

_CORPUS = (
    "Hello world! The quick brown fox jumps over the lazy dog. The history of the city begins with a small "
    "village on the river. In the beginning there was the word, and the word was hello. Then the user asked "
    "the assistant a question and the assistant answered: the answer is in the question. def main(): return 0"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte gets a printable character (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {b: chars[b] for b in printable} | {b: c for b, c in chars.items() if b not in printable}


def _train_bpe(words: list[tuple[str, ...]], n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE on a list of words (each a tuple of symbols); ties broken alphabetically (deterministic)."""
    counts = Counter(words)
    merges = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for word, c in counts.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: Counter = Counter()
        for word, c in counts.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += c
        counts = merged
    return merges


def _gpt2_vocab(n_merges: int = 41) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types, merges: 3 ChatML specials, the 256 byte-level characters, n_merges merges."""
    alphabet = _bytes_to_unicode()
    words = [tuple(alphabet[b] for b in w.encode()) for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", _CORPUS)]
    merges = _train_bpe(words, n_merges)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(alphabet.values()) + [a + b for a, b in merges]
    types = [TokenType.CONTROL] * len(specials) + [TokenType.NORMAL] * (len(tokens) - len(specials))
    return tokens, [int(t) for t in types], [f"{a} {b}" for a, b in merges]


def _spm_vocab(n_pieces: int = 40) -> tuple[list[str], list[float], list[int]]:
    """tokens, scores, token types for a SentencePiece-style (llama) vocabulary with byte fallback."""
    controls = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    text = "▁" + _CORPUS.replace(" ", "▁")
    letters = sorted({ch for ch in text if ch.isalpha() or ch == "▁"})
    words = [tuple(w) for w in re.findall(r"▁?[^▁]+", text)]
    pieces = letters + [a + b for a, b in _train_bpe(words, n_pieces)]
    tokens = controls + byte_tokens + pieces
    # As in Gemma's file: controls score -1000, bytes 0, pieces -(rank) so earlier merges win.
    scores = [-1000.0] * len(controls) + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [TokenType.CONTROL] * len(controls) + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(pieces)
    return tokens, scores, [int(t) for t in types]


# ---------------------------------------------------------------------------------------------------------
# llama
# ---------------------------------------------------------------------------------------------------------

LLAMA = dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_ctx=2048)

# Per layer, the type of each matrix. Together with token_embd/output these cover every supported type.
_LLAMA_TYPES = [
    dict(attn_q=Q.Q8_0, attn_k=Q.F32, attn_v=Q.F16, attn_output=Q.Q4_0, ffn_gate=Q.Q4_1, ffn_up=Q.Q5_0,
         ffn_down=Q.Q5_1),
    dict(attn_q=Q.Q4_K, attn_k=Q.BF16, attn_v=Q.Q6_K, attn_output=Q.Q5_K, ffn_gate=Q.Q4_K, ffn_up=Q.Q6_K,
         ffn_down=Q.Q4_K),
]


def _llama_writer(path, arch: str = "llama", seed: int = 0, override: dict | None = None,
                  split_max_tensors: int = 0) -> gguf.GGUFWriter:
    """A llama-family writer with metadata and tensors added, not yet written.
    override: tensor name -> (array, raw_dtype) to store instead of a random matrix."""
    rng = np.random.default_rng(seed)
    c = LLAMA
    tokens, token_types, merges = _gpt2_vocab()
    n_vocab, d, hd = len(tokens), c["n_embd"], c["head_dim"]

    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name("goinfer tiny llama fixture")
    w.add_uint32(f"{arch}.context_length", c["n_ctx"])
    w.add_uint32(f"{arch}.embedding_length", d)
    w.add_uint32(f"{arch}.block_count", c["n_layer"])
    w.add_uint32(f"{arch}.feed_forward_length", c["n_ff"])
    w.add_uint32(f"{arch}.attention.head_count", c["n_head"])
    w.add_uint32(f"{arch}.attention.head_count_kv", c["n_head_kv"])
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{arch}.vocab_size", n_vocab)
    w.add_uint32(f"{arch}.rope.dimension_count", hd)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(CHATML_TEMPLATE)

    shapes = dict(attn_q=(c["n_head"] * hd, d), attn_k=(c["n_head_kv"] * hd, d), attn_v=(c["n_head_kv"] * hd, d),
                  attn_output=(d, c["n_head"] * hd), ffn_gate=(c["n_ff"], d), ffn_up=(c["n_ff"], d),
                  ffn_down=(d, c["n_ff"]))
    override = override or {}

    def matrix(name, rows, cols, qtype, std):
        if name in override:
            w.add_tensor(name, override[name][0], raw_dtype=override[name][1])
        else:
            _add_matrix(w, rng, name, rows, cols, qtype, std)

    matrix("token_embd.weight", n_vocab, d, Q.Q8_0, 0.5)
    for i, types in enumerate(_LLAMA_TYPES):
        w.add_tensor(f"blk.{i}.attn_norm.weight", _norm(rng, d))
        for role, (rows, cols) in shapes.items():
            if role == "ffn_gate":
                w.add_tensor(f"blk.{i}.ffn_norm.weight", _norm(rng, d))
            matrix(f"blk.{i}.{role}.weight", rows, cols, types[role], 0.04)
    w.add_tensor("output_norm.weight", _norm(rng, d))
    matrix("output.weight", n_vocab, d, Q.Q5_0, 0.1)
    return w


def write_llama_fixture(path) -> Path:
    """llama architecture, SmolLM2-like tokenizer (gpt2 byte-level BPE, ChatML template); untied output head."""
    _write(_llama_writer(path))
    return Path(path)


def write_llama_split_fixture(path, max_tensors: int = 12) -> list[Path]:
    """The llama fixture split llama.cpp-style (gguf-split): <stem>-0000N-of-0000M.gguf, metadata in the first."""
    path = Path(path)
    _write(_llama_writer(path, split_max_tensors=max_tensors))
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))


def write_mxfp4_fixture(path) -> Path:
    """The llama fixture with layer 0's FFN matrices stored as MXFP4: the type of gpt-oss's expert stacks, which
    no dense model stores, so the one fixture that runs MXFP4 through a whole model and the decode step."""
    rng = np.random.default_rng(4)
    d, ff = LLAMA["n_embd"], LLAMA["n_ff"]
    shapes = {"ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff)}
    override = {f"blk.0.{role}.weight": (random_weight(rng, rows, cols, Q.MXFP4, 0.04), Q.MXFP4)
                for role, (rows, cols) in shapes.items()}
    _write(_llama_writer(path, override=override))
    return Path(path)


def write_unsupported_arch_fixture(path) -> Path:
    """The llama fixture under an architecture name nobody supports."""
    _write(_llama_writer(path, arch="mamba9"))
    return Path(path)


def write_unsupported_type_fixture(path, type_name: str = "Q8_1") -> Path:
    """The llama fixture with blk.0.ffn_down stored as type_name (Q8_1: GGML type 9), which we cannot compute
    with: random bytes in that type's blocks."""
    rows, cols = LLAMA["n_embd"], LLAMA["n_ff"]
    qtype = Q[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(1).integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    _write(_llama_writer(path, override={"blk.0.ffn_down.weight": (raw, qtype)}))
    return Path(path)


# ---------------------------------------------------------------------------------------------------------
# gemma3
# ---------------------------------------------------------------------------------------------------------

GEMMA3 = dict(n_embd=256, n_layer=6, n_head=2, n_head_kv=1, head_dim=64, n_ff=160, n_ctx=4096, sliding_window=8)

# attn_output (128 columns) and ffn_down (160) are not multiples of a K-quant super-block (256): legacy types
# there. Float types sit on the small k/v matrices to keep the file small. Every supported type appears.
_GEMMA3_TYPES = [
    dict(attn_q=Q.Q5_0, attn_k=Q.Q5_0, attn_v=Q.Q8_0, attn_output=Q.Q4_0, ffn_gate=Q.Q5_0, ffn_up=Q.Q5_0,
         ffn_down=Q.Q8_0),
    dict(attn_q=Q.Q4_0, attn_k=Q.BF16, attn_v=Q.F32, attn_output=Q.Q5_1, ffn_gate=Q.Q4_K, ffn_up=Q.Q5_K,
         ffn_down=Q.Q4_1),
    dict(attn_q=Q.Q4_1, attn_k=Q.Q6_K, attn_v=Q.Q5_1, attn_output=Q.Q8_0, ffn_gate=Q.Q6_K, ffn_up=Q.Q4_0,
         ffn_down=Q.Q5_0),
    dict(attn_q=Q.Q4_K, attn_k=Q.Q4_K, attn_v=Q.Q5_K, attn_output=Q.Q4_1, ffn_gate=Q.Q8_0, ffn_up=Q.Q4_1,
         ffn_down=Q.Q5_1),
    dict(attn_q=Q.Q8_0, attn_k=Q.Q8_0, attn_v=Q.Q4_0, attn_output=Q.Q5_0, ffn_gate=Q.Q5_1, ffn_up=Q.Q6_K,
         ffn_down=Q.Q4_0),
    dict(attn_q=Q.Q5_K, attn_k=Q.F16, attn_v=Q.Q6_K, attn_output=Q.Q5_1, ffn_gate=Q.Q4_K, ffn_up=Q.Q8_0,
         ffn_down=Q.Q5_0),
]


def write_gemma3_fixture(path) -> Path:
    """gemma3 architecture: QK-norm, sandwich norms, 5 sliding-window layers then 1 global (layer 5),
    SentencePiece-style tokenizer with byte fallback; output head tied to token_embd."""
    rng = np.random.default_rng(3)
    c = GEMMA3
    tokens, scores, token_types = _spm_vocab()
    n_vocab, d, hd = len(tokens), c["n_embd"], c["head_dim"]

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("goinfer tiny gemma3 fixture")
    w.add_uint32("gemma3.context_length", c["n_ctx"])
    w.add_uint32("gemma3.embedding_length", d)
    w.add_uint32("gemma3.block_count", c["n_layer"])
    w.add_uint32("gemma3.feed_forward_length", c["n_ff"])
    w.add_uint32("gemma3.attention.head_count", c["n_head"])
    w.add_uint32("gemma3.attention.head_count_kv", c["n_head_kv"])
    w.add_uint32("gemma3.attention.key_length", hd)
    w.add_uint32("gemma3.attention.value_length", hd)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("gemma3.rope.freq_base", 1e6)
    w.add_uint32("gemma3.attention.sliding_window", c["sliding_window"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(token_types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)

    shapes = dict(attn_q=(c["n_head"] * hd, d), attn_k=(c["n_head_kv"] * hd, d), attn_v=(c["n_head_kv"] * hd, d),
                  attn_output=(d, c["n_head"] * hd), ffn_gate=(c["n_ff"], d), ffn_up=(c["n_ff"], d),
                  ffn_down=(d, c["n_ff"]))
    _add_matrix(w, rng, "token_embd.weight", n_vocab, d, Q.Q8_0, 0.05)  # scaled by sqrt(n_embd) in the model
    for i, types in enumerate(_GEMMA3_TYPES):
        blk = f"blk.{i}."
        w.add_tensor(blk + "attn_norm.weight", _norm(rng, d))
        for role in ("attn_q", "attn_k", "attn_v"):
            _add_matrix(w, rng, blk + role + ".weight", *shapes[role], types[role], 0.04)
        w.add_tensor(blk + "attn_q_norm.weight", _norm(rng, hd))
        w.add_tensor(blk + "attn_k_norm.weight", _norm(rng, hd))
        _add_matrix(w, rng, blk + "attn_output.weight", *shapes["attn_output"], types["attn_output"], 0.04)
        w.add_tensor(blk + "post_attention_norm.weight", _norm(rng, d))
        w.add_tensor(blk + "ffn_norm.weight", _norm(rng, d))
        for role in ("ffn_gate", "ffn_up", "ffn_down"):
            _add_matrix(w, rng, blk + role + ".weight", *shapes[role], types[role], 0.04)
        w.add_tensor(blk + "post_ffw_norm.weight", _norm(rng, d))
    w.add_tensor("output_norm.weight", _norm(rng, d))
    _write(w)
    return Path(path)


WRITERS = {
    "tiny-llama.gguf": write_llama_fixture,
    "tiny-gemma3.gguf": write_gemma3_fixture,
    "tiny-llama-mxfp4.gguf": write_mxfp4_fixture,
    "unsupported-arch.gguf": write_unsupported_arch_fixture,
    "unsupported-type.gguf": write_unsupported_type_fixture,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m testdata.make_fixtures OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, writer in WRITERS.items():
        path = writer(out / name)
        print(f"{path}  {path.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
