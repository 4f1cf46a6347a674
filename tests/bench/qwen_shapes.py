#!/usr/bin/env python3
"""Random-weight GGUFs of real Qwen2.5 shapes, for speed benchmarks (not a test): Qwen2.5-0.5B and -1.5B
(vocabulary 151,936, tied head, q/k/v biases), written in f16 with the gguf writer, then quantized to Q4_K_M by
llama.cpp's own quantizer. Real weights cannot be downloaded here; speed depends on the shapes and the tensor
types, not on the values.

The tokenizer is the ../shared/families qwen2 kit's (byte-level BPE, pre-tokenizer qwen2), padded to the
vocabulary with unused [PAD] tokens as the real Qwen files are.

Usage (the quantizer needs llama-cpp-python, which is never a project dependency: a bench venv has it):
  python tests/bench/qwen_shapes.py OUT_DIR [0.5b 1.5b] --llama-python /path/to/venv/bin/python [--types Q4_K_M,Q2_K]
then: python tests/bench/bench_speed.py OUT_DIR/qwen2.5-0.5b-shape.Q4_K_M.gguf --llama-python ...
(the lattice ftypes IQ2_XS, IQ3_XXS, ...: --llama-tools DIR with llama-imatrix and llama-quantize as well)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
KIT_QWEN2 = ROOT.parent / "shared" / "families" / "qwen2" / "tiny-qwen2-a.Q8_0.gguf"
VOCAB = 151936
SHAPES = {  # Qwen2.5's config.json values
    "0.5b": dict(n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864),
    "1.5b": dict(n_embd=1536, n_layer=28, n_head=12, n_head_kv=2, n_ff=8960),
}
QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def _tokenizer_fields() -> tuple[list[str], list[int], list[str]]:
    kit = gguf.GGUFReader(str(KIT_QWEN2))

    def strings(key: str) -> list[str]:
        f = kit.fields[key]
        return [bytes(f.parts[i]).decode() for i in f.data]

    field = kit.fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    tokens = strings("tokenizer.ggml.tokens")
    pad = VOCAB - len(tokens)
    return (tokens + [f"[PAD{i}]" for i in range(len(tokens), VOCAB)], types + [int(gguf.TokenType.UNUSED)] * pad,
            strings("tokenizer.ggml.merges"))


def write_f16(path: Path, shape: dict, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    E, L, H, Hkv, F = shape["n_embd"], shape["n_layer"], shape["n_head"], shape["n_head_kv"], shape["n_ff"]
    D = E // H
    tokens, types, merges = _tokenizer_fields()
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name(f"qwen2.5 shape {path.stem} (random weights)")
    w.add_context_length(32768)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(1992)
    w.add_add_bos_token(False)

    def mat(name: str, rows: int, cols: int, std: float = 0.02) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16))

    def vec(name: str, n: int, mean: float = 0.0, std: float = 0.02) -> None:
        w.add_tensor(name, (mean + rng.standard_normal(n, dtype=np.float32) * std).astype(np.float32))

    mat("token_embd.weight", VOCAB, E)
    for i in range(L):
        b = f"blk.{i}."
        vec(b + "attn_norm.weight", E, 1.0, 0.05)
        mat(b + "attn_q.weight", H * D, E)
        mat(b + "attn_k.weight", Hkv * D, E)
        mat(b + "attn_v.weight", Hkv * D, E)
        vec(b + "attn_q.bias", H * D)
        vec(b + "attn_k.bias", Hkv * D)
        vec(b + "attn_v.bias", Hkv * D)
        mat(b + "attn_output.weight", E, H * D)
        vec(b + "ffn_norm.weight", E, 1.0, 0.05)
        mat(b + "ffn_gate.weight", F, E)
        mat(b + "ffn_up.weight", F, E)
        mat(b + "ffn_down.weight", E, F)
    vec("output_norm.weight", E, 1.0, 0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _quantize_with_imatrix(tools: Path | None, f16: Path, out: Path, ftype: str) -> None:
    if tools is None:
        sys.exit(f"{ftype} needs --llama-tools (llama.cpp makes it only with an importance matrix)")
    imatrix = f16.with_suffix(".imatrix.gguf")
    if not imatrix.exists():  # (random weights: any text steers the quantizer as well as another)
        text = f16.with_suffix(".txt")
        text.write_text(" ".join(_tokenizer_fields()[0][1000:3000]).replace("\u0120", " "))
        subprocess.run([str(tools / "llama-imatrix"), "-m", str(f16), "-f", str(text), "-o", str(imatrix), "-c", "128",
                        "--chunks", "8", "-t", "2", "--no-ppl"], check=True, capture_output=True)
        text.unlink()
    subprocess.run([str(tools / "llama-quantize"), "--imatrix", str(imatrix), str(f16), str(out), ftype], check=True,
                   capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("sizes", nargs="*", default=list(SHAPES))
    ap.add_argument("--llama-python", required=True, help="a python with llama-cpp-python (the quantizer)")
    ap.add_argument("--types", default="Q4_K_M", help="llama.cpp ftypes, comma-separated (Q4_K_M,Q3_K_M,IQ4_XS,Q2_K)")
    ap.add_argument("--llama-tools", type=Path, help="llama-imatrix and llama-quantize (.ci/run builds them): the "
                    "lattice ftypes (IQ2_XS, IQ3_XXS, ...) need an importance matrix, made here on a text of the "
                    "tokenizer's own words")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for size in a.sizes:
        f16 = a.out / f"qwen2.5-{size}-shape.F16.gguf"
        for ftype in a.types.split(","):
            out = a.out / f"qwen2.5-{size}-shape.{ftype}.gguf"
            if not out.exists():
                if not f16.exists():
                    write_f16(f16, SHAPES[size])
                if ftype.startswith("IQ") and ftype not in ("IQ4_XS", "IQ4_NL"):
                    _quantize_with_imatrix(a.llama_tools, f16, out, ftype)
                else:
                    subprocess.run([a.llama_python, "-c", QUANTIZE, str(f16), str(out), ftype], check=True)
            print(out)
        f16.unlink(missing_ok=True)
        f16.with_suffix(".imatrix.gguf").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
