"""The row-interleaved layout of the 4/5-bit legacy blocks (engine/kernels/cpu/packed.py).

Repacking then dequantizing equals gguf.quants' dequantization bit for bit (every packable type, random
blocks and row counts off the groups of 8); the group kernel equals the integer math of int8 activations
against the dequantized weights and agrees with int8's per-row kernels, in every code tier this CPU runs, and
gives each vector of a batch its single-vector result bit for bit; a real model reads only the packed copies
once they exist (its mapped originals are overwritten under it).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import quants as gq

import engine
from engine.kernels.cpu import int8, ir, packed, quantize
from engine.kernels.cpu.matmul import kernels_for
from engine.kernels.quant_types import GGMLType, QTensor, row_bytes
from testdata import make_fixtures

RNG = np.random.default_rng(11)
TIERS = [pytest.param(t, marks=pytest.mark.skipif(t not in ir.available_tiers(), reason=f"no {t} on this CPU"))
         for t in ir.TIERS]


def _random_tensor(gt: GGMLType, rows: int, cols: int) -> QTensor:
    bb = row_bytes(gt, 32)
    raw = RNG.integers(0, 256, (rows, row_bytes(gt, cols)), dtype=np.uint8)
    blocks = raw.reshape(rows, cols // 32, bb)
    blocks[:, :, 1] = RNG.integers(0x20, 0x3c, blocks.shape[:2])  # f16 scales of moderate size
    if gt in (GGMLType.Q4_1, GGMLType.Q5_1):
        blocks[:, :, 3] = RNG.integers(0xa0, 0xbc, blocks.shape[:2])  # negative mins
    return QTensor("w", gt, (rows, cols), raw)


def _packed(t: QTensor) -> QTensor:
    dst = np.empty(packed.packed_rows(t.rows) * t.raw.shape[1], np.uint8)
    packed.repack(t.raw, t.ggml_type, dst)
    return QTensor(t.name, t.ggml_type, t.shape, t.raw, dst)


@pytest.mark.parametrize("gt", sorted(packed.PACKABLE), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [9, 37, 64])
def test_packed_dequantizes_bit_for_bit(gt, rows):
    t = _packed(_random_tensor(gt, rows, 256))
    want = gq.dequantize(t.raw, gt).reshape(rows, 256)
    got = kernels_for("cpu").dequantize(t)  # groups from the packed copy, the last rows % 8 from raw
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    part = np.empty((rows - 8, 256), np.float32)
    packed.dequantize_rows(t, 8, rows, part)  # a row range from the second group on, tail rows included
    np.testing.assert_array_equal(part, want[8:rows])
    with pytest.raises(ValueError, match="whole groups"):
        packed.dequantize_rows(t, 4, 8, part[:4])


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("gt", sorted(packed.PACKABLE), ids=lambda t: t.name)
def test_the_group_kernel_equals_the_integer_math(gt, tier):
    t = _packed(_random_tensor(gt, 45, 640))
    x = RNG.standard_normal((3, 640)).astype(np.float32)
    got = packed.matvec(t, x, tier)
    qin = int8.quantize(x)
    xd = int8.dequantized_input(qin, gt).astype(np.float64)  # what the int8 activations stand for
    want = xd @ gq.dequantize(t.raw, gt).reshape(45, 640).T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    unpacked = int8.matvec([QTensor("w", gt, t.shape, t.raw)], qin, tier=tier)
    np.testing.assert_allclose(got, unpacked, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("gt", sorted(packed.PACKABLE), ids=lambda t: t.name)
def test_each_vector_of_a_batch_gets_its_single_vector_result(gt, tier):
    # The kernel unpacks a block once for up to packed.MB vectors (and may take two row groups at once): a
    # vector's result must not depend on how many others share the call, or a server's reply would depend on
    # its neighbours in the batch. 17 groups and a tail: pairs and single groups, in whole and split ranges.
    t = _packed(_random_tensor(gt, 8 * 17 + 5, 640))
    x = RNG.standard_normal((9, 640)).astype(np.float32)
    single = np.concatenate([packed.matvec(t, x[i : i + 1], tier) for i in range(9)])
    for M in range(1, 10):
        np.testing.assert_array_equal(packed.matvec(t, x[:M], tier), single[:M])
    xq, xs = np.empty((9, 640), np.int8), np.empty((9, 40), np.float32)
    packed.quantize_natural_into(x, xq, xs, 0, 640)
    for bounds in ([0, 17], [0, 3, 4, 9, 17]):
        out = np.empty((9, 136), np.float32)
        for g0, g1 in zip(bounds, bounds[1:]):
            packed.groups_into(int(gt), t.packed, 0, 20, g0, g1, xq, xs, out, 0, ir.tier_token(tier))
        np.testing.assert_array_equal(out, single[:, :136])
    want = int8.dequantized_input(int8.quantize(x), gt).astype(np.float64) @ gq.dequantize(t.raw, gt).reshape(
        t.rows, 640).T.astype(np.float64)
    np.testing.assert_allclose(single, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_natural_order_quantization_equals_the_interleaved_one():
    x = RNG.standard_normal((2, 256)).astype(np.float32)
    xq, xs = np.empty((2, 256), np.int8), np.empty((2, 16), np.float32)
    packed.quantize_natural_into(x, xq, xs, 0, x.shape[1])
    qin = int8.quantize(x)
    np.testing.assert_array_equal(xq[:, quantize.legacy_x_order(256)], qin.xq8)
    np.testing.assert_array_equal(xs, qin.xs8)


def test_mxfp4_has_no_packed_layout(tmp_path):
    # MXFP4 (gpt-oss's experts) is read in its GGUF blocks by int8's kernels: a load packs the legacy matrices
    # beside it and leaves it alone, and repack refuses it rather than mis-pack its 17-byte blocks.
    model = engine.load_model(make_fixtures.write_mxfp4_fixture(tmp_path / "mxfp4.gguf"), selftest=False)
    w = model.weights
    assert GGMLType.MXFP4 not in packed.PACKABLE
    for role in ("ffn_gate", "ffn_up", "ffn_down"):
        t = w.tensor(f"blk.0.{role}")
        assert t.ggml_type == GGMLType.MXFP4 and t.packed is None
    assert w.tensor("blk.0.attn_output").ggml_type == GGMLType.Q4_0 and w.tensor("blk.0.attn_output").packed is not None
    t = w.tensor("blk.0.ffn_up")
    with pytest.raises(ValueError, match="MXFP4 has no packed layout"):
        packed.repack(t.raw, t.ggml_type, np.empty(t.raw.size, np.uint8))


def test_a_real_model_reads_only_its_packed_copy(smollm2_gguf, tmp_path):
    """Load a copy of the model, then overwrite the packed tensors' original bytes in that file (the mapping
    sees the page cache): prompts long and short, decoding and embedding lookups must give exactly what the
    untouched model gives, so nothing reads the originals again, and their pages can stay out of memory."""
    path = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2_gguf, path)
    model, clean = engine.load_model(path, selftest=False), engine.load_model(smollm2_gguf, selftest=False)
    w = model.weights
    names = [f"blk.{i}.{r}" for i in range(model.config.n_layer) for r in ("attn_q", "attn_k", "attn_v",
             "attn_output", "ffn_gate", "ffn_up", "ffn_down")] + ["token_embd"]  # the tied head is embeddings too
    assert all(w.tensor(n).packed is not None for n in names)
    assert model.backend.packed_buffer.nbytes == sum(w.tensor(n).raw.nbytes for n in names)  # the same bytes, none twice
    base = w.buffer().__array_interface__["data"][0]
    with open(path, "r+b") as f:
        for n in names:
            f.seek(w.tensor(n).raw.__array_interface__["data"][0] - base)
            f.write(b"\xff" * w.tensor(n).raw.nbytes)  # f16 NaN scales: any read of them shows
    for text in ("The history of mechanical clocks begins in medieval Europe. " * 4, "Hi"):
        ids = model.tokenizer.encode(text)  # a long prompt (dequantize + sgemm), a short one (int8 matvec)
        got = [(e.token, e.logprob) for e in engine.generate(model, ids, max_tokens=4, temperature=0)]
        want = [(e.token, e.logprob) for e in engine.generate(clean, ids, max_tokens=4, temperature=0)]
        assert got == want
    np.testing.assert_array_equal(kernels_for("cpu").embed(w.tensor("token_embd"), [0, 5, 49151]),
                                  kernels_for("cpu").embed(clean.weights.tensor("token_embd"), [0, 5, 49151]))
