"""One wgpu device and the ways the forward pass uses it: buffers, the ops' pipelines (shaders.py), and a `Plan`:
every dispatch of a forward pass in one compute pass of one command encoder, submitted once, with one read back
at the end (no host round-trip per layer or per op), recorded once and replayed by decode steps.

Bindings are whole buffers; sizes and offsets go in a small uniform per dispatch (`params`: ints as u32, floats
as f32, in the shader's field order).
"""

from __future__ import annotations

import numpy as np

from engine.kernels.webgpu import shaders
from engine.kernels.webgpu.matvec import WebGPUMatmul

_MAX_GROUPS = 65535


def params(*values) -> np.ndarray:
    """A shader's uniform: ints as u32, floats as f32 (bit patterns in u32 words), padded to 16 bytes."""
    words = np.zeros(-(-len(values) // 4) * 4, np.uint32)
    for i, v in enumerate(values):
        words[i] = np.array(v, np.float32).view(np.uint32) if isinstance(v, float) else np.uint32(v)
    return words


class Gpu:
    """A device with its ops' pipelines and the matrix kernels (matvec.py)."""

    def __init__(self, device, max_binding_bytes: int, features: tuple[str, ...] = ()):
        import wgpu

        self.device, self.usage = device, wgpu.BufferUsage
        self.kv_f16 = "shader-f16" in features  # the KV cache in f16 (shaders.py)
        self.matrices = WebGPUMatmul(device, max_binding_bytes, subgroups="subgroup" in features)
        self._pipelines: dict[str, object] = {}

    def pipeline(self, name: str):
        if name not in self._pipelines:
            module = self.device.create_shader_module(code=shaders.source(name, self.kv_f16))
            self._pipelines[name] = self.device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": "main"})
        return self._pipelines[name]

    def buffer(self, nbytes: int):
        """A zeroed f32 storage buffer the ops read and write and the host reads back or copies."""
        u = self.usage
        return self.device.create_buffer(size=max(16, -(-nbytes // 16) * 16),
                                         usage=u.STORAGE | u.COPY_SRC | u.COPY_DST)

    def upload(self, array: np.ndarray):
        """A storage buffer holding array's bytes (f32 activations, norm weights, RoPE tables)."""
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        padded = np.zeros(max(16, -(-data.nbytes // 16) * 16), np.uint8)
        padded[: data.nbytes] = data
        u = self.usage
        return self.device.create_buffer_with_data(data=padded, usage=u.STORAGE | u.COPY_SRC | u.COPY_DST)

    def write(self, buf, array: np.ndarray, offset: int = 0) -> None:
        self.device.queue.write_buffer(buf, offset, np.ascontiguousarray(array))

    def read(self, buf, count: int, dtype=np.float32) -> np.ndarray:
        """The first count elements of buf as f32 (waits for the work submitted before)."""
        size = np.dtype(dtype).itemsize
        data = np.frombuffer(self.device.queue.read_buffer(buf, 0, -(-count * size // 4) * 4), dtype)
        return data[:count].astype(np.float32)

    def copy(self, src, dst, nbytes: int, src_offset: int = 0, dst_offset: int = 0) -> None:
        """dst[dst_offset:] = src[src_offset:] on the device (a cache's growth and fork)."""
        encoder = self.device.create_command_encoder()
        encoder.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, nbytes)
        self.device.queue.submit([encoder.finish()])


class Plan:
    """A forward pass's dispatches, recorded once (bind groups and uniforms made here) and run as one compute pass
    of one command encoder per `run`. What changes from one run to the next (the input rows, the RoPE tables, where
    each sequence starts) is written into the buffers the plan binds, so a decode step replays its plan: per token
    the host only encodes the recorded dispatches and writes a few bytes."""

    def __init__(self, gpu: Gpu):
        self.gpu = gpu
        self._commands: list[tuple[object, object, tuple[int, int]]] = []

    def dispatch(self, name: str, buffers: list, uniform: np.ndarray, groups: tuple[int, int]) -> None:
        """Op `name` over its buffers (in binding order, the uniform last) in groups (x, y) workgroups."""
        gpu = self.gpu
        pipeline = gpu.pipeline(name)
        ubuf = gpu.device.create_buffer_with_data(data=uniform, usage=gpu.usage.UNIFORM)
        group = gpu.device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[
            {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
            for i, b in enumerate([*buffers, ubuf])])
        self._commands.append((pipeline, group, groups))

    def elementwise(self, name: str, buffers: list, uniform: np.ndarray, count: int) -> None:
        """An op with one invocation per element (count of them), in 64-wide workgroups spread over two
        dimensions when one's 65,535 is too few."""
        groups = -(-count // 64)
        x = min(groups, _MAX_GROUPS)
        self.dispatch(name, buffers, uniform, (x, -(-groups // x)))

    def matmul(self, xbuf, ybuf, tokens: int, w) -> None:
        self._commands += self.gpu.matrices.commands(xbuf, ybuf, tokens, w)

    def run(self) -> None:
        """Submit every recorded dispatch, in order, as one compute pass (WebGPU orders a pass's dispatches and
        makes each see the writes of those before it)."""
        encoder = self.gpu.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        for pipeline, group, groups in self._commands:
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, group)
            compute.dispatch_workgroups(groups[0], groups[1], 1)
        compute.end()
        self.gpu.device.queue.submit([encoder.finish()])
