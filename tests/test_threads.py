"""--threads / engine.set_threads: one setting for numba's parallel loops and the BLAS behind numpy."""

import subprocess
import sys
import textwrap


def test_set_threads_limits_numba_and_blas():
    code = textwrap.dedent("""
        import engine, numba
        from threadpoolctl import threadpool_info
        assert engine.set_threads(1) == 1
        blas = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
        print(numba.get_num_threads(), blas)
        try:
            engine.set_threads(0)
        except ValueError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()[:2]
    assert first.startswith("1 [1")  # numba 1 thread, every BLAS pool 1 thread
    assert second.startswith("refused: threads must be >= 1")


def test_threading_layer_is_openmp():
    code = textwrap.dedent("""
        import engine
        import numba, numpy as np
        from numba import njit, prange

        @njit(parallel=True)
        def f(a):
            for i in prange(a.size):
                a[i] += 1
        f(np.zeros(100))
        print(numba.threading_layer())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "omp"
