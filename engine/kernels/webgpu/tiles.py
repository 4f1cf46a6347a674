"""The prompt matrix kernel for block types: each 32-weight unit of a row decoded once, for a tile of 8 tokens.

An invocation per (row, tile of 8 tokens): for every unit of its row (a legacy block, or an eighth of a K-quant
super-block) it decodes the 32 weights into registers once, then takes them against the tile's 8 tokens, keeping
8 sums. matvec.py's per-token walk decoded every block once per token; here the decoding is an eighth of that.
Each type's `unit(base, u)` returns weights 32u..32u+31 of the row whose bytes start at `base`, with the same
formulas as matvec.py's bodies (and engine/kernels/reference.py). Float types keep matvec.py's walk.
"""

from __future__ import annotations

from engine.kernels.quant_types import GGMLType

_UNITS = {
    GGMLType.Q8_0: """
fn unit(base: u32, u: u32) -> array<f32, 32> {
    let o = base + u * 34u;
    let d = half_at(o);
    var w: array<f32, 32>;
    for (var i = 0u; i < 32u; i = i + 1u) { w[i] = d * f32(sbyte(o + 2u + i)); }
    return w;
}
""",
    GGMLType.Q4_0: """
fn unit(base: u32, u: u32) -> array<f32, 32> {
    let o = base + u * 18u;
    let d = half_at(o);
    var w: array<f32, 32>;
    for (var i = 0u; i < 16u; i = i + 1u) {
        let q = byte_at(o + 2u + i);
        w[i] = d * (f32(q & 15u) - 8.0);
        w[i + 16u] = d * (f32(q >> 4u) - 8.0);
    }
    return w;
}
""",
    GGMLType.Q4_1: """
fn unit(base: u32, u: u32) -> array<f32, 32> {
    let o = base + u * 20u;
    let d = half_at(o);
    let m = half_at(o + 2u);
    var w: array<f32, 32>;
    for (var i = 0u; i < 16u; i = i + 1u) {
        let q = byte_at(o + 4u + i);
        w[i] = d * f32(q & 15u) + m;
        w[i + 16u] = d * f32(q >> 4u) + m;
    }
    return w;
}
""",
    GGMLType.Q5_0: """
fn unit(base: u32, u: u32) -> array<f32, 32> {
    let o = base + u * 22u;
    let d = half_at(o);
    let qh = word_at(o + 2u);
    var w: array<f32, 32>;
    for (var i = 0u; i < 16u; i = i + 1u) {
        let q = byte_at(o + 6u + i);
        w[i] = d * (f32((q & 15u) | (((qh >> i) & 1u) << 4u)) - 16.0);
        w[i + 16u] = d * (f32((q >> 4u) | (((qh >> (i + 16u)) & 1u) << 4u)) - 16.0);
    }
    return w;
}
""",
    GGMLType.Q5_1: """
fn unit(base: u32, u: u32) -> array<f32, 32> {
    let o = base + u * 24u;
    let d = half_at(o);
    let m = half_at(o + 2u);
    let qh = word_at(o + 4u);
    var w: array<f32, 32>;
    for (var i = 0u; i < 16u; i = i + 1u) {
        let q = byte_at(o + 8u + i);
        w[i] = d * f32((q & 15u) | (((qh >> i) & 1u) << 4u)) + m;
        w[i + 16u] = d * f32((q >> 4u) | (((qh >> (i + 16u)) & 1u) << 4u)) + m;
    }
    return w;
}
""",
    # quarter k of half n (j = 4n + k): the low (k < 2) or high nibbles of ql[64n + 32 (k % 2) + l], bits 2k, 2k + 1
    # of qh[32n + l] on top, minus 32; a scale per 16 weights
    GGMLType.Q6_K: """
fn unit(base: u32, u: u32) -> array<f32, 32> {
    let o = base + (u / 8u) * 210u;
    let j = u % 8u;
    let n = j / 4u;
    let k = j % 4u;
    let d = half_at(o + 208u);
    let shift = 4u * (k / 2u);
    var w: array<f32, 32>;
    for (var l = 0u; l < 32u; l = l + 1u) {
        let low = (byte_at(o + 64u * n + 32u * (k % 2u) + l) >> shift) & 15u;
        let high = (byte_at(o + 128u + 32u * n + l) >> (2u * k)) & 3u;
        let sc = f32(sbyte(o + 192u + 8u * n + 2u * k + l / 16u));
        w[l] = d * sc * f32(i32(low | (high << 4u)) - 32);
    }
    return w;
}
""",
}


def _k_unit(block_bytes: int, nibbles_at: int, fifth_bits: bool) -> str:
    """Q4_K / Q5_K: sub-block j of a super-block is the low (j even) or high nibbles of 32 bytes at
    nibbles_at + 32 (j / 2) (Q5_K: bit j of byte 16 + l on top), times d sc, minus dmin m."""
    fifth = " | (((byte_at(o + 16u + l) >> j) & 1u) << 4u)" if fifth_bits else ""
    return f"""
fn unit(base: u32, u: u32) -> array<f32, 32> {{
    let o = base + (u / 8u) * {block_bytes}u;
    let j = u % 8u;
    let sm = scale_min_k4(o + 4u, j);
    let scale = half_at(o) * sm.x;
    let offset = half_at(o + 2u) * sm.y;
    let shift = 4u * (j % 2u);
    var w: array<f32, 32>;
    for (var l = 0u; l < 32u; l = l + 1u) {{
        let q = ((byte_at(o + {nibbles_at}u + 32u * (j / 2u) + l) >> shift) & 15u){fifth};
        w[l] = scale * f32(q) - offset;
    }}
    return w;
}}
"""


_UNITS[GGMLType.Q4_K] = _k_unit(144, 16, fifth_bits=False)
_UNITS[GGMLType.Q5_K] = _k_unit(176, 48, fifth_bits=True)
TYPES = frozenset(_UNITS)

_KERNEL = """
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x * 64u + lid;
    if (r >= dims.piece_rows) { return; }
    let row = dims.row0 + r;
    let base = r * dims.row_bytes;
    let t0 = wg.y * 8u;
    let nt = min(8u, dims.tokens - t0);
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (var u = 0u; u < dims.cols / 32u; u = u + 1u) {
        var w = unit(base, u);
        for (var t = 0u; t < nt; t = t + 1u) {
            let xo = ((t0 + t) * dims.cols + 32u * u) / 4u;
            var s = 0.0;
            for (var i = 0u; i < 8u; i = i + 1u) {
                s = s + dot(vec4<f32>(w[4u * i], w[4u * i + 1u], w[4u * i + 2u], w[4u * i + 3u]), x[xo + i]);
            }
            acc[t] = acc[t] + s;
        }
    }
    for (var t = 0u; t < nt; t = t + 1u) { y[(t0 + t) * dims.rows + row] = acc[t]; }
}
"""


def tile_kernel(common: str, t: GGMLType) -> str:
    """The WGSL of the prompt kernel for block type t, after matvec.py's bindings and byte readers (`common`), its
    input read four floats at a time (a row's length is a multiple of 32)."""
    vec4_x = common.replace("var<storage, read> x: array<f32>;", "var<storage, read> x: array<vec4<f32>>;")
    assert vec4_x != common
    return vec4_x + _UNITS[t] + _KERNEL
