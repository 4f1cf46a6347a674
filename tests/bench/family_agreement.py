#!/usr/bin/env python3
"""The agreement figures docs/models.md quotes per family (not a test; tests/test_families.py holds the limits):
for every reference of ../shared/families/<family> (each GGUF and the hf/ safetensors directory), the exact path's worst |logprob diff| against the f32
oracle, and the default path's mean / worst |logprob diff| and mean KL against llama.cpp's top-20, over a prompt
(teacher-forced) and token by token through the compiled decode step.

Usage: python tests/bench/family_agreement.py [FAMILY ...]   (default: every family the engine loads)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from engine.models.registry import SUPPORTED_ARCHITECTURES  # noqa: E402
from tests.conftest import KIT  # noqa: E402  (GOINFER_KIT)
from tests.fidelity import decoded_rows, vs_llama_cpp  # noqa: E402


def main(families: list[str]) -> None:
    print("| file | exact: worst | default prompt: mean / worst / KL | default decode: mean / worst / KL |")
    print("|---|---|---|---|")
    for fam in families:
        for ref_path in sorted((KIT / fam).glob("tiny-*.json")):
            ref = json.loads(ref_path.read_text())
            path = ref_path.parent / ref["model_file"]
            exact = engine.load_model(path, quant="f32", selftest=False)
            fast = engine.load_model(path, selftest=False)
            worst_exact, cols = 0.0, {"prompt": [], "decode": []}
            for case in ref["cases"]:
                ids, start = case["tokens"] + case["greedy_ids"][:-1], len(case["tokens"]) - 1
                lp = exact.logprobs(ids, start=start)
                for j, pos in enumerate(case["positions"]):
                    top = np.array([i for i, _ in pos["exact_top"]])
                    worst_exact = max(worst_exact, float(np.abs(lp[j, top] - [v for _, v in pos["exact_top"]]).max()))
                for how, rows in (("prompt", fast.logprobs(ids, start=start)), ("decode", decoded_rows(fast, case))):
                    cols[how].append(vs_llama_cpp(rows, case))
            cells = []
            for how in ("prompt", "decode"):
                r = cols[how]
                kl = np.mean([k for _, _, _, kls in r for k in kls])
                cells.append(f"{max(m for m, *_ in r):.3f} / {max(w for _, w, *_ in r):.2f} / {kl:.4f}")
            print(f"| {ref_path.stem} | {worst_exact:.1e} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main(sys.argv[1:] or [f for f in SUPPORTED_ARCHITECTURES if (KIT / f).is_dir()])
