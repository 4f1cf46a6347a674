"""Where a model runs: `--backend cpu | webgpu | auto` -> the backend the loader builds, and the reason.

    cpu     the CPU backend (numba kernels), always.
    webgpu  the WebGPU backend on the best adapter wgpu sees, software ones included (Mesa's lavapipe in CI); an
            error when there is none or the model is one the WebGPU pass does not run yet.
    auto    the WebGPU backend on a real GPU (never a software adapter: far slower than numpy; docs/benchmarks.md,
            "Measurements behind the code", WebGPU software adapters) when the model is one it runs, else the CPU.
Either way a WebGPU model passes the once-per-process self-test (kernels/webgpu/selftest.py) before it is used;
on a failure it continues on the CPU with one WARN line, and `Model.placement` (what /health and /v1/models show)
says so.
"""

from __future__ import annotations

from engine.errors import InvalidRequest
from engine.kernels import registry

BACKEND_CHOICES = ("cpu", "webgpu", "auto")


def choose(asked: str, config, weights, matrices: list[str]) -> tuple[object | None, dict]:
    """(the WebGPU adapter to run on, or None for the CPU; placement) for a model about to load: placement holds
    the backend, asked, the reason, and the adapter's report where one was looked at. InvalidRequest for an unknown
    choice or an explicit webgpu that cannot be had (no wgpu, no adapter, a model it does not run)."""
    if asked not in BACKEND_CHOICES:
        raise InvalidRequest(f"unknown backend {asked!r} (choose from: {', '.join(BACKEND_CHOICES)})")
    if asked == "cpu":
        return None, {"backend": "cpu", "asked": "cpu"}
    def fallback(reason: str, adapter=None) -> tuple[None, dict]:
        if asked == "webgpu":
            raise InvalidRequest(f"--backend webgpu: {reason}")
        return None, {"backend": "cpu", "asked": asked, "reason": reason,
                       **({"adapter": adapter.report()} if adapter is not None else {})}

    found, why_none = registry.webgpu_adapters()
    if why_none:
        return fallback(why_none)
    adapter = registry.pick_adapter(found, asked)
    if adapter is None:
        return (fallback("only software adapters, which auto never takes", found[0]) if found
                else fallback("no WebGPU adapter"))
    why_not = registry.webgpu_refusal(config, weights, matrices)
    if why_not:
        return fallback(why_not, adapter)
    return adapter, {"backend": "webgpu", "asked": asked, "adapter": adapter.report()}


def place_on_webgpu(adapter, config, weights, matrices: list[str], placement: dict, *, selftest: bool = True,
                    note=None):
    """The model resident on the adapter (a prepared WebGPU backend), after the adapter's self-test
    (engine/loading/gpu_selftest.py, once per process); None when the self-test failed: placement then says backend cpu
    and why, and one WARN line has gone to note (default stderr)."""
    from engine.loading import gpu_selftest

    warn = note or _stderr
    try:
        resident = registry.webgpu_resident(adapter)
        if selftest:
            result = placement["selftest"] = gpu_selftest.run(adapter.name, resident)
            if result["status"] != "passed":
                reason = f"the WebGPU self-test failed on {adapter.name} ({result['reason']})"
                warn(f"WARN: self-test: {reason}; the model runs on the CPU")
                placement.update(backend="cpu", reason=reason)
                return None
        else:
            placement["selftest"] = {"backend": "webgpu", "adapter": adapter.name, "status": "skipped"}
        return resident(config, weights, matrices)
    except Exception as e:  # the device refused it (no memory left, a lost device): the CPU can still run it
        reason = f"the model could not go on {adapter.name} ({type(e).__name__}: {str(e)[:200]})"
        warn(f"WARN: webgpu: {reason}; the model runs on the CPU")
        placement.update(backend="cpu", reason=reason)
        return None


def webgpu_selftest(adapter) -> dict:
    """The self-test on an adapter (check --hardware): its result, run now or earlier in this process."""
    from engine.loading import gpu_selftest

    try:
        return gpu_selftest.run(adapter.name, registry.webgpu_resident(adapter))
    except Exception as e:  # opening the device failed: the report says so
        return {"backend": "webgpu", "adapter": adapter.name, "status": "failed", "reason": f"{type(e).__name__}: {e}"}


def _stderr(line: str) -> None:
    import sys

    print(f"goinfer: {line}", file=sys.stderr, flush=True)
