"""WGSL matrix kernels over GGUF blocks as stored: y = x @ W.T for x (T, cols) f32 and W a QTensor (rows, cols).

The weight's bytes go to the device as they are in the file (a storage buffer of u32 words; a block of Q8_0 is
34 bytes, so blocks are read byte by byte from the words). Two kernels over the same per-type bodies: for a few
tokens (decode) a workgroup of 64 invocations per (row, token), each taking every 64th block of the row, then a tree
reduction in workgroup memory; for 8 or more (a prompt) an invocation per (row, tile of 8 tokens). A weight goes to
the device in pieces of whole rows, each within the adapter's binding limit (128 MiB on lavapipe: Gemma 3's 178 MB
head is two) and the dispatch limit of 65,535 workgroups per dimension; a piece is one dispatch, writing its rows.

Types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (MXFP4, gpt-oss's expert type, comes with
the MoE families).
"""

from __future__ import annotations

import numpy as np

from engine.kernels.quant_types import GGMLType, QTensor
from engine.kernels.webgpu import tiles

__all__ = ["TYPES", "WebGPUMatmul"]

_COMMON = """
@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
// rows, cols of the whole weight; row_bytes of a row; row0, piece_rows: this piece's rows; tokens of x; lanes: the
// decode kernel's invocations per row (64 / lanes rows per workgroup)
struct Dims { rows: u32, cols: u32, row_bytes: u32, row0: u32, piece_rows: u32, tokens: u32, lanes: u32 };
@group(0) @binding(3) var<uniform> dims: Dims;

fn byte_at(o: u32) -> u32 { return (w[o >> 2u] >> ((o & 3u) * 8u)) & 0xffu; }
fn half_at(o: u32) -> f32 { return unpack2x16float(byte_at(o) | (byte_at(o + 1u) << 8u)).x; }
fn word_at(o: u32) -> u32 {
    return byte_at(o) | (byte_at(o + 1u) << 8u) | (byte_at(o + 2u) << 16u) | (byte_at(o + 3u) << 24u);
}
fn sbyte(o: u32) -> i32 { return bitcast<i32>(byte_at(o) << 24u) >> 24u; }
// Q4_K's 6-bit scale and min of sub-block j from its 12 packed bytes at o (llama.cpp's get_scale_min_k4)
fn scale_min_k4(o: u32, j: u32) -> vec2<f32> {
    if (j < 4u) { return vec2<f32>(f32(byte_at(o + j) & 63u), f32(byte_at(o + j + 4u) & 63u)); }
    return vec2<f32>(f32((byte_at(o + j + 4u) & 15u) | ((byte_at(o + j - 4u) >> 6u) << 4u)),
                     f32((byte_at(o + j + 4u) >> 4u) | ((byte_at(o + j) >> 6u) << 4u)));
}
"""

# A few tokens (decode): a workgroup per (rows, token), `lanes` invocations per row over the row's blocks (64 lanes
# for a long row; a short one, whose blocks would leave most of 64 idle, shares the workgroup with others), then a
# reduction in workgroup memory; enough workgroups to fill a GPU for one token.
_ROW_HEAD = _COMMON + """
var<workgroup> part: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x * (64u / dims.lanes) + lid / dims.lanes;  // the row within this piece of the weight
    let live = r < dims.piece_rows;  // a lane past the last row still takes part in the barriers
    let row = dims.row0 + r;
    let t = wg.y;
    let xt = t * dims.cols;
    let base = r * dims.row_bytes;
    var first = lid % dims.lanes;
    if (!live) { first = 0xffffffu; }
    let step = dims.lanes;
    var acc = 0.0;
"""

# With subgroups (and a row's 64 lanes): each subgroup sums its invocations' parts in registers, its first invocation
# keeps the sum, and one pass over the 64 slots adds them (no tree of barriers).
_ROW_TAIL_SUBGROUPS = """
    let total = subgroupAdd(acc);
    part[lid] = select(0.0, total, sg == 0u);
    workgroupBarrier();
    if (lid == 0u && live) {
        var s = 0.0;
        for (var i = 0u; i < 64u; i = i + 1u) { s = s + part[i]; }
        y[t * dims.rows + row] = s;
    }
}
"""

_ROW_TAIL = """
    part[lid] = acc;
    workgroupBarrier();
    for (var s = dims.lanes / 2u; s > 0u; s = s >> 1u) {
        if (lid % dims.lanes < s) { part[lid] = part[lid] + part[lid + s]; }
        workgroupBarrier();
    }
    if (lid % dims.lanes == 0u && live) { y[t * dims.rows + row] = part[lid]; }
}
"""

# A prompt's tokens: an invocation per (row, tile of 8 tokens), no reductions or barriers: a chunk is rows/64 x
# tokens/8 workgroups, not rows x tokens. Block types decode each block once for the tile (tiles.py); float types
# walk their row for each token of the tile here (their "decoding" is a load).
TILE_TOKENS = 8
_TILE_HEAD = _COMMON + """
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x * 64u + lid;
    if (r >= dims.piece_rows) { return; }
    let row = dims.row0 + r;
    let base = r * dims.row_bytes;
    let first = 0u;
    let step = 1u;
    for (var t = wg.y * 8u; t < min(wg.y * 8u + 8u, dims.tokens); t = t + 1u) {
        let xt = t * dims.cols;
        var acc = 0.0;
"""

_TILE_TAIL = """
        y[t * dims.rows + row] = acc;
    }
}
"""

_BODIES = {
    GGMLType.F32: """
    for (var c = first; c < dims.cols; c = c + step) {
        acc = acc + bitcast<f32>(w[(base >> 2u) + c]) * x[xt + c];
    }
""",
    GGMLType.F16: """
    for (var c = first; c < dims.cols; c = c + step) {
        acc = acc + half_at(base + 2u * c) * x[xt + c];
    }
""",
    # BF16: the top half of an f32
    GGMLType.BF16: """
    for (var c = first; c < dims.cols; c = c + step) {
        let o = base + 2u * c;
        acc = acc + bitcast<f32>((byte_at(o) | (byte_at(o + 1u) << 8u)) << 16u) * x[xt + c];
    }
""",
    GGMLType.Q8_0: """
    for (var b = first; b < dims.cols / 32u; b = b + step) {
        let o = base + b * 34u;
        var s = 0.0;
        for (var i = 0u; i < 32u; i = i + 1u) {
            s = s + f32(sbyte(o + 2u + i)) * x[xt + b * 32u + i];
        }
        acc = acc + half_at(o) * s;
    }
""",
    # Q4_0: f16 d, then 16 bytes: element i in the low nibble of byte i, element 16 + i in its high nibble; (q - 8) d
    GGMLType.Q4_0: """
    for (var b = first; b < dims.cols / 32u; b = b + step) {
        let o = base + b * 18u;
        let xb = xt + b * 32u;
        var s = 0.0;
        for (var i = 0u; i < 16u; i = i + 1u) {
            let q = byte_at(o + 2u + i);
            s = s + (f32(q & 15u) - 8.0) * x[xb + i] + (f32(q >> 4u) - 8.0) * x[xb + 16u + i];
        }
        acc = acc + half_at(o) * s;
    }
""",
    # Q4_1: f16 d, f16 m, then the nibbles as Q4_0's; q d + m
    GGMLType.Q4_1: """
    for (var b = first; b < dims.cols / 32u; b = b + step) {
        let o = base + b * 20u;
        let xb = xt + b * 32u;
        var s = 0.0;
        var sx = 0.0;
        for (var i = 0u; i < 16u; i = i + 1u) {
            let q = byte_at(o + 4u + i);
            let x0 = x[xb + i];
            let x1 = x[xb + 16u + i];
            s = s + f32(q & 15u) * x0 + f32(q >> 4u) * x1;
            sx = sx + x0 + x1;
        }
        acc = acc + half_at(o) * s + half_at(o + 2u) * sx;
    }
""",
    # Q5_0: f16 d, 4 bytes of fifth bits (bit i for element i), then nibbles as Q4_0's; (q - 16) d
    GGMLType.Q5_0: """
    for (var b = first; b < dims.cols / 32u; b = b + step) {
        let o = base + b * 22u;
        let qh = word_at(o + 2u);
        let xb = xt + b * 32u;
        var s = 0.0;
        for (var i = 0u; i < 16u; i = i + 1u) {
            let q = byte_at(o + 6u + i);
            let lo = (q & 15u) | (((qh >> i) & 1u) << 4u);
            let hi = (q >> 4u) | (((qh >> (i + 16u)) & 1u) << 4u);
            s = s + (f32(lo) - 16.0) * x[xb + i] + (f32(hi) - 16.0) * x[xb + 16u + i];
        }
        acc = acc + half_at(o) * s;
    }
""",
    # Q5_1: f16 d, f16 m, the fifth bits, the nibbles; q d + m
    GGMLType.Q5_1: """
    for (var b = first; b < dims.cols / 32u; b = b + step) {
        let o = base + b * 24u;
        let qh = word_at(o + 4u);
        let xb = xt + b * 32u;
        var s = 0.0;
        var sx = 0.0;
        for (var i = 0u; i < 16u; i = i + 1u) {
            let q = byte_at(o + 8u + i);
            let x0 = x[xb + i];
            let x1 = x[xb + 16u + i];
            let lo = (q & 15u) | (((qh >> i) & 1u) << 4u);
            let hi = (q >> 4u) | (((qh >> (i + 16u)) & 1u) << 4u);
            s = s + f32(lo) * x0 + f32(hi) * x1;
            sx = sx + x0 + x1;
        }
        acc = acc + half_at(o) * s + half_at(o + 2u) * sx;
    }
""",
    # Q6_K: 256 weights in 210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16
    # weights), f16 d last; d sc (q - 32), in two halves of 128 (llama.cpp's dequantize_row_q6_K)
    GGMLType.Q6_K: """
    for (var b = first; b < dims.cols / 256u; b = b + step) {
        let o = base + b * 210u;
        let d = half_at(o + 208u);
        for (var n = 0u; n < 2u; n = n + 1u) {
            let ql = o + 64u * n;
            let qh = o + 128u + 32u * n;
            let sc = o + 192u + 8u * n;
            let xn = xt + b * 256u + 128u * n;
            for (var l = 0u; l < 32u; l = l + 1u) {
                let k = l / 16u;
                let h = byte_at(qh + l);
                let a = byte_at(ql + l);
                let c = byte_at(ql + 32u + l);
                let q1 = f32(i32((a & 15u) | ((h & 3u) << 4u)) - 32);
                let q2 = f32(i32((c & 15u) | (((h >> 2u) & 3u) << 4u)) - 32);
                let q3 = f32(i32((a >> 4u) | (((h >> 4u) & 3u) << 4u)) - 32);
                let q4 = f32(i32((c >> 4u) | (((h >> 6u) & 3u) << 4u)) - 32);
                acc = acc + d * (f32(sbyte(sc + k)) * q1 * x[xn + l] + f32(sbyte(sc + k + 2u)) * q2 * x[xn + 32u + l]
                                 + f32(sbyte(sc + k + 4u)) * q3 * x[xn + 64u + l]
                                 + f32(sbyte(sc + k + 6u)) * q4 * x[xn + 96u + l]);
            }
        }
    }
""",
}


def _k_body(block_bytes: int, nibbles_at: int, fifth_bits: bool) -> str:
    """Q4_K: 256 weights in 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
    128 bytes of nibbles (each 32 bytes: a sub-block in the low nibbles, the next in the high); d sc q - dmin m.
    Q5_K: 176 bytes, 32 bytes of fifth bits (bit s of byte l: weight l of sub-block s) before the nibbles."""
    lo_bit = " | (((byte_at(o + 16u + l) >> (2u * j)) & 1u) << 4u)" if fifth_bits else ""
    hi_bit = " | (((byte_at(o + 16u + l) >> (2u * j + 1u)) & 1u) << 4u)" if fifth_bits else ""
    return f"""
    for (var b = first; b < dims.cols / 256u; b = b + step) {{
        let o = base + b * {block_bytes}u;
        let d = half_at(o);
        let dmin = half_at(o + 2u);
        let xb = xt + b * 256u;
        for (var j = 0u; j < 4u; j = j + 1u) {{
            let lo = scale_min_k4(o + 4u, 2u * j);
            let hi = scale_min_k4(o + 4u, 2u * j + 1u);
            var s1 = 0.0;
            var s2 = 0.0;
            var x1 = 0.0;
            var x2 = 0.0;
            for (var l = 0u; l < 32u; l = l + 1u) {{
                let q = byte_at(o + {nibbles_at}u + 32u * j + l);
                let a = x[xb + 64u * j + l];
                let c = x[xb + 64u * j + 32u + l];
                s1 = s1 + f32((q & 15u){lo_bit}) * a;
                x1 = x1 + a;
                s2 = s2 + f32((q >> 4u){hi_bit}) * c;
                x2 = x2 + c;
            }}
            acc = acc + d * (lo.x * s1 + hi.x * s2) - dmin * (lo.y * x1 + hi.y * x2);
        }}
    }}
"""


_BODIES[GGMLType.Q4_K] = _k_body(144, 16, fifth_bits=False)
_BODIES[GGMLType.Q5_K] = _k_body(176, 48, fifth_bits=True)
TYPES = frozenset(_BODIES)
_MAX_GROUPS = 65535


def _lanes(w: QTensor) -> int:
    """The decode kernel's invocations per row: a power of two from 8 to 64, as many as the row has blocks (the
    units its body walks: 32-weight blocks, 256-weight super-blocks, single weights of F32/F16)."""
    block = {GGMLType.F32: 1, GGMLType.F16: 1, GGMLType.BF16: 1, GGMLType.Q4_K: 256, GGMLType.Q5_K: 256,
             GGMLType.Q6_K: 256}.get(w.ggml_type, 32)
    units = w.cols // block
    lanes = 8
    while lanes < 64 and lanes < units:
        lanes *= 2
    return lanes


class WebGPUMatmul:
    """The matrix kernels on one wgpu device; weights are uploaded once (kept by their bytes' address)."""

    def __init__(self, device, max_binding_bytes: int, subgroups: bool = False):
        import wgpu

        self._wgpu, self.device, self.max_binding_bytes = wgpu, device, max_binding_bytes
        self.subgroups = subgroups  # the decode kernel's sums by subgroup (the device has the feature)
        self._pipelines: dict[tuple[GGMLType, str], object] = {}
        self._weights: dict[tuple, object] = {}

    def _pipeline(self, t: GGMLType, kind: str):
        """kind: "tile" (prompts), "subgroups" (decode, a row's 64 lanes summed by subgroup), "rows" (decode)."""
        if (t, kind) not in self._pipelines:
            if kind == "tile":
                code = tiles.tile_kernel(_COMMON, t) if t in tiles.TYPES else _TILE_HEAD + _BODIES[t] + _TILE_TAIL
            elif kind == "subgroups":
                head = _ROW_HEAD.replace("lid: u32)", "lid: u32, @builtin(subgroup_invocation_id) sg: u32)")
                code = head + _BODIES[t] + _ROW_TAIL_SUBGROUPS
            else:
                code = _ROW_HEAD + _BODIES[t] + _ROW_TAIL
            module = self.device.create_shader_module(code=code)
            self._pipelines[t, kind] = self.device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": "main"})
        return self._pipelines[t, kind]

    def upload(self, w: QTensor) -> None:
        """Put the weight on the device now (a model's load), not at its first use."""
        self._pieces(w)

    def _pieces(self, w: QTensor) -> list[tuple[int, int, object]]:
        """The weight on the device as (first row, rows, buffer) pieces: each within the adapter's binding limit and
        the dispatch limit, uploaded once (kept by the bytes' address)."""
        key = (w.raw.__array_interface__["data"][0], w.shape, int(w.ggml_type))
        pieces = self._weights.get(key)
        if pieces is None:
            raw = np.ascontiguousarray(w.raw).reshape(w.rows, -1).view(np.uint8)
            row_bytes = raw.shape[1]
            per_piece = min(_MAX_GROUPS, self.max_binding_bytes // row_bytes)
            if per_piece < 1:
                raise ValueError(f"{w.name}: one row is {row_bytes} bytes, over the adapter's "
                                 f"{self.max_binding_bytes}-byte binding limit")
            pieces = []
            for r0 in range(0, w.rows, per_piece):
                data = raw[r0:r0 + per_piece].reshape(-1)
                padded = np.zeros(-(-data.nbytes // 4) * 4, np.uint8)
                padded[:data.nbytes] = data
                buf = self.device.create_buffer_with_data(data=padded, usage=self._wgpu.BufferUsage.STORAGE)
                pieces.append((r0, min(per_piece, w.rows - r0), buf))
            self._weights[key] = pieces
        return pieces

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        """x (T, cols) f32 @ W.T -> (T, rows) f32, computed on the device."""
        x = np.ascontiguousarray(x, np.float32).reshape(-1, w.cols)
        tokens, usage = x.shape[0], self._wgpu.BufferUsage
        if w.ggml_type not in TYPES:
            raise ValueError(f"{w.name}: {w.ggml_type.name} is not a type the WebGPU kernels read yet")
        xbuf = self.device.create_buffer_with_data(data=x, usage=usage.STORAGE)
        ybuf = self.device.create_buffer(size=tokens * w.rows * 4, usage=usage.STORAGE | usage.COPY_SRC)
        encoder = self.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        for pipeline, group, groups in self.commands(xbuf, ybuf, tokens, w):
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, group)
            compute.dispatch_workgroups(*groups, 1)
        compute.end()
        self.device.queue.submit([encoder.finish()])
        out = np.frombuffer(self.device.queue.read_buffer(ybuf), np.float32)
        return out.reshape(tokens, w.rows).copy()

    def commands(self, xbuf, ybuf, tokens: int, w: QTensor) -> list[tuple[object, object, tuple[int, int]]]:
        """y = x @ W.T as dispatches (pipeline, bind group, workgroups) over x (tokens, cols) and y (tokens, rows)
        f32 device buffers: one per piece of the weight; a caller may record them once and replay them."""
        if w.ggml_type not in TYPES:
            raise ValueError(f"{w.name}: {w.ggml_type.name} is not a type the WebGPU kernels read yet")
        tiled = tokens >= TILE_TOKENS
        lanes = _lanes(w)
        kind = "tile" if tiled else "subgroups" if self.subgroups and lanes == 64 else "rows"
        pipeline = self._pipeline(w.ggml_type, kind)
        layout = pipeline.get_bind_group_layout(0)
        out = []
        for row0, rows, wbuf in self._pieces(w):
            dims = np.array([w.rows, w.cols, w.raw.shape[1], row0, rows, tokens, lanes, 0], np.uint32)
            ubuf = self.device.create_buffer_with_data(data=dims, usage=self._wgpu.BufferUsage.UNIFORM)
            group = self.device.create_bind_group(layout=layout, entries=[
                {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                for i, b in enumerate((wbuf, xbuf, ybuf, ubuf))])
            groups = (-(-rows // 64), -(-tokens // TILE_TOKENS)) if tiled else (-(-rows // (64 // lanes)), tokens)
            out.append((pipeline, group, groups))
        return out
