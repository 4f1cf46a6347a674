"""The CPU backend: numba kernels over GGUF blocks in place, their layouts, the compiled decode step
(backend.py is the entry point; docs/architecture.md maps the modules)."""

import os

import numba

from engine.kernels import kernel_cache

# Prefer OpenMP before any kernel of this package compiles or runs: workqueue costs much more per parallel launch
# and a pip tbb is slower to launch (docs/design-log.md, "The CPU kernel measurements", 3; docs/benchmarks.md,
# "Measurements behind the code", threading layer). Only a preference: an explicit NUMBA_THREADING_LAYER wins,
# and a machine without OpenMP falls back.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

# Compiled kernels go to the goinfer home (kernel_cache.py), decided before any kernel module's decorators run.
kernel_cache.configure()
