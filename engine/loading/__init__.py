"""A model put on this machine: a reference -> a ready Model, cheap checks first (load.py), where it runs
(placement.py: --backend cpu|webgpu|auto; gpu_selftest.py, the WebGPU self-test that decides it), compiling its
kernels ahead (precompile.py: goinfer cache warm, the decode step's background compile), and the machine's report
(hardware.py: check --hardware, and whether a model fits)."""
