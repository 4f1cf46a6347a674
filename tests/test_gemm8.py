"""The prompt GEMM of the fast path (engine/kernels/cpu/gemm8.py): the decode matvec's integer math (Q8_K
activations against the stored K-quant quants), so equal to the matvec on the same input; close to the f32
product of the dequantized weights; the fast backend sends prompts over K-quant matrices to it.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import reference
from engine.kernels.cpu import gemm8, int8, ir
from engine.kernels.cpu.matmul import Int8Kernels
from engine.kernels.quant_types import LATTICE_TYPES, GGMLType, QTensor
from testdata import make_fixtures
from tests.conftest import QUANT_KIT, QUANT_KIT_MISSING

pytestmark = pytest.mark.skipif(not gemm8.available(), reason="the generic tier has no int8 GEMM (sgemm instead)")
G = GGMLType
# each tier this CPU runs that has a form of the GEMM: avx2 (256-bit vpmaddubsw), vnni (512-bit vpdpbusd with
# AVX-512, else the 256-bit form again)
FORM_TIERS = [pytest.param(t, marks=pytest.mark.skipif(t not in ir.available_tiers(), reason=f"no {t} tier here"))
              for t in ("avx2", "vnni")]


TYPES = [G.Q4_K, G.Q5_K, G.Q6_K, G.Q2_K, G.Q3_K, G.IQ4_XS, G.TQ1_0, G.TQ2_0, *sorted(LATTICE_TYPES)]


def _type_tiers(types) -> list:
    """(type, tier) for each type the GEMM's form under each tier takes (IQ4_XS: the 512-bit form only)."""
    return [pytest.param(t, p.values[0], marks=p.marks, id=f"{t.name}-{p.values[0]}") for p in FORM_TIERS
            for t in types if gemm8.usable(QTensor("w", t, (1, 256), np.zeros((1, 256), np.uint8)), p.values[0])]


@pytest.mark.parametrize("t,tier", _type_tiers(TYPES))
@pytest.mark.parametrize("T,rows,K", [(13, 40, 512), (8, 16, 256), (30, 7, 768)])
def test_a_prompt_sees_the_numbers_a_decoded_token_sees(t, T, rows, K, tier):
    # the decode matvec (int8.py) on the same input: the same integer math, summed in another order
    rng = np.random.default_rng(T * rows + K)
    w = QTensor("w", t, (rows, K), make_fixtures.random_weight(rng, rows, K, t))
    x = rng.standard_normal((T, K)).astype(np.float32) * rng.choice([0.01, 1.0, 20.0], size=(T, 1)).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero super-block: scale 0
    got = gemm8.matmul(gemm8.QuantizedInput(x), w, tier)
    want = int8.matvec(int8.prepare([w]), int8.quantize(x, [t]), tier=tier)
    assert got.shape == (T, rows) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


# The quant bytes of each type's super-block (the rest: scales and minima): all bits set gives the largest u
# (15, 31, 63), whose products with |x| = 127 the 256-bit form sums in int16 over a few groups before widening.
# Q2_K's 3, Q3_K's 7 (its high bits too), TQ2_0's 3, IQ4_XS's top level (113 + 128).
QUANT_BYTES = {G.Q4_K: (144, slice(16, 144)), G.Q5_K: (176, slice(16, 176)), G.Q6_K: (210, slice(0, 192)),
               G.Q2_K: (84, slice(16, 80)), G.Q3_K: (110, slice(0, 96)), G.TQ2_0: (66, slice(0, 64)),
               G.IQ4_XS: (136, slice(8, 136))}


@pytest.mark.parametrize("t,tier", _type_tiers(QUANT_BYTES))
def test_the_largest_quants_against_the_largest_inputs_do_not_overflow(t, tier):
    rng = np.random.default_rng(4)
    rows, K = 9, 512
    raw = make_fixtures.random_weight(rng, rows, K, t).copy()
    size, quants = QUANT_BYTES[t]
    blocks = raw.reshape(rows, K // 256, size)
    blocks[:, :, quants] = 255
    assert_exact_against_extreme_inputs(QTensor("w", t, (rows, K), raw), tier)


def assert_exact_against_extreme_inputs(w: QTensor, tier) -> None:
    """The GEMM of w against inputs at +-127 (after quantization, exactly): the f32 product's result, within 1e-5."""
    x = np.full((9, w.cols), 3.5, np.float32)
    x[1::2] *= -1
    want = x @ reference.dequantize(w).reshape(w.shape).T
    got = gemm8.matmul(gemm8.QuantizedInput(x), w, tier)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("tier", FORM_TIERS)
def test_gemm_is_close_to_the_f32_product(tier):
    rng = np.random.default_rng(1)
    w = QTensor("w", G.Q4_K, (64, 1024), make_fixtures.random_weight(rng, 64, 1024, G.Q4_K))
    x = rng.standard_normal((50, 1024)).astype(np.float32)
    exact = x @ reference.dequantize(w).reshape(w.shape).T
    got = gemm8.matmul(gemm8.QuantizedInput(x), w, tier)
    assert np.abs(got - exact).mean() <= 0.02 * np.abs(exact).mean()  # int8 activations: ~1 % here


def test_the_fast_backend_runs_prompts_over_k_quants_through_it(monkeypatch):
    rng = np.random.default_rng(2)
    kq = QTensor("kq", G.Q4_K, (32, 512), make_fixtures.random_weight(rng, 32, 512, G.Q4_K))
    legacy = QTensor("l", G.Q4_0, (32, 512), make_fixtures.random_weight(rng, 32, 512, G.Q4_0))
    calls = []
    monkeypatch.setattr(gemm8, "matmul",
                        lambda qin, w, tier=None: calls.append(w.name) or np.zeros((qin.T, w.rows), np.float32))
    k = Int8Kernels()
    prompt, token = np.ones((k.gemm8_min_t + 1, 512), np.float32), np.ones((1, 512), np.float32)
    k.matmul(prompt, kq)
    k.matmul_many(prompt, [kq, kq])
    k.matmul(token, kq)  # decode: the matvec
    k.matmul(prompt, legacy)  # legacy blocks: dequantize + sgemm
    k.matmul_many(prompt, [kq, legacy])  # a mixed group: sgemm for all
    assert calls == ["kq", "kq", "kq"]


def test_a_model_takes_it_only_where_it_carries_most_of_the_prompt_work(monkeypatch):
    rng = np.random.default_rng(3)
    q4k, q40 = (QTensor(t.name, t, (64, 512), make_fixtures.random_weight(rng, 64, 512, t)) for t in (G.Q4_K, G.Q4_0))
    assert gemm8.carries_most([q4k, q4k, q40]) and not gemm8.carries_most([q4k, q40, q40])

    import engine
    from tests.conftest import in_kit

    calls = []
    real = gemm8.matmul
    monkeypatch.setattr(gemm8, "matmul", lambda qin, w, tier=None: calls.append(w.name) or real(qin, w, tier))
    kit = in_kit("qwen2")
    prompt = list(range(10, 90))  # a whole tile (64 rows) at least: every form takes it
    for name, expected in (("tiny-qwen2-a.Q4_K_M.gguf", True), ("tiny-qwen2-a.Q8_0.gguf", False)):
        calls.clear()
        model = engine.load_model(kit / name, selftest=False)
        model.prefill(prompt, model.new_cache(128))
        assert bool(calls) == expected, name


def test_precompile_compiles_it_for_a_model_that_takes_it(monkeypatch):
    # the warm-up chat of engine/loading/precompile.py is shorter than a prompt tile, so the GEMM is warmed on its own
    import engine
    from tests.conftest import in_kit

    kit = in_kit("qwen2")
    warmed = []
    monkeypatch.setattr(gemm8, "warm", lambda types, tier=None: warmed.append(types))
    for name, expected in (("tiny-qwen2-a.Q4_K_M.gguf", True), ("tiny-qwen2-a.Q8_0.gguf", False)):
        warmed.clear()
        engine.load_model(kit / name, selftest=False).backend.kernels.warm_prompt_gemm()
        # the model's types (Q4_K_M: Q4_K and Q6_K), each compiled on its own
        assert warmed == ([[G.Q4_K, G.Q6_K]] if expected else []), name
    real = QTensor("w", G.Q4_K, (16, 256), np.zeros((16, 144), np.uint8))
    monkeypatch.undo()
    gemm8.warm()  # compiles (or finds in the cache) and runs on zeros
    assert not gemm8.matmul(gemm8.QuantizedInput(np.ones((8, 256), np.float32)), real).any()


@pytest.mark.skipif(not (QUANT_KIT / "SUMMARY.json").is_file(), reason=QUANT_KIT_MISSING)
def test_low_bit_models_take_it_for_their_types(monkeypatch):
    # (their prompts against llama.cpp's: tests/test_lowbit_models.py, whose longer cases run through it)
    import engine

    calls = []
    real = gemm8.matmul
    monkeypatch.setattr(gemm8, "matmul", lambda qin, w, tier=None: calls.append(w.ggml_type) or real(qin, w, tier))
    for name, low in (("Q2_K", {G.Q2_K, G.Q3_K}), ("Q3_K_M", {G.Q3_K}), ("IQ4_XS", {G.IQ4_XS}), ("TQ1_0", {G.TQ1_0}),
                      ("TQ2_0", {G.TQ2_0})):
        if not gemm8.usable(QTensor("w", G.IQ4_XS, (1, 256), np.zeros((1, 136), np.uint8))):
            low -= {G.IQ4_XS}  # (the 256-bit form: dequantize + sgemm)
        calls.clear()
        model = engine.load_model(QUANT_KIT / f"tiny-qwen2-a.{name}.gguf", selftest=False)
        model.prefill(list(range(10, 90)), model.new_cache(128))
        assert low <= set(calls), (name, set(calls))
