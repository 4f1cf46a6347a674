"""GGML tensor types: their block geometry, the ones we compute with, and the quantized-tensor handle the kernels
consume.

Lives with the kernels (not in engine.formats) because the kernels are the lowest layer and need the
block geometry; the GGUF reader imports it from here.
"""

from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39  # gpt-oss's expert matrices (GGUF MXFP4_MOE files)


# type -> (weights per block, bytes per block)
BLOCK_GEOMETRY: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q4_K: (256, 2 + 2 + 12 + 128),
    GGMLType.Q5_K: (256, 2 + 2 + 12 + 32 + 128),
    GGMLType.Q6_K: (256, 128 + 64 + 16 + 2),
    GGMLType.MXFP4: (32, 1 + 16),
    GGMLType.Q2_K: (256, 16 + 64 + 2 + 2),
    GGMLType.Q3_K: (256, 32 + 64 + 12 + 2),
    GGMLType.IQ4_NL: (32, 2 + 16),
    GGMLType.IQ4_XS: (256, 2 + 2 + 4 + 128),
    GGMLType.TQ1_0: (256, 48 + 4 + 2),
    GGMLType.TQ2_0: (256, 64 + 2),
    # the lattice types (Tensor types II)
    GGMLType.IQ2_XXS: (256, 2 + 64),
    GGMLType.IQ2_XS: (256, 2 + 64 + 8),
    GGMLType.IQ2_S: (256, 2 + 32 + 32 + 8 + 8),
    GGMLType.IQ3_XXS: (256, 2 + 64 + 32),
    GGMLType.IQ3_S: (256, 2 + 64 + 8 + 32 + 4),
    GGMLType.IQ1_S: (256, 2 + 32 + 16),
    GGMLType.IQ1_M: (256, 32 + 16 + 8),
}

# The types of the compiled decode step's shared runtime dispatch (int8.rows_into, dequant.dequant_row): every
# model's step compiles all of them, once per machine.
STEP_TYPES: frozenset[GGMLType] = frozenset({
    GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
    GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4,
})

# The lattice types (Tensor types II): llama.cpp's grid codebooks (reference_lattice.py, cpu/dequant_lattice.py,
# cpu/lattice.py). Low-bit types too (below); most of their files need an importance matrix to make.
LATTICE_TYPES: frozenset[GGMLType] = frozenset({
    GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ1_S,
    GGMLType.IQ1_M,
})

# The low-bit types (Tensor types I and II): their kernels compile per type on demand (exact.py's and int8.py's
# per-type closures) and stay out of the step's dispatch, so a model without them never compiles them; a model
# holding one runs a decode step compiled with its low-bit types added (cpu/step_variants.py).
LOWBIT_TYPES: frozenset[GGMLType] = frozenset({
    GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.TQ1_0, GGMLType.TQ2_0,
}) | LATTICE_TYPES

# The types every kernel computes with: the loader refuses a file holding any other (GGUFFile.check_tensor_types),
# the CPU kernels refuse the rest, the self-test covers these.
COMPUTE_TYPES: frozenset[GGMLType] = STEP_TYPES | LOWBIT_TYPES

# Every type id ggml defines, so an unsupported one can be named in the error message.
GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 4: "Q4_2", 5: "Q4_3", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
    9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}


def type_name(type_id: int) -> str:
    return GGML_TYPE_NAMES.get(int(type_id), f"type {int(type_id)}")


def row_bytes(ggml_type: GGMLType, n_cols: int) -> int:
    """Bytes one row of n_cols weights occupies; n_cols must be a multiple of the block size."""
    block, size = BLOCK_GEOMETRY[ggml_type]
    return (n_cols // block) * size


@dataclass(frozen=True)
class QTensor:
    """A weight matrix kept in its stored GGUF blocks (usually a view of the memory-mapped file).

    shape is numpy order (rows, cols): rows = output features, cols = input features, so a linear
    layer computes x @ W.T. raw is uint8 (rows, row_bytes), never copied.
    """

    name: str
    ggml_type: GGMLType
    shape: tuple[int, int]
    raw: np.ndarray  # (rows, row_bytes) uint8
    # The leading whole groups of 8 rows in the row-interleaved layout of kernels/cpu/packed.py (fast path only):
    # when set, kernels read those rows from here and never from raw.
    packed: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes
