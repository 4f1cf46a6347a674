"""Which backend runs a model: the loader names one (hardware and configuration) and gets a new instance.

A backend package is imported only when asked for, so a GPU backend pulls in its library (cupy, wgpu) only when
a model runs on it. The WebGPU backend is not made here: it needs an adapter and a self-test first
(engine/placement.py).
"""

from __future__ import annotations

from engine.kernels.backend import PATHS, Backend

BACKENDS = ("cpu",)


def load_backend(name: str = "cpu", path: str = "fast", *, selftest: bool = True, note=None,
                 background_compile: list[str] | None = None) -> Backend:
    """A new backend instance: `name` the hardware ("cpu"), `path` its configuration ("fast", "exact").
    selftest: its prepare checks the kernels the model runs first (once per process); a type whose fast kernel
    disagreed with the reference then runs on the reference tier (`stepped_down`). note(line): what the user
    should hear meanwhile (a first run's compile, a kernel stepped down); default: stderr. background_compile:
    a command (engine/precompile.py) that compiles the model's kernels into numba's cache; where they are not
    there yet, it runs detached and the model decodes without its compiled step meanwhile."""
    if path not in PATHS:
        raise ValueError(f"unknown compute path {path!r}; choose from {', '.join(PATHS)}")
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from: {', '.join(BACKENDS)}")
    from engine.kernels.cpu.backend import cpu_backend

    return cpu_backend(path, selftest=selftest, note=note, background_compile=background_compile)
