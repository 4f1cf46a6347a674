"""The WebGPU backend (issue 26), through wgpu-py: Vulkan, Metal and D3D12 from one set of WGSL kernels, tested on
Mesa's lavapipe (a software Vulkan adapter). device.py finds adapters and opens a device; matvec.py and shaders.py
are the WGSL; program.py records a pass; kv_cache.py keeps a sequence on the device; resident.py is the backend a
dense model runs on. engine/loading/placement.py decides where a model goes (through engine/kernels/registry.py),
engine/loading/gpu_selftest.py checks the adapter."""
