"""Which tensor each slot of the compiled decode step reads (decode_step.py's `mats` rows per layer), and which
of them the CPU backend may repack (layout.pack)."""

from __future__ import annotations

from engine.kernels.backend import ModelConfig, Weights

# The slots of mats[l], one matrix each, named by the GGUF role they read (decode_step.py reads them by these
# names, role_tensors fills them): a MoE layer's gate/up/down are its expert stacks, with its router (moe_step.py)
# and a shared expert (Qwen3.5-MoE); a DeltaNet layer's q|k|v and z take the first two, its output the fourth,
# and its alpha and beta two of their own (hybrid_step.py); LFM2's convolution block its in_proj the first, its
# out_proj the fourth; Gemma 4's per-layer embedding block the last two (gemma4_step.py).
ATTN_Q, ATTN_K, ATTN_V, ATTN_OUT = 0, 1, 2, 3
FFN_GATE, FFN_UP, FFN_DOWN, FFN_ROUTER = 4, 5, 6, 7
SSM_ALPHA, SSM_BETA = 8, 9
SHEXP_GATE, SHEXP_UP, SHEXP_DOWN, SHEXP_ROUTER = 10, 11, 12, 13
PLE_GATE, PLE_PROJ = 14, 15
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp", "ssm_alpha",
         "ssm_beta", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp", "inp_gate", "proj")
assert ROLES.index("proj") == PLE_PROJ and ROLES.index("ssm_alpha") == SSM_ALPHA

# The rows of norms[l] (step_tables.py) and the norm tensor each reads
NORMS = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "post_norm")
ATTN_NORM, FFN_NORM, POST_ATTN_NORM, POST_FFN_NORM, POST_NORM = range(len(NORMS))

# The fields of a matrix's entry (a row of mats[l], decode_step.py): where its rows lie and how they are stored.
OFFSET, ROWS, ROW_BYTES, TYPE, PACKED = 0, 1, 2, 3, 4  # byte offset in buf, rows, row bytes, type code, pbuf offset


def role_tensors(layer: int, flags: dict) -> list[str | None]:
    """The tensor each of ROLES reads in a layer. A fused tensor (phi3: attn_qkv = q|k|v rows, ffn_up = gate|up
    rows) stands in for the roles it holds side by side: the first role reads it whole, the others are empty."""
    names: list[str | None] = [f"blk.{layer}.{r}" for r in ROLES]
    if flags.get("fused_qkv"):
        names[ATTN_Q : ATTN_V + 1] = [f"blk.{layer}.attn_qkv", None, None]
    if flags.get("fused_gate_up"):
        names[FFN_GATE : FFN_UP + 1] = [f"blk.{layer}.ffn_up", None]
    if flags.get("moe"):
        names[FFN_GATE : FFN_DOWN + 1] = [f"blk.{layer}.{r}_exps" for r in ("ffn_gate", "ffn_up", "ffn_down")]
    else:
        names[FFN_ROUTER] = None
    if not flags.get("shared_expert"):
        names[SHEXP_GATE : SHEXP_ROUTER + 1] = [None] * 4
    if not flags.get("per_layer_embd"):
        names[PLE_GATE : PLE_PROJ + 1] = [None, None]
    if flags.get("kv_source") and flags["kv_source"][layer] != layer:  # Gemma 4: it reads an earlier layer's
        names[ATTN_K : ATTN_V + 1] = [None, None]
    if flags.get("no_v") and flags["no_v"][layer]:  # Gemma 4's keys = values
        names[ATTN_V] = None
    if flags.get("recurrent") and flags["recurrent"][layer] and flags.get("shortconv"):  # LFM2
        names[ATTN_Q : ATTN_OUT + 1] = [f"blk.{layer}.shortconv.in_proj", None, None, f"blk.{layer}.shortconv.out_proj"]
        names[SSM_ALPHA : SSM_BETA + 1] = [None, None]
    elif flags.get("recurrent") and flags["recurrent"][layer]:
        names[ATTN_Q : ATTN_OUT + 1] = [f"blk.{layer}.attn_qkv", f"blk.{layer}.attn_gate", None, f"blk.{layer}.ssm_out"]
    else:
        names[SSM_ALPHA : SSM_BETA + 1] = [None, None]
    return names


def matrix_names(cfg: ModelConfig, w: Weights, flags: dict) -> list[str]:
    """The matrices of the step that layout.pack may repack: each layer's but the MoE ones, and the head (the
    embedding table where it is tied)."""
    return ([n for i in range(cfg.n_layer) for n in role_tensors(i, flags)
             if n and not _moe_role(n) and w.has_weight(n)]
            + ["output" if w.has("output") else "token_embd"])


def _moe_role(name: str) -> bool:
    """Expert stacks and routers stay as stored: moe_step addresses an expert's rows in the GGUF blocks; so do
    the one-thread matrices (DeltaNet's alpha and beta, a shared expert's gate)."""
    return name.endswith(("_exps", "ffn_gate_inp", "ssm_alpha", "ssm_beta", "ffn_gate_inp_shexp"))
