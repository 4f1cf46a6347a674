"""A prompt's numbers do not depend on how it is cut into chunks, when the cuts fall on the backend's prompt tiles
(kernels/backend.py PROMPT_TILE): what lets a reused prefix (engine/sessions/pool.py) continue exactly as a cold
prefill. Held bit for bit (keys, values, recurrent state, logits) on both real models, on every family of the
kit (MoE routing, sliding windows, recurrent layers), on the default path and the exact one, under whatever BLAS
setting the tests run with (OPENBLAS_CORETYPE=Haswell here: its sgemm gives a row other numbers in a call of
another shape)."""

from __future__ import annotations

import numpy as np
import pytest

import engine
from engine.kernels.cpu import matmul
from tests.conftest import KIT, needs_kit

FAMILY_FILES = sorted(KIT.glob("*/tiny-*.Q8_0.gguf")) + sorted(KIT.glob("*/tiny-*.Q4_K_M.gguf"))


def prefill_in_parts(model, ids, cuts):
    """Prefill ids into a new cache, stopping at each cut; the last part's logits and the cache."""
    cache = model.new_cache(2048)
    bounds = [0, *cuts, len(ids)]
    for a, b in zip(bounds, bounds[1:]):
        logits = model.prefill(ids[a:b], cache)
    return logits, cache


def assert_same_cache(a, b):
    assert a.length == b.length
    for layer in range(a.n_layer):
        assert np.array_equal(a.keys(layer), b.keys(layer)), f"keys of layer {layer}"
        assert np.array_equal(a.values(layer), b.values(layer)), f"values of layer {layer}"
    for name in a.state:
        assert np.array_equal(a.state[name], b.state[name]), name


def check_cuts(model, n_tokens, cut_sets):
    tile = model.backend.prompt_tile
    ids = np.random.default_rng(n_tokens).integers(3, min(20000, model.vocab_size), n_tokens).astype(np.int64)
    whole, whole_cache = prefill_in_parts(model, ids, [])
    for cuts in cut_sets:
        assert all(c % tile == 0 for c in cuts)
        logits, cache = prefill_in_parts(model, ids, cuts)
        assert np.array_equal(logits, whole), cuts
        assert_same_cache(cache, whole_cache)


@pytest.mark.parametrize("which", ["smollm2", "gemma"])
@pytest.mark.parametrize("quant", ["auto", "f32"])
def test_real_models_prompt_rows_do_not_depend_on_the_chunking(which, quant, smollm2_gguf, gemma_gguf):
    model = engine.load_model(smollm2_gguf if which == "smollm2" else gemma_gguf, quant=quant)
    # 1000 tokens: cold = 512 + 488; resumed at 128, 384+640 (a 256-token middle part), 896 (a 104-token last
    # part), 768 + 896; and a prompt whose last part is a single token (the compiled step must not take it)
    check_cuts(model, 1000, [[128], [384, 640], [896], [768, 896]])
    check_cuts(model, 897, [[896]])


@needs_kit
@pytest.mark.parametrize("path", FAMILY_FILES, ids=lambda p: p.stem)
def test_every_family_prompt_rows_do_not_depend_on_the_chunking(path):
    model = engine.load_model(path)
    check_cuts(model, 700, [[256], [128, 640]])


def test_tiled_gemm_equals_one_call_per_tile():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3 * matmul.PROMPT_TILE + 5, 64)).astype(np.float32)
    wt = rng.standard_normal((40, 64)).astype(np.float32).T  # as the kernels pass it: a transposed weight
    got = matmul.tiled_gemm(x, wt)
    tile = matmul.PROMPT_TILE
    for t0 in range(0, len(x), tile):
        assert np.array_equal(got[t0 : t0 + tile], x[t0 : t0 + tile] @ wt)
