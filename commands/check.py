"""`goinfer check [--hardware] [--fit MODEL] [--json]`: the block a bug report needs."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from commands.errors import fail, user_errors
from commands.ui import FetchProgress, say

HELP = """Print what a bug report needs: versions, CPU features, kernel tier, memory, GPU backends, kernel self-test.

Nothing personal goes in (no hostname, user name, home directory or address): paste it as is. The self-tests take \
a while (progress on stderr); the WebGPU one runs on a real GPU, on a software adapter only with --webgpu-selftest.

Examples:

  goinfer check

  goinfer check --json

  goinfer check --fit gemma3-270m --ctx 8192

Exit status: 0 (a self-test that stepped a kernel down is reported, not an error), 2 bad usage or model.
"""


def check(
    hardware: Annotated[bool, typer.Option(
        "--hardware", help="The hardware report: what check prints anyway (kept for older scripts).")] = False,
    fit: Annotated[Optional[str], typer.Option("--fit", metavar="MODEL",
                                               help="Also estimate the memory MODEL needs against what is free.")] = None,
    ctx: Annotated[Optional[int], typer.Option("--ctx", help="Context size for --fit (default: the model's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    no_selftest: Annotated[bool, typer.Option("--no-selftest", help="Skip the kernel self-tests.")] = False,
    webgpu_selftest: Annotated[bool, typer.Option(
        "--webgpu-selftest", help="Run the WebGPU self-test on a software adapter too (a CPU emulating a GPU: "
                                  "5-60 s), when there is no real GPU.")] = False,
) -> None:
    del hardware  # the only check there is
    if ctx is not None and ctx < 1:
        raise fail(f"--ctx must be >= 1, got {ctx}")
    from engine.loading.hardware import hardware_report

    from commands.version import goinfer_version

    progress = FetchProgress()
    try:
        with user_errors():
            report = hardware_report(selftest=not no_selftest, fit=fit, context=ctx, progress=progress,
                                     software_selftest=webgpu_selftest, say=_progress)
    finally:
        progress.close()
    report["goinfer"] = goinfer_version()  # with the commit, in a checkout
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        _print_plain(report)


def _progress(line: str) -> None:
    """A self-test is starting: say so on stderr, so its seconds are not silent."""
    say(line, style="dim")


def _gpu_selftest_line(t: dict) -> str:
    """The WebGPU self-test's result beside its bars (engine/loading/gpu_selftest.py)."""
    if "worst_cosine" not in t:
        return f"{t['status']} on {t['adapter']}: {t.get('reason')}"
    line = (f"{t['status']} on {t['adapter']}: worst cosine {t['worst_cosine']:.5f} (bar {t['bars']['cosine']}), "
            f"relative L2 {t['worst_rel_l2']:.4f} (bar {t['bars']['rel_l2']}), {t['elapsed_ms']:.0f} ms")
    return line + (f"; {t['reason']}" if t.get("reason") else "")


def _mb(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**20:,.0f} MiB"


def _print_plain(r: dict[str, Any]) -> None:
    cpu, mem, k, st = r["cpu"], r["memory"], r["kernels"], r["selftest"]
    blas = r["numpy"]["blas"]
    lines = [
        f"goinfer      {r['goinfer']}",
        f"os           {r['os']['system']} {r['os']['kernel']} ({r['os']['machine']}, {r['os']['libc'] or 'libc ?'})",
        f"python       {r['python']['version']} ({r['python']['implementation']})",
        f"numpy        {r['numpy']['version']}, BLAS {blas.get('name')} {blas.get('version')}",
        f"numba        {r['numba']} (llvmlite {r['llvmlite']}), target {k.get('numba_target')}, "
        f"{k.get('threads')} threads, layer {k.get('threading_layer')}",
        f"cpu          {cpu['model']} ({cpu['arch']}), {cpu['physical_cores'] or '?'} cores / "
        f"{cpu['logical_cores']} threads, {cpu['usable_cores']} usable",
        f"isa          {' '.join(cpu['isa']) or 'none detected'}",
        f"kernel tier  {k['tier']} (tiers: {', '.join(k.get('tiers') or [])})",
        f"kernel cache {k.get('cache')}",
        f"memory       {_mb(mem['available_bytes'])} available of {_mb(mem['total_bytes'])}"
        + (f", cgroup limit {_mb(mem['cgroup_limit_bytes'])}" if mem["cgroup_limit_bytes"] else ""),
    ]
    for name, g in r["gpu"].items():
        if name == "webgpu" and g.get("adapters"):
            for a in g["adapters"]:
                kind = "software" if a["software"] else a["adapter_type"]
                lines.append(f"{'gpu webgpu':<12} {a['adapter']} via {a['backend']} ({kind}; binding "
                             f"{_mb(a['max_binding_bytes'])}; {' '.join(a['features']) or 'no f16/subgroups'}; "
                             f"{g.get('package')})")
            lines.append(f"{'':<12} auto picks: {g['auto'] or 'cpu (' + g['reason'] + ')'}")
            if g.get("selftest"):
                lines.append(f"{'':<12} self-test: {_gpu_selftest_line(g['selftest'])}")
            continue
        if g["available"]:
            state = f"{g.get('device')} ({g.get('package')})"
        elif g.get("device"):  # seen, but unused (CUDA: no backend yet)
            state = f"{g['device']} ({g.get('package')}), unused: {g['reason']}"
        else:
            state = f"unavailable: {g['reason']}"
        lines.append(f"{'gpu ' + name:<12} {state}")
    if st["status"] in ("ok", "stepped_down"):
        summary = f"{st['status']}: {st['kernels_checked']} kernels in {st['seconds'] * 1000:.0f} ms"
        for f in st["failed"]:
            summary += f"; FAILED {f['kernel']} {f['type']} (max rel err {f['max_rel_err']:.3g})"
    else:
        summary = st["status"]
    lines.append(f"self-test    {summary}")
    models = r["models"]
    archs = [a["architecture"] + ("" if "safetensors" in a["formats"] else " (gguf only)")
             for a in models["architectures"]]
    lines.append(f"models       {', '.join(models['formats'])}: {', '.join(archs)}")
    if "fit" in r:
        f = r["fit"]
        verdict = "unknown" if f["fits"] is None else ("fits" if f["fits"] else "does NOT fit")
        lines.append(f"fit          {f['model']} at context {f['context']}: needs {_mb(f['total_bytes'])} "
                     f"(weights {_mb(f['weights_bytes'])}, KV {_mb(f['kv_cache_bytes'])}, work ~"
                     f"{_mb(f['working_bytes_estimate'])}); {_mb(f['available_bytes'])} available: {verdict}")
        lines.append(f"sessions     warm-session KV budget (serve --session-memory default) "
                     f"{_mb(f['session_budget_bytes'])}: about {f['session_budget_tokens']} cached positions "
                     f"({f['session_kv_bytes_per_token']} bytes each)")
    print("\n".join(lines))
