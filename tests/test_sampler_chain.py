"""llama.cpp's samplers (engine/generation/sampler_chain.py, dry.py): each keeps the candidates and gives them the
probabilities llama.cpp's definition says (src/llama-sampling.cpp), checked against the definition written out
here; the chain's order changes what is kept where llama.cpp's does; mirostat holds the surprise near its target;
DRY's run lengths equal a brute-force count; and the steps the fast path shares draw from the same distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.errors import InvalidRequest
from engine.generation.dry import Dry, reversed_z
from engine.generation.sampler_chain import ChainSampler, ChainSettings
from engine.generation.sampling import FastSampler, SamplingParams, make_sampler


def drawn_from(params: SamplingParams, logits, history=(), tokenizer=None) -> dict[int, float]:
    """{token: probability} of the distribution the sampler drew its token from."""
    s = make_sampler(params, tokenizer)
    token = s(np.asarray(logits, np.float32).copy(), list(history))
    prob, cands = s.drawn(token, 1 << 20)
    out = dict(cands)
    assert math.isclose(out[token], prob) and math.isclose(sum(out.values()), 1.0, rel_tol=1e-9)
    return out


def softmax(x):
    e = np.exp(np.asarray(x, np.float64) - np.max(x))
    return e / e.sum()


def chain(**settings) -> ChainSettings:
    return ChainSettings(**settings)


LOGITS = np.array([4.0, 3.5, 3.0, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0])


def test_typical_p_keeps_the_tokens_nearest_the_entropy_until_their_mass_passes_p():
    one_likely = np.array([2.0] + [0.0] * 20)  # its likeliest token is far less surprising than the entropy
    for logits in (LOGITS, one_likely):
        p = softmax(logits)
        entropy = -(p * np.log(p)).sum()
        order = np.argsort(np.abs(-np.log(p) - entropy), kind="stable")
        mass = np.cumsum(p[order])
        kept = order[: int(np.argmax(mass > 0.5)) + 1]
        got = drawn_from(SamplingParams(temperature=1.0, seed=0, chain=chain(typical_p=0.5)), logits)
        assert set(got) == set(kept.tolist())
        want = softmax(logits[kept])
        assert all(math.isclose(got[int(t)], w) for t, w in zip(kept, want))
    assert 0 not in got  # unlike top_p, typical_p can leave out the likeliest token


def test_top_n_sigma_keeps_the_logits_within_n_deviations_of_the_best():
    mean, std = LOGITS.mean(), LOGITS.std()
    for n in (0.5, 1.0, 2.0):
        kept = np.flatnonzero(LOGITS >= LOGITS.max() - n * std)
        got = drawn_from(SamplingParams(temperature=1.0, seed=0, chain=chain(top_n_sigma=n)), LOGITS)
        assert sorted(got) == kept.tolist(), n
    assert mean < LOGITS.max()


def test_xtc_drops_every_token_above_the_threshold_but_the_least_likely_of_them():
    p = softmax(LOGITS)
    above = np.flatnonzero(p >= 0.1)  # the top few, in order
    got = drawn_from(SamplingParams(temperature=1.0, seed=0, chain=chain(xtc_probability=1.0, xtc_threshold=0.1)),
                     LOGITS)
    assert sorted(got) == list(range(above[-1], len(LOGITS)))
    # never when the draw says no, nor with a threshold over 0.5 (llama.cpp's off switch)
    assert len(drawn_from(SamplingParams(temperature=1.0, seed=0, chain=chain(xtc_probability=1.0,
                                                                              xtc_threshold=0.6)), LOGITS)) == 10


def test_dynamic_temperature_follows_the_normalized_entropy():
    p = softmax(LOGITS)
    h = -(p * np.log(p)).sum() / math.log(len(LOGITS))
    for exponent in (0.5, 1.0, 2.0):
        t = (1.0 - 0.5) + (2 * 0.5) * h ** exponent
        got = drawn_from(SamplingParams(temperature=1.0, seed=0, chain=chain(dynatemp_range=0.5,
                                                                             dynatemp_exponent=exponent)), LOGITS)
        want = softmax(LOGITS / t)
        assert np.allclose([got[i] for i in range(10)], want), exponent


def test_min_keep_holds_top_p_and_min_p_back():
    assert len(drawn_from(SamplingParams(temperature=1.0, top_p=0.01, seed=0), LOGITS)) == 1
    assert len(drawn_from(SamplingParams(temperature=1.0, top_p=0.01, seed=0, chain=chain(min_keep=3)), LOGITS)) == 3
    assert len(drawn_from(SamplingParams(temperature=1.0, min_p=0.9, seed=0, chain=chain(min_keep=4)), LOGITS)) == 4


def test_the_order_of_the_chain_changes_what_is_kept():
    hot = dict(temperature=3.0, top_p=0.6, seed=0)
    before = drawn_from(SamplingParams(**hot, chain=chain(order=("temperature", "top_p"))), LOGITS)
    after = drawn_from(SamplingParams(**hot, chain=chain(order=("top_p", "temperature"))), LOGITS)
    cum_hot, cum_cold = np.cumsum(softmax(LOGITS / 3.0)), np.cumsum(softmax(LOGITS))
    assert len(before) == int(np.argmax(cum_hot >= 0.6)) + 1 > len(after) == int(np.argmax(cum_cold >= 0.6)) + 1
    # penalties after top_k only reorder the two kept; before it they push the penalized token out
    pen = dict(temperature=1.0, top_k=2, repetition_penalty=100.0, seed=0)
    assert set(drawn_from(SamplingParams(**pen, chain=chain(order=("top_k", "penalties"))), LOGITS, [0])) == {0, 1}
    assert set(drawn_from(SamplingParams(**pen, chain=chain(min_keep=1)), LOGITS, [0])) == {1, 2}


def test_temperature_zero_in_the_chain_keeps_the_best_token():
    assert drawn_from(SamplingParams(temperature=0.0, seed=0, chain=chain(typical_p=0.99)), LOGITS) == {0: 1.0}


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_holds_the_average_surprise_near_its_target(version):
    rng = np.random.default_rng(7)
    zipf = -1.1 * np.log(np.arange(1, 2001))  # a long-tailed vocabulary, as language models give
    for tau in (2.0, 4.0):
        s = ChainSampler(SamplingParams(temperature=1.0, seed=1, chain=chain(mirostat=version, mirostat_tau=tau,
                                                                             mirostat_eta=0.1)))
        surprise = []
        for _ in range(1500):
            logits = zipf + rng.normal(0, 0.3, len(zipf))
            t = s(logits.astype(np.float32))
            surprise.append(-math.log2(s.drawn(t, 0)[0]))  # in what it drew from, as llama.cpp's feedback reads it
        assert abs(np.mean(surprise[300:]) - tau) < 0.1 * tau, (version, tau, np.mean(surprise[300:]))


def test_the_chain_and_the_fast_path_draw_from_the_same_distribution():
    rng = np.random.default_rng(3)
    for trial in range(30):
        logits = rng.normal(0, 2, 300).astype(np.float32)
        p = SamplingParams(temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.choice([0, 5, 40])),
                           top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05])), seed=trial)
        fast, slow = FastSampler(p), ChainSampler(p)
        a, b = fast(logits.copy()), slow(logits.copy())
        fa, fb = dict(fast.drawn(a, 1000)[1]), dict(slow.drawn(b, 1000)[1])
        assert set(fa) == set(fb) and all(math.isclose(fa[t], fb[t], rel_tol=1e-6) for t in fa), trial


def test_bad_settings_are_refused():
    for bad in (chain(mirostat=3), chain(dry_base=0.5), chain(order=("top_k", "top_k")), chain(order=("magic",)),
                chain(dry_sequence_breakers=()), chain(min_keep=-1)):
        with pytest.raises(InvalidRequest):
            SamplingParams(temperature=1.0, chain=bad).validate(10)


# ---------------------------------------------------------------------------------------------- DRY

class Vocabulary:
    """A tokenizer of one-character tokens (what DRY reads of one: pieces, the vocabulary size, encode)."""

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)

    def piece_bytes(self, token: int) -> bytes:
        return self.chars[token].encode()

    def encode(self, text: str, add_bos=False, add_eos=False) -> list[int]:
        return [self.chars.index(c) for c in text]


VOCAB = Vocabulary("abcdefgh\n:")


def dry_by_definition(history, multiplier, base, allowed, last_n, breaker_ids):
    """DRY's penalties by brute force: for each earlier position, the longest run ending there that equals the
    run ending the context (not reaching past the latest breaker); the token after it gets the penalty."""
    window = list(history[-last_n:]) if last_n > 0 else list(history)
    n = len(window)
    breaks = [i for i, t in enumerate(window) if t in breaker_ids]
    limit = n - 1 - breaks[-1] if breaks else n
    out: dict[int, float] = {}
    for j in range(n - 1):  # a run ending at j, followed by window[j + 1]
        run = 0
        while run <= j and window[j - run] == window[n - 1 - run]:
            run += 1
        run = min(run, limit)
        nxt = window[j + 1]
        if run >= allowed and nxt not in breaker_ids:
            out[nxt] = max(out.get(nxt, 0.0), multiplier * base ** (run - allowed))
    return out


def test_dry_penalizes_the_token_that_would_continue_a_repeat():
    a, b, c, d = 0, 1, 2, 3
    dry = Dry(VOCAB, 0.8, 1.75, 2, -1)
    assert dry.penalties([a, b, c, d, a, b, c]) == pytest.approx({d: 0.8 * 1.75})  # "a b c" again: d would extend it
    assert dry.penalties([a, b, c, d, e := 4, b, c]) == pytest.approx({d: 0.8})  # "b c": at the allowed length
    assert dry.penalties([a, b, c, d, e, f := 5, c]) == {}  # one token: under the allowed length


def test_dry_runs_stop_at_a_sequence_breaker():
    a, b, nl = 0, 1, VOCAB.chars.index("\n")
    dry = Dry(VOCAB, 1.0, 2.0, 2, -1)
    assert dry.penalties([a, b, 5, a, b]) == {5: 1.0}
    assert dry.penalties([a, b, nl, a, b]) == {}  # the breaker itself is never penalized
    c, e = 2, 4  # "c e a b" again: c would make a run of 5; with a newline for e, the run starts after it
    assert dry.penalties([c, e, a, b, c, e, a, b]) == {c: 4.0}
    assert dry.penalties([c, nl, a, b, c, nl, a, b]) == {c: 1.0}


def test_dry_agrees_with_its_definition_on_random_contexts():
    rng = np.random.default_rng(11)
    breakers = {VOCAB.chars.index("\n"), VOCAB.chars.index(":")}
    for trial in range(300):
        history = rng.integers(0, 3 if trial % 2 else 10, int(rng.integers(1, 60))).tolist()
        last_n = int(rng.choice([-1, 8, 30]))
        allowed = int(rng.integers(0, 4))
        got = Dry(VOCAB, 0.5, 1.5, allowed, last_n).penalties(history)
        want = dry_by_definition(history, 0.5, 1.5, allowed, last_n, breakers)
        if len(history if last_n < 0 else history[-last_n:]) <= allowed:
            want = {}
        assert got == pytest.approx(want), (trial, history, last_n, allowed)


def test_the_reversed_z_function_counts_common_suffixes():
    w = np.array([1, 2, 3, 3, 2, 3, 9, 1, 2, 3])  # llama.cpp's example: a b c c b c y a b c
    z = reversed_z(w)
    want = [0, 0, 3, 1, 0, 2, 0, 0, 0]  # per position, the common suffix ending there (llama.cpp's repeat counts)
    assert [int(z[len(w) - 1 - j]) for j in range(len(w) - 1)] == want


def test_dry_in_the_chain_pushes_a_looping_token_down():
    loop = [0, 1, 2, 3] * 3  # "a b c d" three times: the next "a" continues a 12-token run
    logits = np.zeros(VOCAB.vocab_size)
    got = drawn_from(SamplingParams(temperature=1.0, seed=0, chain=chain(dry_multiplier=0.8)), logits, loop, VOCAB)
    assert got[0] < 1e-6 and math.isclose(got[4], got[5])
