"""Work shared by the threads of one parallel region: atomic counters numba code can call.

A decode step is ~150 short pieces of work (SmolLM2: 30 layers x 4 matvecs + attention, each only tens of
microseconds). As one parallel loop each, every piece paid numba's fork/join and the imbalance of its static
schedule, a sizeable overhead on pieces that short (docs/benchmarks.md, "Measurements behind the code", decode
step pieces). The compiled decode step (models/decode_step.py) instead runs one parallel region in which
every thread walks the same list of phases: in a phase each thread claims task after task from the phase's
counter (`claim`), reports each one done (`finish`), and waits until the phase's tasks are all done
(`wait_done`, `next_phase`) before the next phase reads their results.

Nothing here can deadlock: a thread only waits for tasks that another thread has claimed and is running, never
for a thread to arrive. If the region gets fewer threads than workers, the first runs every task and the others
find nothing left.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
SLOT = 8  # int64s between two counters: each on its own 64-byte line (claims and completions do not collide)


@intrinsic
def _fetch_add(typingctx, arr, idx, val):
    """arr[idx] += val atomically (sequentially consistent); returns the old value. arr: int64 array."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None
    sig = types.int64(arr, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0], ary, [args[1]])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return sig, codegen


@intrinsic
def _load_acquire(typingctx, arr, idx):
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None
    sig = types.int64(arr, types.intp)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0], ary, [args[1]])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def _spin_pause(typingctx):
    """The x86 `pause` hint inside a spin loop (a no-op elsewhere)."""
    sig = types.none()

    def codegen(context, builder, signature, args):
        if _X86:
            fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def claim(ctr, phase):
    """The next unclaimed task index of phase (0, 1, ...; past the phase's task count when none is left)."""
    return _fetch_add(ctr, 2 * SLOT * phase, 1)


@njit(cache=True)
def finish(ctr, phase):
    """One task of phase is done (its writes are visible to whoever sees the count)."""
    _fetch_add(ctr, 2 * SLOT * phase + SLOT, 1)


@njit(cache=True)
def wait_done(ctr, phase, n_tasks):
    while _load_acquire(ctr, 2 * SLOT * phase + SLOT) < n_tasks:
        _spin_pause()


@njit(cache=True)
def next_phase(ctr, phase, n_tasks):
    """Wait until phase's n_tasks tasks are done; the next phase's number."""
    wait_done(ctr, phase, n_tasks)
    return phase + 1


@njit(cache=True)
def counters(n_phases):
    """Zeroed counters for phases 0 .. n_phases - 1 (a claim and a done count each)."""
    return np.zeros(2 * SLOT * n_phases, np.int64)
