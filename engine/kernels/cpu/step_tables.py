"""The compiled decode step's Python side (decode_step.py holds the compiled part): the tables it reads, built
once per model from the config and the weights (matrix rows by role, norms, biases, RoPE frequencies, the MoE
and hybrid tables), and the callable that runs one step over M sequences' caches."""

from __future__ import annotations

import numpy as np
from numba import njit, typeof, types
from numba.typed import List

from engine.kernels.backend import ModelConfig, Weights, frequency_divisors
from engine.kernels.cpu import attention, gemma4_step, hybrid_step, ir, moe_step, ops, step_variants
from engine.kernels.cpu.decode_step import ROW_RANGES_PER_THREAD, Biases
from engine.kernels.cpu.kv_cache import KVCache
from engine.kernels.cpu.step_roles import ATTN_Q, ATTN_V, NORMS, POST_ATTN_NORM, ROLES, role_tensors
from engine.kernels.quant_types import COMPUTE_TYPES, LOWBIT_TYPES
from engine.kernels.threads import get_threads

_EMPTY = [0, 0, 0, 0, -1]  # a role a fused tensor holds: 0 rows, which every phase skips
_NO_PACKED = np.empty(0, np.uint8)
_ACTS = ("silu", "gelu_tanh", "swiglu_oai")  # iparams' activation slot: the MLP's activation



class DecodeStep:
    """Callable (ids (M,), caches) -> raw head logits (M, head rows); appends one token to each cache."""

    def __init__(self, cfg: ModelConfig, w: Weights, flags: dict, buf: np.ndarray, pbuf: np.ndarray | None,
                 tier: str | None = None):
        self.buf = buf
        self.lowbit: set[int] = set()  # the low-bit types the step reads (_entry): they choose its variant
        self.pbuf = pbuf if pbuf is not None else _NO_PACKED  # the packed copies (layout.pack)
        E, D, L = cfg.n_embd, cfg.head_dim, cfg.n_layer
        # a role's tensor the layer lacks (Gemma 4: keys = values, no attn_v) stays empty
        self.mats = np.array([[self._entry(w, n) if n and w.has_weight(n) else _EMPTY for n in role_tensors(i, flags)]
                              for i in range(L)], np.int64)
        self.head = np.array([self._entry(w, "output" if w.has("output") else "token_embd")], np.int64)
        self.norms = np.zeros((L, len(NORMS), E), np.float32)
        self.qk_norms = np.zeros((L, 2, D), np.float32)
        for i in range(L):
            for j, n in enumerate(NORMS):
                n = flags.get("ffn_norm", n) if n == "ffn_norm" else n  # gpt-oss names it post_attention_norm
                if w.has(f"blk.{i}.{n}") and not (j == POST_ATTN_NORM and not flags["post_norms"]):
                    self.norms[i, j] = w.vector(f"blk.{i}.{n}")
            for j, n in enumerate(("attn_q_norm", "attn_k_norm")):  # (a hybrid's recurrent layers have none)
                if flags["qk_norm"] and w.has(f"blk.{i}.{n}"):
                    v = w.vector(f"blk.{i}.{n}")
                    self.qk_norms[i, j, : len(v)] = v  # a narrower layer's in its leading dims (Gemma 4)
        self.qkv_bias = np.zeros((L, 1), np.float32)  # q|k|v biases, where the family has them
        if flags.get("qkv_bias"):
            qkv = ROLES[ATTN_Q : ATTN_V + 1]
            self.qkv_bias = np.zeros((L, sum(w.tensor(f"blk.0.{r}").rows for r in qkv)), np.float32)
            for i in range(L):
                self.qkv_bias[i] = np.concatenate([w.bias(f"blk.{i}.{r}") for r in qkv])
        self.out_norm = w.vector(flags.get("final_norm", "output_norm"))
        sinks = np.full((L, cfg.n_head), -np.inf, np.float32)  # attention sinks (gpt-oss), -inf: none
        o_bias = np.zeros((L, 1), np.float32)
        if cfg.attn_sinks:
            sinks[:] = [w.vector(f"blk.{i}.attn_sinks") for i in range(L)]
        if cfg.attn_out_bias:
            o_bias = np.stack([w.bias(f"blk.{i}.attn_output") for i in range(L)])
        self.biases = Biases(sinks, o_bias, *moe_step.bias_tables(cfg, w, flags))
        self.rec = hybrid_step.tables(cfg, w)
        factors, rel = frequency_divisors(cfg, w), np.divide(cfg.layer_rope_scale, cfg.rope_scaling.factor)
        self.inv_freq = np.stack([ops.inv_freq(cfg.rope_dim, b, factors) for b in cfg.layer_rope_base]) / rel[:, None]
        self.layers = gemma4_step.tables(cfg, w, flags, self._entry)
        if cfg.layer_rope_dim:  # Gemma 4: each layer its own rotary dims (the rest of a row unused), divisors
            self.inv_freq = gemma4_step.frequencies(cfg, w)  # on the global layers only
        self.windows = np.array(cfg.layer_window, np.int64)
        self.fparams = np.array([cfg.rms_eps, cfg.attn_scale, cfg.rope_scaling.factor, cfg.attn_softcap,
                                 cfg.rope_attn_factor], np.float64)
        self.iparams = np.array([cfg.n_head, cfg.n_head_kv, D, cfg.rope_dim, flags["qk_norm"], flags["post_norms"],
                                 _ACTS.index(flags["act"]), cfg.rope_style == "neox", bool(flags.get("qkv_bias")),
                                 cfg.n_expert if flags.get("moe") else 0, cfg.n_expert_used], np.int64)
        self.table = w.tensor("token_embd").raw  # (rows, row bytes): the rows past its packed groups
        self.embd = np.array(self._entry(w, "token_embd"), np.int64)
        self.embed_scale = np.float32(cfg.embed_scale)
        self.tier = ir.tier_token(tier)
        self._arrays = SequenceArrays()
        # the compiled function: the shared step, or its variant with this model's low-bit types
        # (step_compile.py asks it whether it is compiled yet)
        self.dispatcher = step_variants.step_for(tuple(sorted(self.lowbit)))

    def _entry(self, w: Weights, name: str) -> list[int]:
        """[byte offset in buf, rows, row bytes, type code, byte offset of its packed rows in pbuf or -1]."""
        t = w.tensor(name)
        if t.ggml_type not in COMPUTE_TYPES:  # no kernel of ours
            raise _NotInStep(f"{name} is {t.ggml_type.name}")
        if t.ggml_type in LOWBIT_TYPES:
            self.lowbit.add(int(t.ggml_type))
            if len(self.lowbit) > step_variants.SLOTS:  # (no file seen mixes that many)
                raise _NotInStep(f"more than {step_variants.SLOTS} low-bit types")
        off = _offset(t.raw, self.buf, name)
        packed_off = -1 if t.packed is None else _offset(t.packed, self.pbuf, name)
        return [off, t.rows, t.raw.shape[1], int(t.ggml_type), packed_off]

    def __call__(self, ids, caches: list[KVCache]) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) != len(caches) or not len(ids):
            raise ValueError(f"{len(ids)} tokens for {len(caches)} sequences")
        for c in caches:  # one token each: the per-step path stays as plain as it was (runs is speculation's)
            c.reserve(1)
        logits = self.dispatcher(*self.arguments(ids, caches))
        for c in caches:
            c.advance(1)
        return logits

    def runs(self, runs: list, caches: list[KVCache]) -> np.ndarray:
        """Several tokens per sequence in one step: runs[m] (a few ids) appended to caches[m] at its end; the
        raw head logits of every token, run after run ((sum of the runs' lengths, head rows)).

        A run's tokens go in as rows of their own that share the sequence's cache arrays, at consecutive
        positions: each layer writes every row's key and value before any row attends (decode_step._worker's
        phases), so row j sees the run's rows before it as a prompt pass would, and each row's numbers are
        those a step of that one token would give (rows never mix: the batched matvec and attention are per
        row). Not for recurrent state, which one step advances once per sequence."""
        if len(runs) != len(caches) or not len(runs) or any(len(r) == 0 for r in runs):
            raise ValueError(f"{len(runs)} runs for {len(caches)} sequences (each needs a token)")
        if any(len(r) > 1 and c.state for r, c in zip(runs, caches)):
            raise ValueError("a recurrent state advances one token per step: a run of several needs a prompt pass")
        for r, c in zip(runs, caches):
            c.reserve(len(r))
        ids = np.concatenate([np.asarray(r, np.int64).reshape(-1) for r in runs])
        rows = [c for r, c in zip(runs, caches) for _ in range(len(r))]
        pos = np.concatenate([np.arange(c.length, c.length + len(r), dtype=np.int64) for r, c in zip(runs, caches)])
        logits = self.dispatcher(*self.arguments(ids, rows, pos=pos))
        for r, c in zip(runs, caches):
            c.advance(len(r))
        return logits

    def arguments(self, ids: np.ndarray, caches: list[KVCache], lists: tuple | None = None,
                  pos: np.ndarray | None = None) -> tuple:
        """decode_step's arguments for tokens ids (M,) int64 at the caches' ends, or at positions pos (lists:
        stand-ins for the caches' typed lists)."""
        if pos is None:
            pos = np.array([c.length for c in caches], np.int64)
        threads = get_threads()
        kcs, vcs, convs, ssms = self._arrays.of(caches) if lists is None else lists
        return (self.buf, self.pbuf, self.mats, self.head, self.table, self.embd, self.embed_scale, self.norms,
                self.qk_norms, self.qkv_bias, self.out_norm, self.inv_freq, self.windows, self.fparams, self.iparams,
                ids, pos, kcs, vcs, ROW_RANGES_PER_THREAD * threads, 0, self.tier, threads, self.biases, self.rec,
                convs, ssms, self.layers)

    def signature(self, caches: list[KVCache]) -> tuple:
        """decode_step's argument types for a step over these caches, its typed lists typed without being built
        (their helpers compile on first use: ~3 s of a first run that decodes without the step)."""
        groups = ([c.k for c in caches], [c.v for c in caches]) + tuple(hybrid_step.states(caches))
        lists = tuple(types.ListType(typeof(g[0])) for g in groups)
        return tuple(a if isinstance(a, types.Type) else self.dispatcher.typeof_pyval(a)
                     for a in self.arguments(np.zeros(len(caches), np.int64), caches, lists))

    def release(self) -> None:
        """Let go of the last batch's arrays (their sequences have ended)."""
        self._arrays.clear()


class SequenceArrays:
    """The arrays of the sequences a step decodes (keys, values, recurrent states) as numba typed lists, whose
    type is the same for any number of sequences: tuples would carry their length in their type, one more
    compile of the step (a minute) for each batch size a server meets. The lists are built by cached compiled
    functions (typed.List's own Python-side constructor compiles its helpers anew in every process: 0.8 s before
    the first token), and the last ones are kept while the batch and its arrays stay the same (a cache's arrays
    change as it grows)."""

    def __init__(self):
        self._key: tuple = ()
        self._lists: tuple = ()

    def of(self, caches) -> tuple:
        convs, ssms = hybrid_step.states(caches)
        arrays = ([c.k for c in caches], [c.v for c in caches], convs, ssms)
        # The kept lists hold their arrays, so an id here cannot be a freed array's reused address.
        key = tuple(id(a) for group in arrays for a in group)
        if key != self._key:
            self._key, self._lists = key, tuple(_typed_list(group) for group in arrays)
        return self._lists

    def clear(self) -> None:
        """Let go of the arrays (sequences that have ended)."""
        self._key, self._lists = (), ()


def _typed_list(arrays: list):
    out = _list_of(arrays[0])
    for a in arrays[1:]:
        _append(out, a)
    return out


@njit(cache=True)
def _list_of(a):
    out = List()
    out.append(a)
    return out


@njit(cache=True)
def _append(items, a):
    items.append(a)


def sequence_arrays(caches) -> tuple:
    """(keys, values, convs, ssms) of these caches as the step takes them (typed lists)."""
    return SequenceArrays().of(caches)


def _offset(a: np.ndarray, buf: np.ndarray, name: str) -> int:
    off = a.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
    if not 0 <= off <= buf.size - a.nbytes or not a.flags.c_contiguous:
        raise ValueError(f"{name} does not lie in the model buffer")
    return off


def build(cfg: ModelConfig, w: Weights, flags: dict | None, packed_buffer: np.ndarray | None,
          tier: str | None = None) -> DecodeStep | None:
    """The compiled step for this model (its packed copies in packed_buffer, from layout.pack), or None where it
    cannot run: a split model (no single buffer), a family without step flags, or a head size that is not a
    multiple of 16."""
    if not supported(cfg, w, flags):
        return None
    try:
        return DecodeStep(cfg, w, flags, w.buffer(), packed_buffer, tier)
    except _NotInStep:  # a type without kernels of ours in the step: the model decodes layer by layer
        return None


class _NotInStep(Exception):
    """A tensor the step would read has a type no kernel of the step runs."""


def supported(cfg: ModelConfig, w: Weights, flags: dict | None) -> bool:
    return w.buffer() is not None and flags is not None and cfg.head_dim % attention.TILE == 0  # attention tiles
