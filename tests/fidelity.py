"""What the fidelity tests share: the thresholds of ../shared/research/fidelity_noise.md (also the families kit's
README) and the comparison of our log-probabilities with llama.cpp's top-20 rows."""

from __future__ import annotations

import json

import numpy as np

import engine
from engine.models.base import log_softmax

EXACT_MAX_DIFF = 1e-3  # (i) exact path vs exact_top, every position
EXACT_TIE_MARGIN = 1e-3
CASE_MEAN_DIFF = 0.4  # (ii) default path vs llama.cpp, per case
POSITION_MAX_DIFF = 2.5
TOP1_MARGIN = 1.0
MODEL_MEAN_KL = 0.01
GREEDY_MARGIN = 0.3


def vs_llama_cpp(lp: np.ndarray, case: dict) -> tuple[float, float, list[int], list[float]]:
    diffs, top1_misses, kls = [], [], []
    for j, pos in enumerate(case["positions"]):
        ids = np.array([i for i, _ in pos["top"]])
        ref = np.array([v for _, v in pos["top"]], dtype=np.float64)
        ours = lp[j, ids].astype(np.float64)
        diffs.append(np.abs(ours - ref))
        if pos["margin"] >= TOP1_MARGIN and int(np.argmax(lp[j])) != ids[0]:
            top1_misses.append(j)
        p = np.exp(ref - np.logaddexp.reduce(ref))
        q = np.exp(ours - np.logaddexp.reduce(ours))
        kls.append(float(np.sum(p * (np.log(p) - np.log(q)))))
    d = np.stack(diffs)
    return float(d.mean()), float(d.max()), top1_misses, kls



def assert_in_noise_band(mean: float, worst: float, misses: list[int]) -> None:
    """A case inside llama.cpp's noise band: its mean, its worst position, top-1 where llama.cpp is confident."""
    assert mean <= CASE_MEAN_DIFF, f"mean |logprob diff| {mean:.3f} > {CASE_MEAN_DIFF}"
    assert worst <= POSITION_MAX_DIFF, f"max |logprob diff| {worst:.3f} > {POSITION_MAX_DIFF}"
    assert not misses, f"top-1 differs from llama.cpp at confident positions {misses}"


def assert_mean_kl(kls: list[float]) -> None:
    """A file's (or model's) positions, on average, within the KL bound."""
    assert np.mean(kls) <= MODEL_MEAN_KL, f"mean KL(llama.cpp || ours) {np.mean(kls):.4f} > {MODEL_MEAN_KL}"


def exact_violations(lp: np.ndarray, case: dict) -> list[str]:
    """Where the exact path leaves the f32 oracle (`exact_top`): |logprob diff| over its top-20 ids above
    EXACT_MAX_DIFF, or another top-1 where the oracle's own top-1/top-2 gap is at least EXACT_TIE_MARGIN."""
    bad = []
    for j, pos in enumerate(case["positions"]):
        ids = np.array([i for i, _ in pos["exact_top"]])
        ref = np.array([v for _, v in pos["exact_top"]])
        worst = np.abs(lp[j, ids] - ref).max()
        if worst > EXACT_MAX_DIFF:
            bad.append(f"position {j}: max |logprob diff| {worst:.2e} > {EXACT_MAX_DIFF}")
        if ref[0] - ref[1] >= EXACT_TIE_MARGIN and int(np.argmax(lp[j])) != ids[0]:
            bad.append(f"position {j}: top-1 differs from the oracle (margin {ref[0] - ref[1]:.4f})")
    return bad


def decoded_rows(model: engine.Model, case: dict) -> np.ndarray:
    """The case's rows with the continuation fed one token at a time (the compiled decode step on the default
    path, as generation runs it): log-softmax (len(positions), vocab)."""
    cache = model.new_cache(len(case["tokens"]) + len(case["greedy_ids"]))
    rows = [model.prefill(case["tokens"], cache)[-1]]
    rows += [model.decode([t], [cache])[0] for t in case["greedy_ids"][:-1]]
    return log_softmax(np.stack(rows))


class KitReferences:
    """The families kit's reference files and what tests compute from them, each loaded or computed once:
    ref(path) the JSON, model(path, quant) its file loaded, case(path, name), rows(path, quant, case, how) the
    case's log-probabilities over a prompt ("prompt") or token by token ("decode")."""

    def __init__(self) -> None:
        self._refs: dict = {}
        self._models: dict = {}
        self._rows: dict = {}

    def ref(self, path) -> dict:
        if path not in self._refs:
            self._refs[path] = json.loads(path.read_text())
        return self._refs[path]

    def model(self, path, quant: str) -> engine.Model:
        if (path, quant) not in self._models:
            self._models[path, quant] = engine.load_model(path.parent / self.ref(path)["model_file"], quant=quant,
                                                          selftest=False)
        return self._models[path, quant]

    def case(self, path, name: str) -> dict:
        return next(c for c in self.ref(path)["cases"] if c["name"] == name)

    def rows(self, path, quant: str, case: dict, how: str) -> np.ndarray:
        key = (path, quant, case["name"], how)
        if key not in self._rows:
            model = self.model(path, quant)
            self._rows[key] = (model.logprobs(case["tokens"] + case["greedy_ids"][:-1], start=len(case["tokens"]) - 1)
                               if how == "prompt" else decoded_rows(model, case))
        return self._rows[key]
