"""The llama.cpp side of testdata/make_quant_kit.py, run by the bench venv's Python (numpy and llama-cpp-python
only: it never imports the project, and the project never imports it).

    python quant_kit_llama.py quantize SRC.gguf DST.gguf Q2_K [--allow-requantize]
    python quant_kit_llama.py top MODEL.gguf KIT_REFERENCE.json OUT.json

`quantize` is llama.cpp's own quantizer (llama_model_quantize, what llama-quantize runs). `top` is the family
kit's `top` oracle remade for another file, by the method its README and `llama_cpp_settings` describe: CPU, f32
KV cache, the prompt in one eval then 32 greedy tokens one decode at a time (argmax, lowest id on ties, never
stopped), then tokens + greedy_ids[:-1] in one eval with the logits of every position; per position the top 20
[id, log-softmax in float64] sorted by logprob then id, 6 decimals. The prompts' tokens are the kit reference's
(llama.cpp's tokenization of the same vocabulary: a requantized file keeps its tokenizer).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from pathlib import Path

import llama_cpp
import numpy as np

SETTINGS = dict(n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2, n_gpu_layers=0,
                type_k=0, type_v=0, flash_attn=False, logits_all=True)  # type 0: f32 keys and values
N_GREEDY, TOP_K = 32, 20


def quantize(src: str, dst: str, ftype_name: str, allow_requantize: bool) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = 2
    params.allow_requantize = allow_requantize
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize {src} -> {ftype_name} failed ({rc})")


def _top(row: np.ndarray) -> tuple[list, float]:
    """Logits of one position -> (top-20 [id, logprob], margin), the kit's way."""
    x = row.astype(np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    order = np.lexsort((np.arange(len(lp)), -lp))[:TOP_K]  # logprob descending, then id ascending
    return [[int(i), round(float(lp[i]), 6)] for i in order], round(float(lp[order[0]] - lp[order[1]]), 6)


def top(model: str, reference: str, out: str) -> None:
    ref = json.loads(Path(reference).read_text())
    llm = llama_cpp.Llama(model_path=model, verbose=False, **SETTINGS)
    cases = []
    for case in ref["cases"]:
        tokens = list(case["tokens"])
        llm.reset()
        llm.eval(tokens)
        greedy = []
        for _ in range(N_GREEDY):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # argmax: the first (lowest id) of equal maxima
            greedy.append(nxt)
            llm.eval([nxt])
        llm.reset()
        llm.eval(tokens + greedy[:-1])
        n = len(tokens)
        positions = []
        for j in range(N_GREEDY):
            row_top, margin = _top(np.asarray(llm.scores[n - 1 + j]))
            positions.append({"top": row_top, "margin": margin})
        cases.append({k: case[k] for k in ("name", "category", "prompt", "add_bos", "tokens", "n_tokens")}
                     | {"greedy_ids": greedy, "stop_reason": "length", "positions": positions})
    data = Path(model).read_bytes()
    doc = {
        "model_file": Path(model).name, "sha256": hashlib.sha256(data).hexdigest(),
        "llama_cpp_python_version": llama_cpp.__version__, "kit_reference": Path(reference).name,
        "llama_cpp_settings": SETTINGS | {"greedy": "prompt in one eval, then one token per decode; argmax (lowest "
                                          "id on ties); always 32 tokens", "evaluation": "tokens + greedy_ids[:-1] "
                                          "in one llama.eval (n_batch chunks), logits of every token"},
        "positions_doc": ref.get("positions_doc", ""), "exact_top": "not made (needs transformers): top only",
        "cases": cases,
    }
    Path(out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "quantize":
        quantize(args[0], args[1], args[2], "--allow-requantize" in args[3:])
    elif cmd == "top":
        top(*args)
    else:
        sys.exit(f"unknown command {cmd!r} (quantize, top)")
