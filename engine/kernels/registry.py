"""The one way to a backend from outside engine/kernels/: the loader names one and gets a new instance.

    load_backend("cpu", path)       the CPU backend (numba kernels), configuration "fast" or "exact"
    webgpu_adapters()               the WebGPU adapters wgpu sees, or why there are none
    pick_adapter(found, asked)      the adapter `--backend webgpu|auto` takes
    webgpu_refusal(config, ...)     why the WebGPU pass cannot run a model (None: it can)
    webgpu_resident(adapter)        (config, weights, matrix names) -> a prepared WebGPU backend on its device
    selftest_report()               what the CPU kernels' self-test found in this process

A backend package is imported only when asked for, so a GPU backend pulls in its library (wgpu, later cupy) only
when a model runs on it. Which backend a model gets (and the WebGPU self-test first) is engine/loading/placement.py's
choice; docs/architecture.md gives the import rule this module is the door of.
"""

from __future__ import annotations

from typing import Callable

from engine.kernels.backend import PATHS, Backend


def load_backend(name: str = "cpu", path: str = "fast", *, selftest: bool = True, note=None,
                 background_compile: list[str] | None = None) -> Backend:
    """A new CPU backend: `path` its configuration ("fast", "exact"). A WebGPU backend needs an adapter and is
    made by webgpu_resident.
    selftest: its prepare checks the kernels the model runs first (once per process); a type whose fast kernel
    disagreed with the reference then runs on the reference tier (`stepped_down`). note(line): what the user
    should hear meanwhile (a first run's compile, a kernel stepped down); default: stderr. background_compile:
    a command (engine/loading/precompile.py) that compiles the model's kernels into numba's cache; where they are
    not there yet, it runs detached and the model decodes without its compiled step meanwhile."""
    if path not in PATHS:
        raise ValueError(f"unknown compute path {path!r}; choose from {', '.join(PATHS)}")
    if name != "cpu":
        raise ValueError(f"unknown backend {name!r}; choose from: cpu (webgpu: webgpu_resident)")
    from engine.kernels.cpu.backend import cpu_backend

    return cpu_backend(path, selftest=selftest, note=note, background_compile=background_compile)


def webgpu_adapters() -> tuple[list, str | None]:
    """(the adapters wgpu sees, best first; why there are none: wgpu missing or no driver)."""
    from engine.kernels.webgpu import device

    try:
        return device.adapters(), None
    except device.WebGPUUnavailable as e:
        return [], str(e)


def pick_adapter(found: list, asked: str):
    """The adapter `--backend webgpu` (any, software ones included) or `auto` (a real GPU only) takes, or None."""
    from engine.kernels.webgpu import device

    return device.pick(found, asked)


def webgpu_refusal(config, weights, matrices: list[str]) -> str | None:
    """Why the WebGPU pass cannot run this model (a family or tensor type it lacks), or None."""
    from engine.kernels.webgpu.resident import unsupported

    return unsupported(config, weights, matrices)


_GPUS: dict[str, object] = {}  # adapter name -> its device (program.Gpu), opened once per process


def webgpu_resident(adapter) -> Callable:
    """(config, weights, matrix names) -> a prepared WebGPU backend on the adapter's device (opened once)."""
    from engine.kernels.webgpu.device import open_device
    from engine.kernels.webgpu.program import Gpu
    from engine.kernels.webgpu.resident import WebGPUResident

    gpu = _GPUS.get(adapter.name)
    if gpu is None:
        gpu = _GPUS[adapter.name] = Gpu(open_device(adapter), adapter.max_binding_bytes, adapter.features)

    def resident(config, weights, names):
        backend = WebGPUResident(gpu, adapter.name)
        backend.prepare(config, weights, None, names)
        return backend

    return resident


def selftest_report() -> dict:
    """The CPU kernels' self-test as run in this process (at the first model load): status, tier, per type."""
    from engine.kernels.cpu.selftest import report

    return report()
