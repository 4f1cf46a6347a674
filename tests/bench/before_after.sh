#!/usr/bin/env bash
# Two checkouts' bench_speed.py figures in one sitting, taking turns (B A B A ...) per built-in model, one line
# per run: for a restructuring that must not change speed. Each checkout needs its own venv (.venv, installed
# with pip install -e . in it: the editable finder otherwise imports the other tree's engine) and a warm numba
# cache. Unsets OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE for itself (see docs/benchmarks.md).
#   tests/bench/before_after.sh BEFORE_DIR AFTER_DIR [TURNS]
set -u
before=$1 after=$2 turns=${3:-4}
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
M=${GOINFER_HOME:-$HOME/.cache/goinfer}/models
for model in smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf gemma3-270m/gemma-3-270m-q4_k_m.gguf; do
  for turn in $(seq "$turns"); do
    for side in "$before" "$after"; do
      out=$(cd "$side" && .venv/bin/python tests/bench/bench_speed.py "$M/$model" --reps 3 2>/dev/null)
      echo "$out" | python3 -c "
import json,sys; r=json.load(sys.stdin); g=r['goinfer']
print('$(basename "$side")', r['model'], 'turn $turn', 'prefill', g['prefill_tok_s'], 'decode', g['decode_tok_s'], 'sampled', g.get('decode_sampled_tok_s'), 'load', g['load_s'], 'foreign', g['foreign_cpu_frac'])"
    done
  done
done
