#!/usr/bin/env python3
"""A random-weight GGUF of Qwen3-30B-A3B's per-layer shapes, for MoE speed benchmarks (not a test): architecture
qwen3moe, hidden 2048, 32 query / 4 KV heads of 128, QK-norm, 128 experts of width 768 with 8 used per token,
vocabulary 151,936 and an untied output head, written in f16 with the gguf writer (tensor by tensor, so a layer's
~1.3 GB is never all in memory), then quantized to Q4_K_M by llama.cpp's own quantizer; the f16 intermediate is
deleted. The real model has 48 layers; --layers picks how many (default 12: ~0.35 GB a layer in Q4_K_M, ~1.3 GB
a layer in the f16 intermediate). Speed depends on the shapes and the tensor types, not on the values; the router's
weights are scaled so its logits spread (std ~4.5) and each token picks its own experts.

The tokenizer is the ../shared/families qwen2 kit's, padded to the vocabulary as qwen_shapes.py does.

Usage (the quantizer needs llama-cpp-python, which is never a project dependency: a bench venv has it):
  python tests/bench/moe_shape.py OUT_DIR [--layers 12] --llama-python /path/to/venv/bin/python
then: python tests/bench/bench_speed.py OUT_DIR/qwen3-30b-a3b-shape-12L.Q4_K_M.gguf --llama-python ...
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_shapes import QUANTIZE, VOCAB, _tokenizer_fields  # noqa: E402

SHAPE = dict(n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8, n_ff_expert=768,
             n_ff=6144, n_ctx=40960)  # Qwen3-30B-A3B's config.json values (48 layers there)
ROUTER_STD = 0.1  # logits = W h over a normed h of 2048: std ~ sqrt(2048) * 0.1 ~ 4.5


def write_f16(path: Path, n_layer: int, seed: int = 0) -> None:
    s = SHAPE
    E, H, Hkv, D, X, F = s["n_embd"], s["n_head"], s["n_head_kv"], s["head_dim"], s["n_expert"], s["n_ff_expert"]
    rng = np.random.default_rng(seed)
    tokens, types, merges = _tokenizer_fields()
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name(f"qwen3-30b-a3b shape {n_layer}L (random weights)")
    w.add_context_length(s["n_ctx"])
    w.add_embedding_length(E)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(X)
    w.add_expert_used_count(s["n_expert_used"])
    w.add_expert_feed_forward_length(F)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(1992)
    w.add_add_bos_token(False)

    # (name, numpy shape (GGUF's ne reversed), dtype, std, mean); data is made when written, one tensor at a time
    plan: list[tuple[str, tuple[int, ...], type, float, float]] = [
        ("token_embd.weight", (VOCAB, E), np.float16, 0.02, 0)]
    for i in range(n_layer):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (E,), np.float32, 0.05, 1.0),
                 (b + "attn_q.weight", (H * D, E), np.float16, 0.02, 0),
                 (b + "attn_k.weight", (Hkv * D, E), np.float16, 0.02, 0),
                 (b + "attn_v.weight", (Hkv * D, E), np.float16, 0.02, 0),
                 (b + "attn_q_norm.weight", (D,), np.float32, 0.05, 1.0),
                 (b + "attn_k_norm.weight", (D,), np.float32, 0.05, 1.0),
                 (b + "attn_output.weight", (E, H * D), np.float16, 0.02, 0),
                 (b + "ffn_norm.weight", (E,), np.float32, 0.05, 1.0),
                 (b + "ffn_gate_inp.weight", (X, E), np.float32, ROUTER_STD, 0),
                 (b + "ffn_gate_exps.weight", (X, F, E), np.float16, 0.02, 0),
                 (b + "ffn_up_exps.weight", (X, F, E), np.float16, 0.02, 0),
                 (b + "ffn_down_exps.weight", (X, E, F), np.float16, 0.02, 0)]
    plan += [("output_norm.weight", (E,), np.float32, 0.05, 1.0), ("output.weight", (VOCAB, E), np.float16, 0.02, 0)]
    for name, shape, dtype, _, _ in plan:
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, dtype, std, mean in plan:
        t = np.empty(shape, dtype)
        for j in range(shape[0] if len(shape) == 3 else 1):  # an expert stack: one expert at a time
            part = t[j] if len(shape) == 3 else t
            part[...] = mean + rng.standard_normal(part.shape, dtype=np.float32) * np.float32(std)
        w.write_tensor_data(t)
        if name.endswith("ffn_down_exps.weight"):
            print(f"wrote {name.split('.ffn')[0]}", file=sys.stderr, flush=True)
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--llama-python", required=True, help="a python with llama-cpp-python (the quantizer)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    f16 = a.out / f"qwen3-30b-a3b-shape-{a.layers}L.F16.gguf"
    q4 = a.out / f"qwen3-30b-a3b-shape-{a.layers}L.Q4_K_M.gguf"
    if not q4.exists():
        try:
            write_f16(f16, a.layers)
            subprocess.run([a.llama_python, "-c", QUANTIZE, str(f16), str(q4)], check=True)
        finally:
            f16.unlink(missing_ok=True)
    print(q4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
