"""The WebGPU backend (issue 26), through wgpu-py: Vulkan, Metal and D3D12 from one set of WGSL kernels, tested on
Mesa's lavapipe (a software Vulkan adapter). So far: adapter discovery (device.py) and the matrix kernels over GGUF
blocks as stored (matvec.py), each checked against the numpy reference; the model path comes next."""
