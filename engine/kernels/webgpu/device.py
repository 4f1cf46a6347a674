"""WebGPU adapters through wgpu-py: which there are, which `--backend auto` may take, and a device on one.

    adapters()              every adapter wgpu sees, as AdapterInfo (name, type, backend, limits, features)
    pick(adapters, name)    "webgpu": the best adapter, software ones included (tests run on Mesa's lavapipe);
                            "auto": a real GPU only (a software adapter is far slower than numpy; docs/benchmarks.md,
                            "Measurements behind the code", WebGPU software adapters), else None
    open_device(info)       a wgpu device with the adapter's own limits (the 128 MiB binding limit of lavapipe
                            is the adapter's; asking for more fails) and the features goinfer uses

Software adapters (lavapipe, llvmpipe, WARP, SwiftShader) are the ones wgpu reports with adapter_type "CPU".
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

__all__ = ["AdapterInfo", "WebGPUUnavailable", "adapters", "open_device", "pick"]

_FEATURES = ("shader-f16", "subgroup")  # used where the adapter has them
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 0, "OpenGL": 2}  # GL lacks f16 and subgroups on every adapter
_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3, "Unknown": 4}


class WebGPUUnavailable(RuntimeError):
    """No usable WebGPU adapter (the message says why: no wgpu package, no adapter, only software ones)."""


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    adapter_type: str  # DiscreteGPU | IntegratedGPU | VirtualGPU | CPU | Unknown
    backend: str  # Vulkan | Metal | D3D12 | OpenGL
    max_binding_bytes: int  # max_storage_buffer_binding_size: tensors over it are split across bindings
    max_buffer_bytes: int
    features: tuple[str, ...]  # of _FEATURES, those the adapter has
    adapter: object = field(default=None, compare=False, repr=False)

    @property
    def software(self) -> bool:
        return self.adapter_type == "CPU"

    def report(self) -> dict:
        """What check --hardware, /health and /v1/models say of it."""
        return {"adapter": self.name, "adapter_type": self.adapter_type, "backend": self.backend,
                "software": self.software, "max_binding_bytes": self.max_binding_bytes,
                "max_buffer_bytes": self.max_buffer_bytes, "features": list(self.features)}


def _quiet_runtime_dir() -> None:
    """Mesa's lavapipe prints "XDG_RUNTIME_DIR is invalid or not set" on every process without one."""
    if not os.environ.get("XDG_RUNTIME_DIR"):
        path = os.path.join(tempfile.gettempdir(), f"goinfer-xdg-{os.getuid()}")
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = path


def adapters() -> list[AdapterInfo]:
    """Every adapter wgpu enumerates, best first (real GPUs, then by backend); WebGPUUnavailable without wgpu."""
    try:
        import wgpu
    except ImportError as e:
        raise WebGPUUnavailable(f"the wgpu package is not installed (pip install 'goinfer[webgpu]'): {e}") from None
    _quiet_runtime_dir()
    found = []
    for a in wgpu.gpu.enumerate_adapters_sync():
        info, limits = dict(a.info), dict(a.limits)
        found.append(AdapterInfo(
            name=str(info.get("device") or info.get("description") or "unknown"),
            adapter_type=str(info.get("adapter_type") or "Unknown"), backend=str(info.get("backend_type") or "?"),
            max_binding_bytes=int(limits.get("max-storage-buffer-binding-size", 0)),
            max_buffer_bytes=int(limits.get("max-buffer-size", 0)),
            features=tuple(f for f in _FEATURES if f in a.features), adapter=a))
    found.sort(key=lambda i: (_TYPE_RANK.get(i.adapter_type, 4), _BACKEND_RANK.get(i.backend, 1), -len(i.features)))
    return found


def pick(found: list[AdapterInfo], backend: str) -> AdapterInfo | None:
    """The adapter `--backend` takes: "webgpu" the best of all (software included, for tests and for a user who
    asks), "auto" the best real GPU or None (a software adapter is never chosen by auto)."""
    if backend == "webgpu":
        return found[0] if found else None
    if backend == "auto":
        return next((a for a in found if not a.software), None)
    raise ValueError(f"unknown backend {backend!r}")


def open_device(info: AdapterInfo):
    """A device on the adapter, with its own limits for buffers and bindings and the features goinfer uses."""
    limits = {"max-storage-buffer-binding-size": info.max_binding_bytes, "max-buffer-size": info.max_buffer_bytes}
    return info.adapter.request_device_sync(required_features=list(info.features), required_limits=limits)
