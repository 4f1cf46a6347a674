#!/usr/bin/env python3
"""Hugging Face checkpoints of the dense families with other shapes than ../shared/families' (not a test: it needs
torch and transformers, which the project does not depend on). Two steps, two pythons:

  SCRATCH_PY tests/bench/hf_variants.py make DIR [FAMILY ...]   # a venv with torch (CPU) + transformers:
                                                    # writes DIR/<family>/
                                                    # (bf16 safetensors, the kit's tokenizer files) and the
                                                    # float64 log-probabilities of a 64-token prompt
  .venv/bin/python tests/bench/hf_variants.py check DIR   # goinfer, exact and default path, against them

Variants: llama with llama3 RoPE scaling, 8 heads / 2 KV heads of width 32, an untied head, 3 layers; qwen2 with
8/4 heads and a vocabulary (2112) larger than its tokenizer; qwen3 with head width 128 != hidden / heads and one KV
head; phi3 rotating 3/4 of each head with LongRoPE past an original window of 32 (its long factors); gemma2 with a
window of 16, query_pre_attn_scalar 128 != head width, other soft-caps, 3 layers; gemma3 (text) with its own layer
pattern, local RoPE base 20000, linear RoPE scaling on the global layer, one KV head; qwen3_5 and qwen3_5_moe
with 3 value heads per key head, head width 32, a conv kernel of 3, 5 layers in the pattern D,A,D,A,D, half the
head rotated, 12 experts top-3 and a shared expert of another width; gpt_oss with 3 layers (full, sliding,
sliding), a window of 8, YaRN factor 8 over an original window of 32, 6 experts top-3, head width 32; lfm2 with
5 layers C,A,C,C,A, convolutions of 4 taps, 8/2 heads of width 32, an MLP sized by transformers' rule to 384;
gemma4 without per-layer embeddings or KV sharing, keys = values on its global layers (one KV head), heads of
32 / 64, window 8, half the global head rotated; gemma4_ple with per-layer embeddings of 32, the last 3 of 6
layers sharing keys and values (double-wide MLPs), heads of 64 / 128.
docs/models.md gives the result.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT.parent / "shared" / "families"


def _variants(T) -> dict:
    """family -> (the kit directory whose tokenizer it borrows, config class, config)."""
    small = dict(hidden_size=256, max_position_embeddings=4096)
    return {
        "llama": ("llama", T.LlamaConfig, dict(
            small, intermediate_size=384, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
            head_dim=32, vocab_size=2048, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=2043,
            eos_token_id=2047, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64})),
        "qwen2": ("qwen2", T.Qwen2Config, dict(
            small, intermediate_size=320, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
            vocab_size=2112, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=1992,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
        "qwen3": ("qwen3", T.Qwen3Config, dict(
            small, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
            head_dim=128, vocab_size=2048, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=1992,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        "phi3": ("phi3", T.Phi3Config, dict(
            small, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=2048, original_max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=1982, pad_token_id=1979, partial_rotary_factor=0.75,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                             "partial_rotary_factor": 0.75, "short_factor": [1.0 + 0.05 * i for i in range(24)],
                             "long_factor": [1.0 + 0.7 * i for i in range(24)]})),
        "gemma2": ("gemma2", T.Gemma2Config, dict(
            small, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=2048, rms_norm_eps=1e-6, query_pre_attn_scalar=128, sliding_window=16,
            attn_logit_softcapping=15.0, final_logit_softcapping=25.0, hidden_activation="gelu_pytorch_tanh",
            bos_token_id=2, eos_token_id=1, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        "gemma3": ("gemma2", T.Gemma3TextConfig, dict(
            small, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
            head_dim=64, vocab_size=2048, rms_norm_eps=1e-6, query_pre_attn_scalar=96, sliding_window=16,
            final_logit_softcapping=20.0, hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1,
            pad_token_id=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})),
        "qwen3_5": ("qwen3_5", T.Qwen3_5TextConfig, dict(_QWEN35, intermediate_size=384)),
        "qwen3_5_moe": ("qwen3_5_moe", T.Qwen3_5MoeTextConfig, dict(
            _QWEN35, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=96,
            shared_expert_intermediate_size=160)),
        "gpt_oss": ("gpt_oss", T.GptOssConfig, dict(
            small, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
            head_dim=32, vocab_size=2048, rms_norm_eps=1e-5, num_local_experts=6, num_experts_per_tok=3,
            sliding_window=8, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            tie_word_embeddings=False, bos_token_id=2040, eos_token_id=2045, pad_token_id=2041,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 32, "truncate": True})),
        "lfm2": ("lfm2", T.Lfm2Config, dict(
            small, intermediate_size=512, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
            block_multiple_of=128, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=2048, norm_eps=1e-5, conv_L_cache=4, conv_bias=False, bos_token_id=2044, eos_token_id=2047,
            pad_token_id=2043, layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        "gemma4": ("gemma4", T.Gemma4TextConfig, dict(
            small, intermediate_size=384, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
            hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False, vocab_size=2048,
            vocab_size_per_layer_input=2048, rms_norm_eps=1e-6, sliding_window=8, final_logit_softcapping=25.0,
            hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                "rope_theta": 1e6}})),
        "gemma4_ple": ("gemma4", T.Gemma4TextConfig, dict(
            small, intermediate_size=192, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, global_head_dim=128, hidden_size_per_layer_input=32, num_kv_shared_layers=3,
            use_double_wide_mlp=True, vocab_size=2048, vocab_size_per_layer_input=2048, rms_norm_eps=1e-6,
            sliding_window=16, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", bos_token_id=2,
            eos_token_id=1, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                         "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1e6}})),
    }


# Qwen3.5 hybrids: 3 value heads per key head (the converter's head reorder), head widths 32, a kernel of 3, an
# attention layer between DeltaNet ones and a trailing DeltaNet layer
_QWEN35 = dict(hidden_size=256, max_position_embeddings=4096, num_hidden_layers=5, num_attention_heads=8,
               num_key_value_heads=2, head_dim=32, vocab_size=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
               eos_token_id=1990, pad_token_id=1988, linear_conv_kernel_dim=3, linear_key_head_dim=32,
               linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention",
                            "linear_attention"],
               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                                "mrope_section": [2, 3, 3], "mrope_interleaved": True})


def make(out: Path, only: list[str]) -> None:
    import torch
    import transformers as T

    torch.manual_seed(0)
    for fam, (kit_fam, cls, kw) in _variants(T).items():
        if only and fam not in only:
            continue
        model = T.AutoModelForCausalLM.from_config(cls(**kw), attn_implementation="eager")
        with torch.no_grad():  # peaked distributions: every weight moves the logits
            for name, p in model.named_parameters():
                if p.ndim >= 2:
                    p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
                else:
                    p.normal_(0.0, 0.3 if "norm" in name else 0.5)
        d = out / fam
        shutil.rmtree(d, ignore_errors=True)
        model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
        for f in (KIT / kit_fam / "hf").iterdir():
            if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
                shutil.copy(f, d / f.name)
        # the oracle: the saved (bf16) weights in float64
        model = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager",
                                                       experts_implementation="eager").eval()
        ids = np.random.default_rng(1).integers(5, 1900, 64).tolist()
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()
        np.save(d / "oracle_ids.npy", np.array(ids))
        np.save(d / "oracle_logprobs_f64.npy", lp)
        print(fam, "written", d)


def check(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import engine

    print("| variant | exact: max / mean |Δ| over the oracle's top-20 | default path: max / mean "
          "| default top-1 agreement |")
    print("|---|---|---|---|")
    for d in sorted(p for p in out.iterdir() if (p / "oracle_ids.npy").is_file()):
        ids = np.load(d / "oracle_ids.npy").tolist()
        ref = np.load(d / "oracle_logprobs_f64.npy")
        top = np.argsort(-ref, axis=1)[:, :20]
        cells = []
        for quant in ("f32", "auto"):
            # context 4096: past phi3's original window of 32, as the oracle's 64 tokens are (its long factors)
            lp = engine.load_model(d, quant=quant, selftest=False, context=4096).logprobs(ids, start=0)
            n = min(lp.shape[1], ref.shape[1])
            dtop = np.take_along_axis(np.abs(lp[:, :n] - ref[:, :n]), top, 1)
            cells.append(f"{dtop.max():.1e} / {dtop.mean():.1e}")
            agree = float((lp[:, :n].argmax(1) == ref.argmax(1)).mean())
        print(f"| {d.name} | {cells[0]} | {cells[1]} | {agree:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("make", "check"):
        sys.exit(__doc__)
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]), sys.argv[3:])
    else:
        check(Path(sys.argv[2]))
