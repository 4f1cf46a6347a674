"""WGSL for the forward pass's ops other than the matrices (matvec.py): norms, RoPE, the KV cache's writes,
attention, gated activations, residual adds, biases and column splits. f32, but for the KV cache's element type
`KVT`: f16 where the adapter has shader-f16 (half the cache's memory and of the bytes attention reads, as the CPU's
default cache), else f32; `source(name, kv_f16)` fills it in.

Every shader reads its sizes from a uniform `p` at its last binding (program.py packs it: u32 and f32 fields in
order). Elementwise shaders index by `flat(gid, nwg)`, a 2-D dispatch's invocation number, so a chunk's
activations may exceed the 65,535 workgroups one dimension allows.
"""

from __future__ import annotations

_FLAT = """
fn flat(gid: vec3<u32>, nwg: vec3<u32>) -> u32 { return gid.x + gid.y * nwg.x * 64u; }
"""

# y (or y += , for a post-norm's residual) = x * rsqrt(mean(x^2) + eps) * w, one workgroup per row of n
RMS_NORM = """
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
struct P { n: u32, eps: f32, accumulate: u32 };
@group(0) @binding(3) var<uniform> p: P;
var<workgroup> part: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let o = wg.x * p.n;
    var s = 0.0;
    for (var i = lid; i < p.n; i = i + 64u) { s = s + x[o + i] * x[o + i]; }
    part[lid] = s;
    workgroupBarrier();
    for (var k = 32u; k > 0u; k = k >> 1u) {
        if (lid < k) { part[lid] = part[lid] + part[lid + k]; }
        workgroupBarrier();
    }
    let r = inverseSqrt(part[0] / f32(p.n) + p.eps);
    for (var i = lid; i < p.n; i = i + 64u) {
        let v = x[o + i] * r * w[i];
        if (p.accumulate == 1u) { y[o + i] = y[o + i] + v; } else { y[o + i] = v; }
    }
}
"""

# x (rows, heads, D) rotated in place by its row's cos/sin (rows, half) table; dims past rope_dim pass through.
# neox pairs (i, i + half), else interleaved (2i, 2i + 1). One invocation per (row, head, pair).
ROPE = _FLAT + """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> cs: array<f32>;  // (rows, 2, half): cos then sin of each row
struct P { rows: u32, heads: u32, d: u32, half: u32, neox: u32 };
@group(0) @binding(2) var<uniform> p: P;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat(gid, nwg);
    if (i >= p.rows * p.heads * p.half) { return; }
    let pair = i % p.half;
    let rh = i / p.half;
    let row = rh / p.heads;
    let c = cs[row * 2u * p.half + pair];
    let s = cs[row * 2u * p.half + p.half + pair];
    var a = rh * p.d + 2u * pair;
    var b = a + 1u;
    if (p.neox == 1u) { a = rh * p.d + pair; b = a + p.half; }
    let x0 = x[a];
    let x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
}
"""

# cache[(pos0 + t) * width + c] = src[(row0 + t) * width + c]: a sequence's new keys (or values) into its cache;
# pos0 = starts[seq], the sequence's length before this pass (a buffer written per pass, so the recorded dispatches
# of a decode step stay the same from one step to the next). An invocation writes a pair of elements as one 32-bit
# word: two invocations storing the halves of one word race on adapters that store 16 bits as a read-modify-write
# of the word (lavapipe does); width is even (Hkv * D).
KV_STORE = _FLAT + """
@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> cache: array<u32>;
@group(0) @binding(2) var<storage, read> starts: array<u32>;
struct P { row0: u32, seq: u32, n: u32, width: u32 };
@group(0) @binding(3) var<uniform> p: P;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat(gid, nwg);
    if (2u * i >= p.n * p.width) { return; }
    let a = src[p.row0 * p.width + 2u * i];
    let b = src[p.row0 * p.width + 2u * i + 1u];
    let o = starts[p.seq] * p.width + 2u * i;
    STORE
}
"""
_STORE = {"f16": "cache[o / 2u] = pack2x16float(vec2<f32>(a, b));",
          "f32": "cache[o] = bitcast<u32>(a);\n    cache[o + 1u] = bitcast<u32>(b);"}

# Causal (optionally sliding-window, soft-capped) grouped-query attention of one sequence's n query rows
# (row0.., at positions starts[seq]..) over its cache (cap, Hkv, D): one workgroup per (head, query). Keys go in
# tiles of 64, one per invocation, with a running max and sum (the online softmax): no score matrix, any length.
ATTENTION = """
@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> kc: array<KVT>;
@group(0) @binding(2) var<storage, read> vc: array<KVT>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> starts: array<u32>;
struct P { row0: u32, seq: u32, heads: u32, kv_heads: u32, d: u32, window: u32, scale: f32, softcap: f32 };
@group(0) @binding(5) var<uniform> p: P;
var<workgroup> qs: array<f32, 256>;
var<workgroup> sc: array<f32, 64>;
const MASKED: f32 = -1.0e30;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wg.x;
    let pos = starts[p.seq] + wg.y;
    let kvh = h / (p.heads / p.kv_heads);
    let qo = ((p.row0 + wg.y) * p.heads + h) * p.d;
    for (var i = lid; i < p.d; i = i + 64u) { qs[i] = q[qo + i]; }
    var first = 0u;
    if (p.window > 0u && pos + 1u > p.window) { first = pos + 1u - p.window; }
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);  // output dims lid, lid + 64, lid + 128, lid + 192
    var m = MASKED;
    var l = 0.0;
    workgroupBarrier();
    for (var j0 = first; j0 <= pos; j0 = j0 + 64u) {
        let j = j0 + lid;
        var s = MASKED;
        if (j <= pos) {
            let ko = (j * p.kv_heads + kvh) * p.d;
            var dot = 0.0;
            for (var i = 0u; i < p.d; i = i + 1u) { dot = dot + qs[i] * f32(kc[ko + i]); }
            s = dot * p.scale;
            if (p.softcap > 0.0) { s = tanh(clamp(s / p.softcap, -15.0, 15.0)) * p.softcap; }
        }
        sc[lid] = s;
        workgroupBarrier();
        var mt = m;
        for (var i = 0u; i < 64u; i = i + 1u) { mt = max(mt, sc[i]); }
        workgroupBarrier();
        sc[lid] = select(0.0, exp(s - mt), j <= pos);
        workgroupBarrier();
        let corr = exp(m - mt);
        l = l * corr;
        for (var k = 0u; k < 4u; k = k + 1u) { acc[k] = acc[k] * corr; }
        let last = min(64u, pos + 1u - j0);
        for (var i = 0u; i < last; i = i + 1u) {
            let e = sc[i];
            l = l + e;
            let vo = ((j0 + i) * p.kv_heads + kvh) * p.d;
            for (var k = 0u; k < 4u; k = k + 1u) {
                let dd = lid + 64u * k;
                if (dd < p.d) { acc[k] = acc[k] + e * f32(vc[vo + dd]); }
            }
        }
        m = mt;
        workgroupBarrier();
    }
    for (var k = 0u; k < 4u; k = k + 1u) {
        let dd = lid + 64u * k;
        if (dd < p.d) { out[qo + dd] = acc[k] / l; }
    }
}
"""

# y (rows, n) = act(gate) * up, gate and up read at their own row strides and offsets (gate|up fused in one matrix)
ACT_MUL = _FLAT + """
@group(0) @binding(0) var<storage, read> g: array<f32>;
@group(0) @binding(1) var<storage, read> u: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
struct P { rows: u32, n: u32, g_stride: u32, u_stride: u32, u_off: u32, gelu: u32 };
@group(0) @binding(3) var<uniform> p: P;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat(gid, nwg);
    if (i >= p.rows * p.n) { return; }
    let r = i / p.n;
    let c = i % p.n;
    let a = g[r * p.g_stride + c];
    var act = a / (1.0 + exp(-a));
    if (p.gelu == 1u) { act = 0.5 * a * (1.0 + tanh(clamp(0.7978845608 * (a + 0.044715 * a * a * a), -15.0, 15.0))); }
    y[i] = act * u[r * p.u_stride + p.u_off + c];
}
"""

# x += y (the residual), or x += b by column (a bias: b has n entries, x rows of n)
ADD = _FLAT + """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> y: array<f32>;
struct P { count: u32, n: u32 };
@group(0) @binding(2) var<uniform> p: P;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat(gid, nwg);
    if (i >= p.count) { return; }
    x[i] = x[i] + y[i % p.n];
}
"""

# dst (rows, n) = the columns off..off+n of src (rows, stride): q, k and v out of a fused q|k|v result
COLUMNS = _FLAT + """
@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
struct P { rows: u32, n: u32, stride: u32, off: u32 };
@group(0) @binding(2) var<uniform> p: P;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat(gid, nwg);
    if (i >= p.rows * p.n) { return; }
    dst[i] = src[(i / p.n) * p.stride + p.off + i % p.n];
}
"""

SOURCES = {"rms_norm": RMS_NORM, "rope": ROPE, "kv_store": KV_STORE, "attention": ATTENTION, "act_mul": ACT_MUL,
           "add": ADD, "columns": COLUMNS}
MAX_HEAD_DIM = 256  # attention's workgroup copy of a query, and its 4 output dims per invocation
KV_OPS = ("kv_store", "attention")


def source(name: str, kv_f16: bool) -> str:
    """An op's WGSL with the KV cache's element type filled in."""
    code = SOURCES[name]
    if name not in KV_OPS:
        return code
    kvt = "f16" if kv_f16 else "f32"
    code = code.replace("KVT", kvt).replace("STORE", _STORE[kvt])
    return "enable f16;\n" + code if kv_f16 else code
