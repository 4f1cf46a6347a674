"""Generation on the real default model: stopping rules, sampling controls, reproducibility."""

from __future__ import annotations

import numpy as np
import pytest

import engine
from engine.errors import ContextOverflow, InvalidRequest
from engine.kernels import nucleus, vmath
from engine.generation.sampling import SamplingParams, make_logits_processors, make_sampler


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return engine.load_model(smollm2_gguf)


def _chat_ids(model, text):
    return model.tokenizer.encode(model.render_chat([{"role": "user", "content": text}]))


def _run(model, ids, **kw):
    events = list(engine.generate(model, ids, **kw))
    return events, "".join(e.text for e in events)


def test_greedy_chat_answer_ends_at_end_of_turn(smol):
    events, text = _run(smol, _chat_ids(smol, "What is the capital of France? Answer in one sentence."), max_tokens=64, temperature=0)
    assert "Paris" in text
    last = events[-1]
    assert last.finish_reason == "stop" and last.token in smol.tokenizer.eog_ids and last.text == ""
    assert all(e.finish_reason is None for e in events[:-1])
    assert "<|im_end|>" not in text


def test_max_tokens_ends_with_length(smol):
    events, _ = _run(smol, smol.tokenizer.encode("Once upon a time"), max_tokens=5, temperature=0)
    assert len(events) == 5 and events[-1].finish_reason == "length"


def test_stop_string_cuts_text_before_it(smol):
    ids = smol.tokenizer.encode("The days of the week are Monday, Tuesday,")
    _, full = _run(smol, ids, max_tokens=20, temperature=0)
    assert "day" in full
    stop = "day"
    events, text = _run(smol, ids, max_tokens=20, temperature=0, stop=[stop, "never-seen"])
    assert text == full[: full.index(stop)]
    assert events[-1].finish_reason == "stop"


def test_same_seed_same_text_and_streamed_text_equals_decode(smol):
    ids = smol.tokenizer.encode("My favourite food is")
    a, text_a = _run(smol, ids, max_tokens=24, temperature=1.0, seed=1234)
    b, text_b = _run(smol, ids, max_tokens=24, temperature=1.0, seed=1234)
    assert [e.token for e in a] == [e.token for e in b] and text_a == text_b
    tokens = [e.token for e in a if e.token not in smol.tokenizer.eog_ids]
    assert text_a == smol.tokenizer.decode(tokens, skip_special=True)


def test_without_logprobs_the_same_tokens_come_out(smol):
    # logprobs=False skips the normalizer and lets processors work on the step's own logits: same draws.
    ids = smol.tokenizer.encode("My favourite food is")
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, seed=5, logit_bias={smol.tokenizer.encode(" pizza")[0]: 5.0},
              repetition_penalty=1.3)
    with_lp = list(engine.generate(smol, ids, **kw))
    without = list(engine.generate(smol, ids, logprobs=False, **kw))
    assert [(e.token, e.text) for e in without] == [(e.token, e.text) for e in with_lp]
    assert all(e.logprob is None for e in without) and all(e.logprob <= 0 for e in with_lp)


def test_top_k_one_is_greedy(smol):
    ids = smol.tokenizer.encode("Water boils at")
    greedy = [e.token for e in engine.generate(smol, ids, max_tokens=8, temperature=0)]
    topk1 = [e.token for e in engine.generate(smol, ids, max_tokens=8, temperature=1.5, top_k=1, seed=7)]
    assert topk1 == greedy


def test_event_logprob_is_the_models(smol):
    ids = smol.tokenizer.encode("Water boils at")
    first = next(iter(engine.generate(smol, ids, max_tokens=1, temperature=0)))
    lp = smol.next_logprobs(ids)
    assert first.token == int(np.argmax(lp))
    assert first.logprob == pytest.approx(float(lp[first.token]), abs=1e-4)


def test_logprobs_rows_match_next_logprobs(smol):
    ids = smol.tokenizer.encode("One, two, three, four")
    rows = smol.logprobs(ids, start=2)
    assert rows.shape == (len(ids) - 2, smol.vocab_size) and rows.dtype == np.float32
    np.testing.assert_allclose(rows[-1], smol.next_logprobs(ids), atol=1e-4)
    np.testing.assert_allclose(rows[0], smol.next_logprobs(ids[:3]), atol=1e-4)
    np.testing.assert_allclose(np.exp(rows.astype(np.float64)).sum(axis=1), 1.0, atol=1e-4)


def test_bad_requests_are_refused(smol):
    ids = smol.tokenizer.encode("Hi")
    with pytest.raises(InvalidRequest, match="temperature"):
        list(engine.generate(smol, ids, temperature=-1))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        list(engine.generate(smol, ids, max_tokens=0))
    with pytest.raises(InvalidRequest, match="empty"):
        list(engine.generate(smol, [], max_tokens=4))
    with pytest.raises(InvalidRequest, match="logit_bias"):
        list(engine.generate(smol, ids, logit_bias={10**9: 1.0}))
    with pytest.raises(ContextOverflow, match="context window"):
        list(engine.generate(smol, ids * smol.context_length, max_tokens=4))


def test_logit_bias_forces_a_token(smol):
    ids = smol.tokenizer.encode("Hello")
    forced = smol.tokenizer.encode(" banana")[0]
    events = list(engine.generate(smol, ids, max_tokens=3, temperature=0, logit_bias={forced: 100.0}))
    assert [e.token for e in events] == [forced] * 3


# --- samplers and processors on synthetic logits ---

def test_sampler_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2, 1e-9], dtype=np.float32))
    sample = make_sampler(SamplingParams(temperature=1.0, seed=0))
    counts = np.bincount([sample(logits.copy()) for _ in range(4000)], minlength=4) / 4000
    np.testing.assert_allclose(counts[:3], [0.5, 0.3, 0.2], atol=0.03)


def test_compiled_draw_is_numpys_inverse_cdf_and_never_picks_a_masked_token():
    # vmath.softmax_draw against the numpy oracle: f64 softmax, cumsum, the first index past u (what
    # Generator.choice does). Its weights are f32, so only draws away from a CDF step by more than 1e-5 must agree.
    rng = np.random.default_rng(5)
    for n, scale, temp in [(4, 1.0, 1.0), (1000, 2.0, 0.7), (262144, 3.0, 1.0), (49152, 8.0, 1.3), (5000, 0.1, 0.5)]:
        x = rng.normal(0, scale, n).astype(np.float32)
        z = x.astype(np.float64) / temp
        cdf = np.cumsum(np.exp(z - z.max()))
        cdf /= cdf[-1]
        checked = 0
        for u in rng.random(200):
            i = int(np.searchsorted(cdf, u, side="right"))
            if np.min(np.abs(cdf[max(0, i - 1) : i + 1] - u)) > 1e-5:
                assert vmath.softmax_draw(x, np.float32(1 / temp), u) == i
                checked += 1
        assert checked > 100
    # -inf (a grammar mask) and hugely negative (a ban) logits carry no weight, even at the very end of the CDF.
    x = np.full(10000, -np.inf, np.float32)
    x[[3, 7000]] = [1.0, 0.5]
    x[9999] = -1e9
    for u in (0.0, 0.5, 0.999999, np.nextafter(1.0, 0.0)):
        assert vmath.softmax_draw(x, np.float32(1.0), u) in (3, 7000)


@pytest.mark.parametrize("k", [1, 5, 64, 1024])
def test_compiled_top_k_selects_the_k_largest(k):
    rng = np.random.default_rng(k)
    x = rng.normal(0, 3, 262144).astype(np.float32)
    assert set(vmath.top_k_indices(x, k).tolist()) == set(np.argsort(-x, kind="stable")[:k].tolist())
    ties = rng.integers(0, 20, 5000).astype(np.float32)  # many equal values: the lower index wins a tie
    assert set(vmath.top_k_indices(ties, k).tolist()) == set(np.argsort(-ties, kind="stable")[:k].tolist())


def test_top_p_and_min_p_cut_the_tail():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    top_p = make_sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0))
    assert {top_p(logits.copy()) for _ in range(300)} == {0, 1}
    min_p = make_sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=0))
    assert {min_p(logits.copy()) for _ in range(300)} == {0, 1}


def test_penalties_lower_seen_tokens():
    logits = np.array([2.0, 2.0, -1.0, 0.5], dtype=np.float32)
    (rep,) = make_logits_processors(SamplingParams(repetition_penalty=2.0))
    out = rep(logits.copy(), [0, 2])
    np.testing.assert_allclose(out, [1.0, 2.0, -2.0, 0.5])
    (pen,) = make_logits_processors(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    out = pen(logits.copy(), [1, 1, 3])
    np.testing.assert_allclose(out, [2.0, 2.0 - 0.5 - 0.5, -1.0, 0.5 - 0.5 - 0.25])


def _full_sort_sampler(p: SamplingParams):
    """The sampler as first written: the whole vocabulary sorted every token (the oracle for the fast one)."""
    rng = np.random.default_rng(p.seed)

    def sample(logits):
        cand, vals = np.arange(len(logits)), logits.astype(np.float64)
        if 0 < p.top_k < len(vals):
            keep = np.argpartition(-vals, p.top_k - 1)[: p.top_k]
            cand, vals = cand[keep], vals[keep]
        order = np.lexsort((cand, -vals))
        cand, vals = cand[order], vals[order]
        probs = np.exp(vals - vals.max()) / np.exp(vals - vals.max()).sum()
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            cand, vals, probs = cand[:cut], vals[:cut], probs[:cut]
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            cand, vals = cand[keep], vals[keep]
        z = vals / p.temperature
        probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        return int(cand[rng.choice(len(cand), p=probs)])

    return sample


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_p=0.999), dict(min_p=0.05), dict(min_p=1e-6),
                                dict(top_k=40, top_p=0.8), dict(top_k=5), dict(top_p=0.95, min_p=0.1)])
def test_sampler_sorts_only_what_it_keeps_and_draws_as_a_full_sort(kw):
    # Flat and peaked rows over a Gemma-sized vocabulary: same draws, seed for seed, as sorting everything.
    rng = np.random.default_rng(3)
    for scale in (0.5, 3.0, 8.0):
        params = SamplingParams(temperature=0.8, seed=11, **kw)
        fast, slow = make_sampler(params), _full_sort_sampler(params)
        for _ in range(5):
            logits = rng.normal(0, scale, 262144).astype(np.float32)
            assert fast(logits.copy()) == slow(logits.copy())


def _kept_by_full_sort(logits: np.ndarray, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The ids top-p then min-p keep, sorted (larger logit, then lower id, first), and their logits: the oracle."""
    ids = np.lexsort((np.arange(len(logits)), -logits.astype(np.float64)))
    vals = logits[ids].astype(np.float64)
    ids, vals = ids[vals > -np.inf], vals[vals > -np.inf]
    probs = np.exp(vals - vals[0]) / np.exp(vals - vals[0]).sum()
    if top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        ids, vals, probs = ids[:cut], vals[:cut], probs[:cut]
    if min_p > 0:
        keep = probs >= min_p * probs[0]
        ids, vals = ids[keep], vals[keep]
    return ids, vals


def _rows(rng):
    """Flat, peaked, tied and masked rows, from a handful of tokens to a Qwen-sized vocabulary."""
    yield rng.normal(0, 0.05, 151936).astype(np.float32)  # nearly flat: the nucleus is most of the vocabulary
    yield rng.normal(0, 1.0, 151936).astype(np.float32)
    yield rng.normal(0, 6.0, 151936).astype(np.float32)  # peaked: a few tokens
    banned = rng.normal(0, 0.05, 151936).astype(np.float32)
    banned[[5, 70000, 151000]] = [-1e9, -100.0, -70.0]  # logit_bias bans far below the rest
    yield banned
    yield rng.integers(-3, 4, 50000).astype(np.float32)  # seven values: long runs of ties at every cut
    masked = rng.normal(0, 2.0, 30000).astype(np.float32)
    masked[rng.random(30000) < 0.9] = -np.inf  # a grammar's mask
    yield masked
    yield np.array([2.0, 2.0, 2.0, -np.inf], np.float32)
    yield np.array([0.7], np.float32)


@pytest.mark.parametrize("top_p,min_p", [(0.9, 0.0), (0.95, 0.0), (0.999, 0.0), (0.5, 0.0), (1.0, 0.05),
                                         (1.0, 1e-4), (0.95, 0.05), (0.8, 0.3)])
def test_the_nucleus_keeps_and_weighs_what_a_full_sort_keeps(top_p, min_p):
    # The sampler's kept set (every token ranked at or above nucleus.nucleus_cut's cut) is the full sort's, token for
    # token, and its probabilities at the temperature (drawn: the likeliest 20 and the drawn token's) are the full
    # sort's softmax over that set.
    rng = np.random.default_rng(int(top_p * 1000 + min_p * 1e5))
    for logits in _rows(rng):
        want, vals = _kept_by_full_sort(logits, top_p, min_p)
        m, cut_value, cut_id = nucleus.nucleus_cut(logits, top_p, min_p)
        ids = np.arange(len(logits))
        kept = np.flatnonzero((logits > cut_value) | ((logits == cut_value) & (ids <= cut_id)))
        assert np.array_equal(np.sort(want), kept), (len(want), len(kept))
        sample = make_sampler(SamplingParams(temperature=0.7, top_p=top_p, min_p=min_p, seed=1))
        z = vals / 0.7
        probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        for _ in range(3):
            token = sample(logits.copy())
            assert token in set(want.tolist())
            p, best = sample.drawn(token, 20)
            np.testing.assert_allclose(p, probs[list(want).index(token)], rtol=1e-9)
            assert [t for t, _ in best] == want[:20].tolist()
            np.testing.assert_allclose([q for _, q in best], probs[:20], rtol=1e-9)


def test_nucleus_draws_follow_the_kept_distribution():
    # The draw is the inverse CDF in rank order over the kept set: the full sort's draw at the same uniform, wherever
    # the uniform is not within rounding of a CDF step.
    rng = np.random.default_rng(9)
    for logits in _rows(rng):
        want, vals = _kept_by_full_sort(logits, 0.9, 0.0)
        z = (vals - vals[0]) * 1.3
        cdf = np.cumsum(np.exp(z))
        cdf /= cdf[-1]
        m, cut_value, cut_id = nucleus.nucleus_cut(logits, 0.9, 0.0)
        for u in rng.random(100):
            i = int(np.searchsorted(cdf, u, side="right"))
            if np.min(np.abs(cdf[max(0, i - 1) : i + 1] - u)) > 1e-9:
                assert nucleus.draw_above(logits, m, cut_value, cut_id, 1.3, u)[0] == want[i]


def test_the_sampling_object_and_its_fields_as_keywords_pick_the_same_tokens(smol):
    ids = smol.tokenizer.encode("My favourite food is")
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5, repetition_penalty=1.2,
                            logit_bias={13: -2.0})
    whole = [e.token for e in engine.generate(smol, ids, max_tokens=12, sampling=params)]
    named = [e.token for e in engine.generate(smol, ids, max_tokens=12, temperature=0.9, top_k=20,
                                                         top_p=0.9, seed=5, repetition_penalty=1.2,
                                                         logit_bias={13: -2.0})]
    assert whole == named
    with pytest.raises(TypeError, match="not both"):
        engine.generate(smol, ids, sampling=params, temperature=0.5)
    with pytest.raises(TypeError):
        engine.generate(smol, ids, temprature=0.5)  # a misspelt setting is not ignored
