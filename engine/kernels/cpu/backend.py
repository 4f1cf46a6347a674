"""The CPU backend (engine/kernels/backend.py's interface) over the numba kernels of this package.

Two configurations, one class:
- "fast" (the default, `quant="auto"`): decode runs the int8-activation kernels (int8.py) over the stored blocks
  in one compiled call per token (decode_step.py), with the 4/5-bit legacy matrices in the row-interleaved
  layout of packed.py and an f16 KV cache (as llama.cpp's default: half the memory and half the bytes each
  decoded token's attention reads); prompts dequantize each weight once per chunk and call BLAS.
- "exact" (`quant="f32"`): f32 activations and an f32 KV cache throughout, weights dequantized per use (a fused
  matvec for a few tokens, dequantize + sgemm for prompts); no compiled step. Slow; for debugging and oracles.
The matrix kernels behind either are a kernel set of matmul.py, stepped down per type to the reference tier
where the self-test (selftest.py) found a fast kernel wrong.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from engine.kernels import kernel_cache
from engine.kernels.backend import PROMPT_TILE, ModelConfig, Weights
from engine.kernels.cpu import (decode_step, expert_matmul, ir, layout, ops, packed, recurrent,
                                step_compile, step_roles, step_tables)
from engine.kernels.cpu import selftest as self_test
from engine.kernels.cpu.kv_cache import KVCache
from engine.kernels.cpu.matmul import MatmulKernels, kernels_for
from engine.kernels.quant_types import QTensor


# A prompt's attention blocks must fall on its tiles too (kernels/backend.py, PROMPT_TILE, says why).
assert PROMPT_TILE % ops.ATTN_BLOCK == 0, "prompt tiles must hold whole attention blocks"

HEAD_ROWS = 32768  # vocabulary rows per matmul of a prompt's head: bounds the dequantization scratch
KERNEL_SET = {"fast": "cpu-q8", "exact": "cpu"}  # configuration -> its matrix kernels (matmul.py)
# What a model's first load and prompt compile in the foreground (its prompt pass and self-test kernels) on the
# 2-core dev VM (docs/benchmarks.md, the first-contact entry): the estimate until this machine has recorded its own
# (kernel_cache.expected_seconds); the background compile's is step_compile.STEP_COMPILE_S.
FOREGROUND_COMPILE_S = 5


class CpuBackend:
    name = "cpu"
    prompt_tile = PROMPT_TILE

    def __init__(self, path: str = "fast", kernels: MatmulKernels | None = None,
                 stepped_down: frozenset[int] = frozenset(), background_compile: list[str] | None = None,
                 compiling=None, check=None):
        self.path = path
        self.kernels = kernels if kernels is not None else kernels_for(KERNEL_SET[path])
        self.stepped_down = stepped_down  # GGML type codes the self-test sent to the reference tier
        self._check = check  # where the self-test's warnings go (prepare runs it), None: no self-test
        self.step: step_tables.DecodeStep | None = None  # the compiled one-token step (prepare), or None
        self.packed_buffer: np.ndarray | None = None  # every packed copy of the model (prepare), one buffer
        self._pending: step_compile.PendingStep | None = None  # the step while it compiles elsewhere
        # a command that compiles the step elsewhere (step_compile.py), and the process already running it
        self._background_compile, self._compiling = background_compile, compiling

    @property
    def code_tier(self) -> str:
        return ir.TIER

    @property
    def kv_dtype(self) -> str:
        return "f16" if self.path == "fast" else "f32"

    def describe(self) -> str:
        """One line for logs: configuration and matrix kernels."""
        return f"cpu {self.path} ({self.kernels.name} kernels{', compiled decode step' if self.step else ''})"

    # --- layouts and the decode step ------------------------------------------------------------------------

    def prepare(self, config: ModelConfig, weights: Weights, step_flags: dict | None,
                matrices: Sequence[str] = ()) -> None:
        """On the fast path: the layers' and the head's legacy-block matrices get their row-interleaved copies
        (their mapped pages are let go); then the self-test of the kernels the model's `matrices` run (a type
        whose fast kernel disagrees with the reference goes to the reference tier), and, with every matrix type
        on its fast kernels, the compiled step is built. Not for split models (no single buffer): those decode
        layer by layer. Prompts take the int8 GEMM where it carries most of the layers' matrix work
        (gemm8.carries_most). With a background compile (cpu_backend) and the step not in numba's cache yet,
        the model decodes without the step until the compile elsewhere has put it there (step_compile.py)."""
        if self.path == "fast" and hasattr(self.kernels, "use_prompt_gemm8"):
            names = [n for i in range(config.n_layer) for n in step_roles.role_tensors(i, step_flags or {}) if n]
            self.kernels.use_prompt_gemm8([weights.tensor(n) for n in names if weights.has(n)])
        steps = self.path == "fast" and step_tables.supported(config, weights, step_flags)
        if steps:
            self.packed_buffer = layout.pack(weights, step_roles.matrix_names(config, weights, step_flags))
        types = self._self_test([weights.tensor(n) for n in matrices])
        if not steps or self.stepped_down & types:  # the step runs every matrix type's fast kernel
            return
        # A model with low-bit tensors gets the step's variant for its types (step_variants.py).
        self.step = step_tables.build(config, weights, step_flags, self.packed_buffer)
        if self._background_compile and self.step is not None:
            sig = self.step.signature([self.new_cache(config, 1)])
            self._pending = step_compile.start(self.step, sig, self._background_compile, self._compiling)
            if self._pending is not None:
                self.step = None

    def _self_test(self, tensors: list[QTensor]) -> frozenset[int]:
        """Check the kernels these matrices run (once per process, self_test.run_selftest): a packed matrix's
        packed kernels, another's plain ones, on its type. Returns the matrices' type codes."""
        packed_types = {int(t.ggml_type) for t in tensors if t.packed is not None}
        plain_types = {int(t.ggml_type) for t in tensors if t.packed is None or packed.packed_rows(t.rows) < t.rows}
        if self._check is not None:
            plain = tuple(k for k in self_test.PATH_KERNELS[self.path] if k != "packed_q8")
            self_test.run_selftest(warn=self._check, kernels=("packed_q8",), types=packed_types, remembered=True)
            self_test.run_selftest(warn=self._check, kernels=plain, types=plain_types, remembered=True)
            slow = self_test.disabled_types()
            if slow and not self.stepped_down:
                self.kernels = self_test.TieredKernels(self.kernels, kernels_for(self_test.TIERS[1]), slow)
            self.stepped_down = slow
        return frozenset(packed_types | plain_types)

    def new_cache(self, config: ModelConfig, max_tokens: int) -> KVCache:
        return KVCache(len(config.kv_layers), config.n_head_kv, config.head_dim, max_tokens, self.kv_dtype,
                       config.state_shapes)

    @property
    def has_decode_step(self) -> bool:
        pending = self._pending  # (read once: another thread may take the step up meanwhile)
        if pending is not None:  # compiling elsewhere: take the step up once numba's cache has it
            step = pending.ready()
            if step is not None:
                self.step, self._pending = step, None
        return self.step is not None

    def decode(self, ids, caches: Sequence[KVCache]) -> np.ndarray:
        if self.step is None:
            raise RuntimeError("this backend has no compiled decode step for the model (see has_decode_step)")
        return self.step(ids, caches)

    has_run_step = True  # the compiled step takes runs (step_tables.DecodeStep.runs)

    def decode_runs(self, runs, caches: Sequence[KVCache]) -> np.ndarray:
        if self.step is None:
            raise RuntimeError("this backend has no compiled decode step for the model (see has_decode_step)")
        return self.step.runs(runs, caches)

    def end_prompt(self) -> None:
        release = getattr(self.kernels, "release", None)
        if release is not None:
            release()

    def end_sequences(self) -> None:
        if self.step is not None:
            self.step.release()

    # --- ops --------------------------------------------------------------------------------------------------

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        return self.matmul_many(x, [w])[0]

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        """A prompt's whole tiles and its last partial tile in two calls (see backend.py PROMPT_TILE): the kernels
        pick their way (integer matvec, int8 GEMM, sgemm) by row count, and a row must be computed the same way
        whether its tile was the tail of a longer chunk or a chunk of its own (a reused prefix's continuation)."""
        T = x.shape[0]
        body = T // PROMPT_TILE * PROMPT_TILE
        if body in (0, T):
            return self._matmul_many(x, ws)
        out = np.empty((T, sum(w.rows for w in ws)), np.float32)  # column slices of one array, as the kernels give
        for rows in (slice(0, body), slice(body, T)):
            at = 0
            for part in self._matmul_many(x[rows], ws):
                out[rows, at : at + part.shape[1]] = part
                at += part.shape[1]
        ends = np.cumsum([w.rows for w in ws]).tolist()
        return [out[:, a:b] for a, b in zip([0] + ends[:-1], ends)]

    def _matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        return self.kernels.matmul_many(x, ws) if len(ws) > 1 else [self._matmul(x, ws[0])]

    def _matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        # A vocabulary head over a prompt goes in row slices: the dequantization scratch stays small even for
        # Gemma's 262k rows.
        if x.shape[0] <= 8 or w.rows <= HEAD_ROWS:
            return self.kernels.matmul(x, w)
        out = np.empty((x.shape[0], w.rows), np.float32)
        for r0 in range(0, w.rows, HEAD_ROWS):
            part = packed.slice_rows(w, r0, min(w.rows, r0 + HEAD_ROWS))
            out[:, r0 : r0 + part.rows] = self.kernels.matmul(x, part)
        return out

    def expert_matmul(self, x: np.ndarray, experts: np.ndarray, starts: np.ndarray, stacks: Sequence[QTensor],
                      n_expert: int) -> list[np.ndarray] | None:
        """A MoE prompt chunk's experts in one call per stacked tensor (kernels/cpu/expert_matmul.py): x's rows
        grouped by expert (group i: rows starts[i]..starts[i+1], expert experts[i]), each times its expert's
        matrix of every stack. None where it does not apply (the exact path; float experts; a type the self-test
        stepped down): the caller goes expert by expert."""
        if not self.takes_experts(stacks):
            return None
        return expert_matmul.expert_matmul(x, experts, starts, stacks, n_expert, self.kernels.tier)

    def takes_experts(self, stacks: Sequence[QTensor]) -> bool:
        """Whether expert_matmul runs these stacked tensors. Its rows are computed each on its own (the integer
        row kernels give a row the same numbers whatever else is in its group), so a prompt's MoE layers can
        group a whole chunk's tokens at once: more tokens per expert, more of them through the kernels' 4-vector
        form, and each expert's weights read once per chunk."""
        return self.path == "fast" and getattr(self.kernels, "tier", None) is not None and all(
            expert_matmul.usable(s) and int(s.ggml_type) not in self.stepped_down for s in stacks)

    def embed(self, w: QTensor, ids) -> np.ndarray:
        return self.kernels.embed(w, ids)

    rms_norm = staticmethod(ops.rms_norm)
    rope_tables = staticmethod(ops.rope_tables)
    rope = staticmethod(ops.apply_rope)
    attention = staticmethod(ops.attention)
    act_mul = staticmethod(ops.act_mul)
    causal_conv = staticmethod(recurrent.causal_conv)
    delta_rule = staticmethod(recurrent.delta_rule)


def cpu_backend(path: str = "fast", *, selftest: bool = True, note=None,
                background_compile: list[str] | None = None) -> CpuBackend:
    """The CPU backend in configuration `path`; its prepare runs the kernel self-test of what the model runs
    (selftest=False: none). note(line): what the user should hear (a compile that starts, a kernel stepped
    down); default stderr. background_compile: a command that compiles the decode step (and, on a first run,
    the prompt pass's kernels alongside this process's self-test) elsewhere: prepare says."""
    note = note or (lambda line: print(f"goinfer: {line}", file=sys.stderr, flush=True))
    compiling = None
    uncached = path == "fast" and step_uncached()
    if uncached and background_compile:  # a second core compiles alongside this one
        compiling = step_compile.start_elsewhere(background_compile)
    # said only when a kernel really compiles (a cache miss), never for one loaded from the cache; without a
    # background compile the decode step compiles here too (batch runs, the Python API)
    seconds = kernel_cache.expected_seconds("prompt", FOREGROUND_COMPILE_S)
    if uncached and not background_compile:
        seconds += kernel_cache.expected_seconds("step", step_compile.STEP_COMPILE_S)
    kernel_cache.announce_compiles(lambda: note(
        f"compiling the CPU kernels this model needs, once per machine and version (about {seconds} s)"))
    if not selftest:
        self_test.mark_skipped()
    return CpuBackend(path, kernels_for(KERNEL_SET[path]), background_compile=background_compile,
                      compiling=compiling, check=note if selftest else None)


def step_uncached() -> bool:
    """True when numba's on-disk cache holds no compiled decode step for this code (a fresh install, an upgrade,
    `goinfer cache rm kernels`). Reads numba's cache index through private attributes; anything unexpected counts
    as cached (the step then compiles in the foreground at its first call, as without a background compile)."""
    try:
        return not decode_step.decode_step._cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - a numba version without these internals
        return False
