"""The WebGPU backend's first pieces on Mesa's lavapipe (software Vulkan): adapter discovery, `auto` never taking a
software adapter, and the WGSL matrix kernels over GGUF blocks as stored, against the numpy reference.

CI installs lavapipe (.ci/run: Debian's mesa-vulkan-drivers) and wgpu (the dev extra), so there these tests must
run; elsewhere a machine without an adapter skips them."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from engine.kernels import reference
from engine.kernels.quant_types import GGMLType, QTensor


def _adapters():
    from engine.kernels.webgpu.device import WebGPUUnavailable, adapters

    try:
        return adapters()
    except WebGPUUnavailable:
        return []


FOUND = _adapters()
pytestmark = pytest.mark.skipif(not FOUND and not os.environ.get("CI"),
                                reason="no WebGPU adapter (install wgpu and mesa-vulkan-drivers)")


@pytest.fixture(scope="module")
def kernels():
    from engine.kernels.webgpu.device import open_device, pick
    from engine.kernels.webgpu.matvec import WebGPUMatmul

    assert FOUND, "CI must have a WebGPU adapter (lavapipe)"
    info = pick(FOUND, "webgpu")
    return WebGPUMatmul(open_device(info), info.max_binding_bytes)


def test_lavapipe_is_found_with_its_limits_and_features():
    vulkan = [a for a in FOUND if a.backend == "Vulkan"]
    assert vulkan, [a.report() for a in FOUND]
    lvp = vulkan[0]
    assert lvp.software and lvp.max_binding_bytes >= 128 << 20
    assert {"shader-f16", "subgroup"} <= set(lvp.features)
    assert FOUND[0].backend != "OpenGL"  # Vulkan ranks before GL (GL has no f16 or subgroups)


def test_auto_never_takes_a_software_adapter():
    from engine.kernels.webgpu.device import pick

    assert pick(FOUND, "webgpu") is FOUND[0]
    real = [a for a in FOUND if not a.software]
    assert pick(FOUND, "auto") is (real[0] if real else None)
    assert pick([a for a in FOUND if a.software], "auto") is None


def _random(t: GGMLType, rows: int, cols: int, seed: int = 0) -> QTensor:
    w = np.random.default_rng(seed).normal(0, 1, (rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(t))).view(np.uint8).reshape(rows, -1)
    return QTensor(f"random-{t.name}", t, (rows, cols), raw)


@pytest.mark.parametrize("t", [GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1,
                               GGMLType.Q5_0, GGMLType.Q5_1])
@pytest.mark.parametrize("tokens", [1, 5, 19])  # 19: the prompt kernel's token tiles, the last one partial
def test_the_matrix_kernels_equal_the_reference(kernels, t, tokens):
    w = _random(t, 300, 576)
    x = np.random.default_rng(1).normal(0, 1, (tokens, 576)).astype(np.float32)
    expected = x @ reference.dequantize(w).T
    got = kernels.matmul(x, w)
    assert got.shape == (tokens, 300)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max() * 576 ** 0.5


@pytest.mark.parametrize("t", [GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_1])
def test_the_decode_kernel_sums_by_subgroup_where_the_adapter_has_them(t):
    """Rows of 64 blocks or more (a row's 64 lanes) summed by subgroup, against the reference."""
    from engine.kernels.webgpu.device import open_device, pick
    from engine.kernels.webgpu.matvec import WebGPUMatmul

    info = pick(FOUND, "webgpu")
    if "subgroup" not in info.features:
        pytest.skip(f"{info.name} has no subgroups")
    kernels = WebGPUMatmul(open_device(info), info.max_binding_bytes, subgroups=True)
    w = _random(t, 130, 4096, seed=6)
    x = np.random.default_rng(7).normal(0, 1, (3, 4096)).astype(np.float32)
    expected = x @ reference.dequantize(w).T
    got = kernels.matmul(x, w)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max() * 4096 ** 0.5


@pytest.mark.parametrize("t", [GGMLType.BF16, GGMLType.Q5_K])
@pytest.mark.parametrize("tokens", [1, 9])
def test_bf16_and_q5_k_equal_the_reference(kernels, t, tokens):
    """gguf writes BF16 but cannot quantize K-quants: Q5_K is random blocks under sane scales (testdata's fixtures'
    recipe), against the reference's decoder (itself checked against gguf's)."""
    from testdata.make_fixtures import random_weight

    raw = random_weight(np.random.default_rng(10), 200, 512, int(t))
    w = QTensor(f"random-{t.name}", t, (200, 512), raw)
    x = np.random.default_rng(11).normal(0, 1, (tokens, 512)).astype(np.float32)
    expected = x @ reference.dequantize(w).T
    got = kernels.matmul(x, w)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max() * 512 ** 0.5


def test_rows_past_the_dispatch_limit_are_computed_too(kernels):
    w = _random(GGMLType.Q8_0, 65_600, 32, seed=2)
    x = np.random.default_rng(3).normal(0, 1, (2, 32)).astype(np.float32)
    expected = x @ reference.dequantize(w).T
    got = kernels.matmul(x, w)
    assert np.allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert np.allclose(got[:, 65_535:], expected[:, 65_535:], atol=1e-4, rtol=1e-4)


def test_a_real_q8_0_head_on_the_device_gives_the_references_logits(kernels, smollm2_gguf):
    """SmolLM2's tied head (token_embd, Q8_0, 49,152 x 576, 30 MB) over a few hidden states."""
    from engine.formats.gguf import open_gguf

    head = open_gguf(smollm2_gguf).tensor("token_embd.weight")
    assert head.ggml_type == GGMLType.Q8_0
    x = np.random.default_rng(4).normal(0, 1, (2, 576)).astype(np.float32)
    expected = x @ reference.dequantize(head).T
    got = kernels.matmul(x, head)
    assert np.allclose(got, expected, atol=1e-3, rtol=1e-4)
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight"])
def test_real_q4_1_matrices_on_the_device_equal_the_reference(kernels, smollm2_gguf, name):
    from engine.formats.gguf import open_gguf

    w = open_gguf(smollm2_gguf).tensor(name)
    assert w.ggml_type == GGMLType.Q4_1
    x = np.random.default_rng(5).normal(0, 1, (3, w.cols)).astype(np.float32)
    expected = x @ reference.dequantize(w).T
    assert np.allclose(kernels.matmul(x, w), expected, atol=1e-3, rtol=1e-4)


def test_real_k_quant_matrices_on_the_device_equal_the_reference(kernels, gemma_gguf):
    """Gemma 3 270M Q4_K_M: its Q4_K and Q6_K matrices (gguf cannot write K-quants, so these are the real ones)."""
    from engine.formats.gguf import open_gguf

    source = open_gguf(gemma_gguf)
    seen = set()
    for name in source.entries:
        w = source.tensor(name)
        if w.ggml_type not in (GGMLType.Q4_K, GGMLType.Q6_K) or w.ggml_type in seen or len(w.shape) != 2:
            continue
        seen.add(w.ggml_type)
        x = np.random.default_rng(6).normal(0, 1, (2, w.cols)).astype(np.float32)
        expected = x @ reference.dequantize(w).T
        assert np.allclose(kernels.matmul(x, w), expected, atol=1e-3, rtol=1e-4), (name, w.ggml_type.name)
    assert seen == {GGMLType.Q4_K, GGMLType.Q6_K}


def test_a_weight_over_the_binding_limit_goes_in_pieces(kernels):
    from engine.kernels.webgpu.matvec import WebGPUMatmul

    small = WebGPUMatmul(kernels.device, max_binding_bytes=2000)  # 3 rows of 612 bytes a piece: 100 pieces
    w = _random(GGMLType.Q8_0, 300, 576, seed=7)
    x = np.random.default_rng(8).normal(0, 1, (2, 576)).astype(np.float32)
    assert len(small._pieces(w)) == 100
    assert np.allclose(small.matmul(x, w), x @ reference.dequantize(w).T, atol=1e-4, rtol=1e-4)


def test_gemmas_real_head_over_the_binding_limit_gives_the_references_logits(kernels, gemma_gguf):
    """Gemma 3 270M's tied head: Q8_0, 262,144 x 640, 178 MB: two pieces on lavapipe's 128 MiB bindings."""
    from engine.formats.gguf import open_gguf

    head = open_gguf(gemma_gguf).tensor("token_embd.weight")
    assert head.ggml_type == GGMLType.Q8_0 and head.raw.nbytes > kernels.max_binding_bytes
    x = np.random.default_rng(9).normal(0, 1, (1, head.cols)).astype(np.float32)
    expected = x @ reference.dequantize(head).T
    got = kernels.matmul(x, head)
    assert len(kernels._pieces(head)) >= 2
    assert np.allclose(got, expected, atol=1e-3, rtol=1e-4) and got.argmax() == expected.argmax()


def test_a_row_over_the_binding_limit_and_an_unread_type_are_refused(kernels):
    from engine.kernels.webgpu.matvec import WebGPUMatmul

    small = WebGPUMatmul(kernels.device, max_binding_bytes=1024)
    with pytest.raises(ValueError, match="one row is 2304 bytes, over the adapter's 1024-byte binding limit"):
        small.matmul(np.ones((1, 576), np.float32), _random(GGMLType.F32, 8, 576))
    with pytest.raises(ValueError, match="MXFP4 is not a type the WebGPU kernels read yet"):
        mx = QTensor("mxfp4", GGMLType.MXFP4, (4, 32), np.zeros((4, 17), np.uint8))  # 17 bytes per 32 weights
        kernels.matmul(np.ones((1, 32), np.float32), mx)
