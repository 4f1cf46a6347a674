"""The hardware report `goinfer check --hardware` prints: what a bug report needs, nothing personal.

Versions (goinfer, OS kernel, Python, numpy and its BLAS, numba/llvmlite), CPU model, cores, ISA features
and the kernel tier in use, memory, GPU backends (importable or why not), the kernel self-test, and with
`fit` the memory a model needs at a context size against what is free. No hostname, user name, home
directory, path or network address goes in: only names, numbers and versions.
"""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["cpu_info", "fit_report", "gpu_backends", "hardware_report", "memory_info", "supported_models"]

# /proc/cpuinfo flag -> the name people search for. x86 first, then Arm "Features".
ISA_FLAGS = {
    "sse4_2": "SSE4.2", "avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C",
    "avx512f": "AVX-512F", "avx512bw": "AVX-512BW", "avx512vl": "AVX-512VL", "avx512_vnni": "AVX-512-VNNI",
    "avx512_bf16": "AVX-512-BF16", "avx512_fp16": "AVX-512-FP16", "avx_vnni": "AVX-VNNI",
    "amx_tile": "AMX-TILE", "amx_int8": "AMX-INT8", "amx_bf16": "AMX-BF16",
    "asimd": "NEON", "asimddp": "DOTPROD", "i8mm": "I8MM", "sve": "SVE", "sve2": "SVE2", "bf16": "BF16",
}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    text = _read("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    model, flags, cores = None, set(), set()
    physical = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
        elif key == "physical id":
            physical = value
        elif key == "core id":
            cores.add((physical, value))
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"model": model or platform.processor() or platform.machine(), "arch": platform.machine(),
            "logical_cores": os.cpu_count(), "physical_cores": len(cores) or None, "usable_cores": usable,
            "isa": [name for flag, name in ISA_FLAGS.items() if flag in flags]}


def memory_info() -> dict[str, Any]:
    info: dict[str, Any] = {"total_bytes": None, "available_bytes": None, "cgroup_limit_bytes": None}
    for line in _read("/proc/meminfo").splitlines():
        m = re.match(r"(MemTotal|MemAvailable):\s+(\d+) kB", line)
        if m:
            info["total_bytes" if m[1] == "MemTotal" else "available_bytes"] = int(m[2]) * 1024
    limit = _read("/sys/fs/cgroup/memory.max").strip() or _read("/sys/fs/cgroup/memory/memory.limit_in_bytes").strip()
    if limit.isdigit() and int(limit) < (1 << 60):
        info["cgroup_limit_bytes"] = int(limit)
        if info["available_bytes"] is not None:
            used = _read("/sys/fs/cgroup/memory.current").strip()
            if used.isdigit():
                info["available_bytes"] = min(info["available_bytes"], int(limit) - int(used))
    return info


def _blas() -> dict[str, Any]:
    import numpy as np

    try:
        deps = np.show_config(mode="dicts").get("Build Dependencies", {})
        blas = deps.get("blas", {})
        config = str(blas.get("openblas configuration", "")).strip() or None
        return {"name": blas.get("name"), "version": blas.get("version"), "config": config}
    except Exception as exc:  # older numpy: no dicts mode
        return {"name": None, "version": None, "error": type(exc).__name__}


def _kernel_tier() -> dict[str, Any]:
    info: dict[str, Any] = {"tier": "cpu", "tiers": None, "numba_target": None, "threading_layer": None, "threads": None}
    try:
        import llvmlite.binding as llvm
        import numba

        from engine.kernels.kernel_cache import active_directory
        from engine.kernels.cpu.selftest import TIERS, report

        info["tiers"] = list(TIERS)
        info["cache"] = _unpersonal(active_directory()) or "beside the kernel sources (numba's default)"
        info["numba_target"] = llvm.get_host_cpu_name()
        info["threads"] = numba.get_num_threads()
        try:
            info["threading_layer"] = numba.threading_layer()  # known once a parallel kernel has run
        except ValueError:
            info["threading_layer"] = f"{numba.config.THREADING_LAYER} (not started)"
        stepped = report()["stepped_down"]
        if stepped:
            info["tier"] = "cpu (stepped down to " + ", ".join(f"{t}: {tier}" for t, tier in stepped.items()) + ")"
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


def _unpersonal(path) -> str | None:
    """A path as a bug report may show it: the home directory (a user name) as ~."""
    if path is None:
        return None
    home = Path.home()
    return "~/" + str(Path(path).relative_to(home)) if Path(path).is_relative_to(home) else str(path)


NO_CUDA_BACKEND = "no CUDA backend yet (goinfer runs on the CPU, or a GPU through WebGPU)"


def gpu_backends(selftest: bool = False, *, software_selftest: bool = False, say=None) -> dict[str, dict[str, Any]]:
    """Each GPU backend: importable and its device, or why not (never raises). selftest: the WebGPU self-test
    (engine/loading/gpu_selftest.py), with its figures, on the best real GPU adapter; on a software one (which
    only `--backend webgpu` takes, and which takes 5-60 s) only with software_selftest, else the entry says why
    it was skipped. say(line): a progress line before a self-test starts. CUDA: the device cupy sees, if any,
    but no backend uses it yet (available is False)."""
    return {"cuda": _library("cupy", None, "no usable CUDA device", _cuda),
            "webgpu": _library("wgpu", "webgpu", "no WebGPU adapter",
                               lambda wgpu: _webgpu(selftest, software_selftest, say))}


def _library(name: str, extra: str | None, unusable: str, probe) -> dict[str, Any]:
    """A GPU library's entry: probe(module)'s findings, or why it cannot be used (not installed, failed to import,
    no device). extra: the goinfer extra that installs it (None: no backend uses it yet, so none to advise)."""
    import importlib

    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        if extra is None:
            return {"available": False, "reason": f"{NO_CUDA_BACKEND}; {name} is not installed"}
        return {"available": False, "reason": f"{name} is not installed (pip install 'goinfer[{extra}]'): {exc}"}
    except Exception as exc:
        return {"available": False, "reason": f"importing {name} failed: {type(exc).__name__}: {str(exc)[:200]}"}
    package = f"{name} {module.__version__}"
    try:
        found = probe(module)
    except Exception as exc:
        why = f"{unusable}: {type(exc).__name__}: {str(exc)[:200]}"
        return {"available": False, "package": package, "reason": why}
    return {"available": found.pop("available"), "package": package, **found}


def _cuda(cupy) -> dict[str, Any]:
    n = cupy.cuda.runtime.getDeviceCount()
    props = cupy.cuda.runtime.getDeviceProperties(0) if n else {}
    name = props.get("name", b"")
    # the device is reported (a bug report may want it), but nothing runs on it: not available to goinfer
    out = {"available": False, "devices": n, "memory_bytes": props.get("totalGlobalMem"),
           "device": name.decode() if isinstance(name, bytes) else str(name) or None, "reason": NO_CUDA_BACKEND}
    if not n:
        out["reason"] += "; cupy imports but sees no CUDA device"
    return out


def _webgpu(selftest: bool, software_selftest: bool = False, say=None) -> dict[str, Any]:
    from engine.kernels.webgpu.device import adapters, pick

    found = adapters()
    auto = pick(found, "auto")
    out = {"available": bool(found), "adapters": [a.report() for a in found],
           "auto": auto.name if auto is not None else None}
    if not found:
        out["reason"] = "wgpu imports but sees no adapter"
    elif auto is None:
        out["reason"] = "only software adapters, which auto never takes"
    if found and selftest:
        from engine.loading.placement import webgpu_selftest

        adapter = pick(found, "webgpu" if software_selftest else "auto")
        if adapter is None:  # software adapters only: slow (a CPU emulating a GPU), and auto never takes them
            best = pick(found, "webgpu")
            out["selftest"] = {"backend": "webgpu", "adapter": best.name, "status": "skipped",
                               "reason": "a software adapter, which auto never takes; --webgpu-selftest runs it"}
        else:
            if say is not None:
                say(f"self-test: WebGPU on {adapter.name} ...")
            out["selftest"] = webgpu_selftest(adapter)
    return out


def fit_report(ref: str, context: int | None = None, *, progress=None) -> dict[str, Any]:
    """Memory a model needs (weights + the default path's f16 KV cache at `context` + working buffers) against
    what is free."""
    from engine.formats.gguf import open_gguf
    from engine.models.hf_checkpoint import is_hf_checkpoint, loaded_bytes, read_metadata
    from engine.models.registry import config_from_gguf
    from engine.sessions.pool import default_budget_bytes
    from engine.store import resolve_model_ref

    path = resolve_model_ref(ref, progress=progress)
    if is_hf_checkpoint(path):  # sized as loaded on the default path: Q8_0 matrices (models/hf_checkpoint.py)
        meta = read_metadata(path)[2]
        config = config_from_gguf(meta, int(meta[f"{meta['general.architecture']}.vocab_size"]))
        weights = loaded_bytes(path, quantize=True)
    else:
        gguf = open_gguf(path)
        meta = gguf.metadata
        tokens = meta.get("tokenizer.ggml.tokens")
        config = config_from_gguf(meta, len(tokens) if tokens is not None
                                  else int(meta.get(f"{gguf.architecture}.vocab_size", 0)))
        weights = sum(e.nbytes or 0 for e in gguf.entries.values())
    ctx = int(context or config.context_length)
    # K and V of the attention layers in the default path's f16 cache (2 bytes a value; `--quant f32` doubles it)
    kv = 2 * len(config.kv_layers) * ctx * config.n_head_kv * config.head_dim * 2
    # Working set: a 512-token prompt chunk's activations and scores, the dequantize scratch (<= 64 MB),
    # the vocabulary-sized logits: an estimate, stated as such.
    chunk = min(ctx, 512)
    work = (chunk * max(config.n_ff, config.n_embd) * 4 * 4 + config.n_head * chunk * ctx * 4
            + min(config.vocab_size * config.n_embd, 1 << 24) * 4 + config.vocab_size * 4 * 2)
    need = weights + kv + work
    mem = memory_info()
    free = mem["available_bytes"]
    # Warm sessions (`goinfer serve --kv-sessions`, engine/sessions/pool.py): the default budget of their KV memory,
    # and what it holds in positions of the default path's f16 cache (a recurrent layer's state aside).
    budget = default_budget_bytes(free)
    per_token = 2 * len(config.kv_layers) * config.n_head_kv * config.head_dim * 2
    return {"model": ref if ref and not Path(str(ref)).expanduser().exists() else Path(path).name,
            "architecture": config.arch, "context": ctx, "weights_bytes": weights, "kv_cache_bytes": kv,
            "working_bytes_estimate": work, "total_bytes": need, "available_bytes": free,
            "fits": None if free is None else need <= free,
            "session_budget_bytes": budget, "session_kv_bytes_per_token": per_token,
            "session_budget_tokens": budget // per_token if per_token else None}


def supported_models() -> dict[str, Any]:
    """What loads: the file formats and the architectures (from the family registry)."""
    from engine.models.registry import FAMILIES

    return {"formats": ["gguf", "safetensors"],
            "architectures": [{"architecture": arch, "family": f.name, "paths": ["fast", "exact"],
                               "decode_step": f.step_flags is not None,
                               "formats": ["gguf"] + (["safetensors"] if f.hf_keys is not None else []),
                               "hf_model_types": list(f.hf_model_types) if f.hf_keys is not None else []}
                              for arch, f in FAMILIES.items()]}


def hardware_report(*, selftest: bool = True, fit: str | None = None, context: int | None = None,
                    progress=None, software_selftest: bool = False, say=None) -> dict[str, Any]:
    """The report. selftest: the CPU kernels' self-test and the WebGPU one (software_selftest: on a software
    adapter too; gpu_backends); say(line): a progress line before each self-test starts (they take seconds)."""
    import numpy as np

    from engine.kernels.cpu import selftest as st

    if selftest:
        if say is not None:
            say("self-test: CPU kernels ...")
        st.run_selftest(warn=lambda line: None)  # failures are in the report itself
    else:
        st.mark_skipped()
    report: dict[str, Any] = {
        "goinfer": _version("goinfer"),
        "os": {"system": platform.system(), "kernel": platform.release(), "machine": platform.machine(),
               "libc": " ".join(platform.libc_ver()).strip() or None},
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation()},
        "numpy": {"version": np.__version__, "blas": _blas()},
        "numba": _version("numba"),
        "llvmlite": _version("llvmlite"),
        "cpu": cpu_info(),
        "kernels": _kernel_tier(),
        "memory": memory_info(),
        "gpu": gpu_backends(selftest, software_selftest=software_selftest, say=say),
        "selftest": st.report(),
        "models": supported_models(),
    }
    if fit is not None:
        report["fit"] = fit_report(fit, context, progress=progress)
    return report
