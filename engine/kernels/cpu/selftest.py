"""Kernel self-test: every dispatched CPU kernel against the numpy reference on a fixed small input.

Each kernel runs once per process and type, in a few ms once numba's cache is warm: a model load checks the
kernels its matrices run on their types (CpuBackend.prepare, after packing: a packed matrix's `packed_q8`,
another's plain kernels of PATH_KERNELS), taking a verdict this machine already reached where verdicts.py has
one; `goinfer check --hardware` runs all of them on every type.
Kernels checked, per GGML type: `matvec` (exact f32 path: fused, reads blocks in place), `matvec_q8` (the
default path's int8 kernels, tier ir.TIER, against the float64 product of the dequantized weight and the
int8 activations they compute with), `dequantize` (prefill: serial and parallel decode before BLAS) and
`embed` (row gather), `packed_q8` (the 4/5-bit types' row-interleaved decode layout: its int8 kernel and its
dequantization). A kernel that disagrees with the
reference steps its type down to the next tier (cpu -> reference) for every operation, with one WARN
line naming kernel, type, figures and the tier now in use. Results: `report()` (GET /health `selftest`,
`goinfer check --hardware`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from engine.kernels import reference
from engine.kernels.cpu import exact, int8, packed, verdicts
from engine.kernels.quant_types import BLOCK_GEOMETRY, COMPUTE_TYPES, GGMLType, QTensor

__all__ = ["KernelResult", "PATH_KERNELS", "SelfTest", "TIERS", "TieredKernels", "disabled_types", "report",
           "report_results", "run_selftest"]

log = logging.getLogger("goinfer")

TIERS = ("cpu", "reference")  # fastest first; the reference is the oracle and cannot fail
TOLERANCE = 1e-3  # max |fast - reference| / max |reference|: fastmath reorders sums, nothing more
ROWS, COLS, T = 8, 256, 3  # one super-block per row for K quants; T rows of input for matvec

# Byte offsets of the f16 scales in each block: random bytes there could be inf/NaN, so they get sane values.
_F16_FIELDS = {GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
               GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
               GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.IQ4_NL: (0,), GGMLType.IQ4_XS: (0,),
               GGMLType.TQ1_0: (52,), GGMLType.TQ2_0: (64,), GGMLType.IQ2_XXS: (0,), GGMLType.IQ2_XS: (0,),
               GGMLType.IQ2_S: (0,), GGMLType.IQ3_XXS: (0,), GGMLType.IQ3_S: (0,), GGMLType.IQ1_S: (0,),
               GGMLType.IQ1_M: ()}  # (IQ1_M's d: the top nibbles of its scale words, fixed_weight sets them)


@dataclass
class KernelResult:
    kernel: str  # "matvec", "matvec_q8", "dequantize", "embed", "packed_q8"
    type: str  # GGML type name
    tier: str  # the tier tested
    max_rel_err: float
    ok: bool


@dataclass
class SelfTest:
    status: str = "not_run"  # "not_run", "skipped", "ok", "stepped_down"
    tolerance: float = TOLERANCE
    seconds: float = 0.0
    results: list[KernelResult] = field(default_factory=list)
    stepped_down: dict[str, str] = field(default_factory=dict)  # type name -> tier now in use

    def to_json(self) -> dict:
        failed = [asdict(r) for r in self.results if not r.ok]
        return {"status": self.status, "tolerance": self.tolerance, "seconds": round(self.seconds, 4),
                "kernels_checked": len(self.results), "failed": failed, "stepped_down": dict(self.stepped_down),
                "tiers": list(TIERS)}


_STATE = SelfTest()
_LOCK = threading.Lock()


def fixed_weight(ggml_type: GGMLType, rows: int = ROWS, cols: int = COLS, seed: int = 1234) -> QTensor:
    """A deterministic, finite weight of `ggml_type` in stored blocks (rows, row_bytes) uint8."""
    rng = np.random.default_rng(seed + int(ggml_type))
    if ggml_type == GGMLType.F32:
        raw = rng.normal(0, 0.5, (rows, cols)).astype(np.float32).view(np.uint8)
    elif ggml_type == GGMLType.F16:
        raw = rng.normal(0, 0.5, (rows, cols)).astype(np.float16).view(np.uint8)
    elif ggml_type == GGMLType.BF16:
        f = rng.normal(0, 0.5, (rows, cols)).astype(np.float32)
        raw = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    elif ggml_type == GGMLType.MXFP4:  # u8 E8M0 exponent | 16 code bytes: scales 2^-8 .. 2^-2
        raw = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
        raw[:, :, 0] = rng.integers(120, 127, (rows, cols // 32))
    else:
        block, size = BLOCK_GEOMETRY[ggml_type]
        n_blocks = cols // block
        raw = rng.integers(0, 256, (rows, n_blocks, size), dtype=np.uint8)
        scales = rng.uniform(0.002, 0.05, (rows, n_blocks, len(_F16_FIELDS[ggml_type]))).astype(np.float16)
        for i, off in enumerate(_F16_FIELDS[ggml_type]):
            raw[:, :, off:off + 2] = scales[:, :, i:i + 1].view(np.uint8).reshape(rows, n_blocks, 2)
        if ggml_type == GGMLType.IQ1_M:
            d = rng.uniform(0.002, 0.05, (rows, n_blocks)).astype(np.float16).view(np.uint16).astype(np.int64)
            for i in range(4):  # nibble i of d: the top nibble of scale word i
                raw[:, :, 49 + 2 * i] = (raw[:, :, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4)
        raw = raw.reshape(rows, n_blocks * size)
    raw = np.ascontiguousarray(raw.reshape(rows, -1))
    # Read-only, as a model's mapped weights are: numba compiles a kernel once per argument type, and a writable
    # copy would make the self-test compile (and check) a second variant of every kernel that models never run.
    raw.setflags(write=False)
    return QTensor(f"selftest.{ggml_type.name}", ggml_type, (rows, cols), raw)


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


def _cpu_kernels() -> dict[str, Callable[[QTensor, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]]:
    """kernel name -> fn(w, x, ids) returning (fast result, reference result)."""

    def matvec(w, x, ids):
        return exact.matvec(w.raw, w.ggml_type, x, np.empty((x.shape[0], w.rows), np.float32)), reference.matmul(x, w)

    def matvec_q8(w, x, ids):
        qin = int8.quantize(x, [w.ggml_type])
        xd = int8.dequantized_input(qin, w.ggml_type).astype(np.float64)
        return int8.matvec([w], qin), xd @ reference.dequantize(w).astype(np.float64).T

    def dequantize(w, x, ids):
        want = reference.dequantize(w)
        serial = exact.dequantize_into(w.raw, w.ggml_type, np.empty(w.shape, np.float32), parallel=False)
        par = exact.dequantize_into(w.raw, w.ggml_type, np.empty(w.shape, np.float32), parallel=True)
        worst = serial if _rel_err(serial, want) >= _rel_err(par, want) else par
        return worst, want

    def embed(w, x, ids):
        got = exact.dequantize_rows_into(w.raw, w.ggml_type, ids, np.empty((ids.size, w.cols), np.float32))
        return got, reference.embed_rows(w, ids)

    def packed_q8(w, x, ids):  # the row-interleaved layout of decode: its int8 kernel, then its dequantization
        if w.ggml_type not in packed.PACKABLE:
            return None
        dst = np.empty(w.raw.size, np.uint8)
        packed.repack(w.raw, w.ggml_type, dst)
        dst.setflags(write=False)  # as Weights.pack hands out its packed copies
        p = QTensor(w.name, w.ggml_type, w.shape, w.raw, dst)
        M, K = x.shape  # the oracle: the activations as the packed kernels quantize them, times the weight, in f64
        xq, xs = np.empty((M, K), np.int8), np.empty((M, 2 * (K // 32)), np.float32)
        packed.quantize_natural_into(x, xq, xs, 0, K)
        xd = (xq.reshape(M, -1, 32) * xs.reshape(M, -1, 2)[..., :1]).reshape(M, K).astype(np.float64)
        want = xd @ reference.dequantize(w).astype(np.float64).T
        got = packed.matvec(p, x)
        deq = packed.dequantize_rows(p, 0, w.rows, np.empty(w.shape, np.float32))
        ref = reference.dequantize(w)
        return np.concatenate([got.ravel(), deq.ravel()]), np.concatenate([want.ravel(), ref.ravel()])

    return {"matvec": matvec, "matvec_q8": matvec_q8, "dequantize": dequantize, "embed": embed,
            "packed_q8": packed_q8}


KERNELS: dict[str, Callable] = {}  # filled lazily; tests may replace it or an entry to force a mismatch
_SHIPPED: dict[str, Callable] = {}  # what filled it: verdicts are remembered for these kernels only
# What each configuration of the CPU backend runs, so what a load checks: the fast path's matvecs (plain and
# packed), or the exact path's f32 one; both dequantize prompt weights and look up embeddings.
PATH_KERNELS = {"fast": ("matvec_q8", "packed_q8", "dequantize", "embed"), "exact": ("matvec", "dequantize", "embed")}


def run_selftest(*, force: bool = False, warn: Callable[[str], None] | None = None,
                 kernels: Iterable[str] | None = None, types: Iterable[int] | None = None,
                 remembered: bool = False) -> SelfTest:
    """Run the self-test of `kernels` (names in KERNELS; None: all) on weights of `types` (GGML type codes;
    None: all) once per process: pairs already checked are not run again (all again with force=True); returns
    the shared result. A model load checks only the kernels its matrices run, on their types (the kernels are
    compiled per type, so a first run compiles what its model needs, no more); `goinfer check --hardware`
    checks everything. remembered=True (a model load): a pair this machine already checked, with these kernel
    sources and this compiler, takes that verdict (verdicts.py) instead of loading and running the kernel."""
    global _STATE
    with _LOCK:
        if not KERNELS:
            KERNELS.update(_cpu_kernels())
            if not _SHIPPED:
                _SHIPPED.update(KERNELS)
        wanted = set(KERNELS) if kernels is None else set(kernels)
        gtypes = sorted(COMPUTE_TYPES) if types is None else sorted({GGMLType(int(t)) for t in types})
        fresh = force or _STATE.status in ("not_run", "skipped")
        done = set() if fresh else {(r.kernel, r.type) for r in _STATE.results}
        todo = [(gtype, name) for gtype in gtypes for name in KERNELS  # in KERNELS' order, as before
                if name in wanted and (name, gtype.name) not in done]
        if not todo:
            return _STATE
        start = time.perf_counter()
        state = SelfTest(status="ok") if fresh else _STATE
        x = np.random.default_rng(7).normal(0, 1, (T, COLS)).astype(np.float32)
        ids = np.array([3, 0, ROWS - 1], dtype=np.int64)
        weights: dict[GGMLType, QTensor] = {}
        shipped = all(KERNELS[name] is _SHIPPED.get(name) for _, name in todo)
        known = verdicts.load() if remembered and shipped else {}
        found: dict[str, float | None] = {}
        for gtype, name in todo:
            key = f"{name}/{gtype.name}"
            if key in known:
                err = known[key]
                if err is None:  # the kernel does not serve this type
                    continue
            else:
                w = weights.setdefault(gtype, fixed_weight(gtype))
                try:
                    pair = KERNELS[name](w, x, ids)
                    if pair is None:
                        found[key] = None
                        continue
                    got, want = pair
                    err = _rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32))
                except Exception as exc:  # a kernel that raises is as wrong as one that disagrees
                    log.debug("self-test %s %s raised %r", name, gtype.name, exc)
                    err = float("inf")
                found[key] = err
            ok = err <= TOLERANCE
            state.results.append(KernelResult(name, gtype.name, TIERS[0], err, ok))
            if not ok and gtype.name not in state.stepped_down:
                state.stepped_down[gtype.name] = TIERS[1]
                state.status = "stepped_down"
                message = (f"WARN kernel self-test: {TIERS[0]} {name} {gtype.name} differs from the reference "
                           f"(max rel err {err:.3g} > {TOLERANCE:g}); {gtype.name} now runs on tier {TIERS[1]}")
                (warn or log.warning)(message)
        if shipped:  # (not a test's stand-in kernels)
            verdicts.remember(found)
        state.seconds += time.perf_counter() - start
        _STATE = state
        return state


def mark_skipped() -> None:
    with _LOCK:
        if _STATE.status == "not_run":
            _STATE.status = "skipped"


def report() -> dict:
    return _STATE.to_json()


def report_results() -> list[KernelResult]:
    """Every kernel and type checked so far in this process."""
    return list(_STATE.results)


def disabled_types() -> frozenset[int]:
    return frozenset(int(GGMLType[name]) for name in _STATE.stepped_down)


class TieredKernels:
    """A kernel set (matmul.py) routing each weight type to the fastest tier whose self-test passed for it."""

    def __init__(self, fast, fallback, slow_types: frozenset[int]):
        self._fast, self._slow, self._slow_types = fast, fallback, slow_types
        self.name = fast.name

    def _pick(self, w: QTensor):
        return self._slow if int(w.ggml_type) in self._slow_types else self._fast

    def matmul(self, x, w):
        return self._pick(w).matmul(x, w)

    def matmul_many(self, x, ws):
        if any(int(w.ggml_type) in self._slow_types for w in ws):
            return [self.matmul(x, w) for w in ws]
        return self._fast.matmul_many(x, ws)

    def embed(self, w, ids):
        return self._pick(w).embed(w, ids)

    def dequantize(self, w):
        return self._pick(w).dequantize(w)

    def __getattr__(self, name):  # anything else a kernel set offers comes from the fast tier
        return getattr(self._fast, name)
