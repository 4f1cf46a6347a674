"""The compiled decode step for a model with low-bit tensors (quant_types.LOWBIT_TYPES): the shared step compiled
once more, with its model's low-bit types added to the step's two run-time type dispatches (int8.rows_into for the
matvecs, dequant.dequant_row for embedding rows), as rows_with and row_with below give them.

Why a second compile: numba compiles every branch of a run-time dispatch into every function that reaches it, and
the shared step (decode_step.py) serves every model; with the six low-bit types in its dispatch every model would
compile their kernels. Why not pass the dispatch in as an argument: numba's on-disk cache cannot key a function on
a jitted function it is given (it misses in every new process, a minute's compile per run).

How: `variant` copies a jitted function's Python function with its globals rebound (a swapped dispatcher, and a
module whose functions it calls replaced by a copy with those functions swapped), recursively for every jitted
function it reaches that reaches a swapped one; everything else (attention, norms, the base kernels) is shared
with the step as compiled for every model. Each copy gets a name of its own (`decode_step__lowbit_11`), so numba's
cache keeps it beside the shared one, once per install and set of low-bit types; the background compile
(step_compile.py) covers a variant as it covers the shared step.
"""

from __future__ import annotations

import functools
import types

from numba import njit
from numba.core.caching import NullCache
from numba.core.dispatcher import Dispatcher

from engine.kernels.cpu import dequant, int8
from engine.kernels.cpu.decode_step import decode_step
from engine.kernels.cpu.dequant_lowbit import dequant_any_row


@functools.cache
def step_for(codes: tuple[int, ...]) -> Dispatcher:
    """The decode step that runs the low-bit types `codes` (sorted) besides the shared step's types."""
    if not codes:
        return decode_step
    swaps = {int8.rows_into: rows_with(codes), dequant.dequant_row: row_with(codes)}
    return variant(decode_step, swaps, "lowbit_" + "_".join(str(c) for c in codes))


SLOTS = 6  # the low-bit types a variant adds (a model holding more decodes layer by layer: step_tables.py)
_NO_CODE = -1  # an empty slot
# (globals, not closure cells: numba's cache keys a closure by pickling its cells, and a jitted function pickles
# differently in every process)
_rows_of_code = int8.rows_of_code
_row_of_code = njit(inline="always")(dequant_any_row)


@functools.cache
def rows_with(codes: tuple[int, ...]):
    """int8.rows_into's dispatch with the low-bit types `codes` (sorted, at most six) added. Each slot a closure
    cell, so numba prunes the empty ones and inlines one low-bit kernel per slot (int8.rows_of_code with a
    constant code): a variant compiles its model's low-bit types only, and numba's cache keys it by the codes."""
    k0, k1, k2, k3, k4, k5 = (tuple(codes) + (_NO_CODE,) * SLOTS)[:SLOTS]

    @njit(cache=True)
    def rows(code, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier):
        if k0 != _NO_CODE and code == k0:
            _rows_of_code(k0, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier)
        elif k1 != _NO_CODE and code == k1:
            _rows_of_code(k1, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier)
        elif k2 != _NO_CODE and code == k2:
            _rows_of_code(k2, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier)
        elif k3 != _NO_CODE and code == k3:
            _rows_of_code(k3, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier)
        elif k4 != _NO_CODE and code == k4:
            _rows_of_code(k4, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier)
        elif k5 != _NO_CODE and code == k5:
            _rows_of_code(k5, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier)
        else:
            int8.rows_into(code, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier)

    return rows


@functools.cache
def row_with(codes: tuple[int, ...]):
    """dequant.dequant_row's dispatch with the low-bit types `codes` added, as rows_with adds them to the
    matvec's: the variant reads its embedding rows here."""
    k0, k1, k2, k3, k4, k5 = (tuple(codes) + (_NO_CODE,) * SLOTS)[:SLOTS]

    @njit(cache=True)
    def row(src, code, dst):
        if k0 != _NO_CODE and code == k0:
            _row_of_code(src, k0, dst)
        elif k1 != _NO_CODE and code == k1:
            _row_of_code(src, k1, dst)
        elif k2 != _NO_CODE and code == k2:
            _row_of_code(src, k2, dst)
        elif k3 != _NO_CODE and code == k3:
            _row_of_code(src, k3, dst)
        elif k4 != _NO_CODE and code == k4:
            _row_of_code(src, k4, dst)
        elif k5 != _NO_CODE and code == k5:
            _row_of_code(src, k5, dst)
        else:
            dequant.dequant_row(src, code, dst)

    return row


def variant(fn: Dispatcher, swaps: dict, tag: str) -> Dispatcher:
    """fn with every call that reaches a dispatcher in `swaps` (directly or through the functions it calls) going to
    its swap instead; fn itself where nothing does."""
    return _Rebinder({id(k): v for k, v in swaps.items()}, tag).dispatcher(fn)


def _global_names(code: types.CodeType) -> set[str]:
    """The names a function's code (and the code nested in it) reads as globals or attributes."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


class _Rebinder:
    def __init__(self, swaps: dict[int, Dispatcher], tag: str):
        self._swaps, self._tag = swaps, tag
        self._done: dict[int, Dispatcher] = {}

    def dispatcher(self, d: Dispatcher) -> Dispatcher:
        if id(d) in self._swaps:
            return self._swaps[id(d)]
        if id(d) not in self._done:
            self._done[id(d)] = d  # (jitted code does not recurse; this only stops a walk that would)
            self._done[id(d)] = self._copy(d)
        return self._done[id(d)]

    def _copy(self, d: Dispatcher) -> Dispatcher:
        py = d.py_func
        names = _global_names(py.__code__)
        rebound = {}
        for name in names & py.__globals__.keys():
            value = py.__globals__[name]
            new = self._value(value, names)
            if new is not value:
                rebound[name] = new
        for cell in py.__closure__ or ():
            held = cell.cell_contents
            if isinstance(held, Dispatcher) and self.dispatcher(held) is not held:
                raise NotImplementedError(f"{py.__qualname__} reaches a swapped kernel through a closure")
        if not rebound:
            return d
        fn = types.FunctionType(py.__code__, {**py.__globals__, **rebound}, py.__name__, py.__defaults__,
                                py.__closure__)
        fn.__qualname__ = f"{py.__qualname__}__{self._tag}"  # numba's cache files are named by it
        fn.__module__, fn.__doc__ = py.__module__, py.__doc__
        options = {k: v for k, v in d.targetoptions.items() if k != "nopython"}  # (njit sets it)
        return njit(cache=not isinstance(d._cache, NullCache), **options)(fn)

    def _value(self, value, names: set[str]):
        if isinstance(value, Dispatcher):
            return self.dispatcher(value)
        if isinstance(value, types.ModuleType) and value.__name__.startswith("engine."):
            changed = {}
            for name in names:  # the module's functions this code may call (module.name)
                f = getattr(value, name, None)
                if isinstance(f, Dispatcher) and self.dispatcher(f) is not f:
                    changed[name] = self.dispatcher(f)
            if changed:
                module = types.ModuleType(value.__name__, value.__doc__)
                module.__dict__.update({**vars(value), **changed})
                return module
        return value
