"""LoRA adapters merged into a model's weights at load: a PEFT adapter directory (adapter_config.json and
adapter_model.safetensors, as `peft` saves a fine-tune) over a GGUF file or a Hugging Face checkpoint.

Each adapted matrix becomes W + scale * B @ A (scale = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; times
the multiplier the user gives), computed in f32 from the base's stored numbers, then stored as the path computes:
Q8_0 blocks on the default path (the int8 kernels; a base in 4-bit blocks gains precision there, not loses it), f32
on the exact path. The rest of the model is copied as it is stored. Everything lies in one buffer, as a GGUF's
tensors lie in its mapping, so the compiled decode step (and speculative decoding, and batching) run unchanged: the
adapter costs nothing per token. The price is memory: the merged model is held in memory rather than mapped from
its file, and a second model (the base alone) is a second load.

An adapter's module names are Hugging Face's (`model.layers.0.self_attn.q_proj`), mapped to the GGUF names with
gguf's TensorNameMap as the checkpoint converter does; where the converter permutes q/k rows for adjacent-pair
RoPE (llama), the delta's rows are permuted the same way. What a merge cannot express is refused by name: DoRA,
biases, modules saved whole, per-module ranks, embedding adapters, MoE experts, tensors a family reshapes.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from engine.errors import ModelLoadError, UnsupportedModel
from engine.formats.checkpoint_json import read_json_object
from engine.kernels.quant_types import BLOCK_GEOMETRY, GGMLType, QTensor
from engine.models.hf_checkpoint import interleave_heads
from engine.models.tensor_image import TensorImage, aligned_buffer

__all__ = ["Adapter", "AdaptedSource", "read_adapter"]

_PREFIX = "base_model.model."
_FLOATS = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter: per Hugging Face module name, its (A (r, in), B (out, r)) f32 and the scale."""

    path: Path
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r)) times the user's multiplier
    pairs: dict  # module name (model.layers.0.self_attn.q_proj) -> (A, B)
    digest: str  # of the adapter's weights file, so a stored session knows which adapter made it

    def identity(self) -> dict:
        return {"adapter": self.path.name, "scale": self.scale, "digest": self.digest}


def read_adapter(path: str | Path, multiplier: float = 1.0) -> Adapter:
    """A PEFT adapter directory; ModelLoadError / UnsupportedModel naming what is missing or not mergeable."""
    from engine.formats.safetensors import SafetensorsCheckpoint, to_f32

    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        raise UnsupportedModel(f"--lora {path.name}: GGUF LoRA adapters are not supported; give the PEFT adapter "
                               "directory (adapter_config.json, adapter_model.safetensors)")
    if not path.is_dir():
        raise ModelLoadError(f"--lora {path}: no such adapter directory")
    config = read_json_object(path / "adapter_config.json")
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise ModelLoadError(f"--lora {path.name}: adapter_model.safetensors is missing")
    refusals = [(config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (only LORA)"),
                (bool(config.get("use_dora")), "DoRA (use_dora)"),
                (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (GPT-2 style Conv1D layers)"),
                (config.get("bias", "none") != "none", f"trained biases (bias {config.get('bias')!r})"),
                (bool(config.get("modules_to_save")), "modules saved whole (modules_to_save)"),
                (bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern")), "per-module ranks or alphas")]
    for refused, what in refusals:
        if refused:
            raise UnsupportedModel(f"--lora {path.name}: {what} cannot be merged; goinfer merges plain LoRA")
    try:
        r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (KeyError, TypeError, ValueError):
        raise ModelLoadError(f"--lora {path.name}: adapter_config.json has no usable r / lora_alpha") from None
    if r < 1:
        raise ModelLoadError(f"--lora {path.name}: r is {r}")
    scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r) * multiplier
    try:
        tensors = SafetensorsCheckpoint(path)  # the adapter directory's one file (PEFT writes no other)
    except ModelLoadError as e:
        raise ModelLoadError(f"--lora {path.name}: {e}") from None
    pairs: dict[str, list] = {}
    for name in tensors.names:
        stem = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
        for part, slot in ((".lora_A.weight", 0), (".lora_B.weight", 1)):
            if stem.endswith(part):
                if tensors.dtype(name) not in ("F32", "F16", "BF16"):
                    raise ModelLoadError(f"--lora {path.name}: {name} is {tensors.dtype(name)}")
                pairs.setdefault(stem[: -len(part)], [None, None])[slot] = to_f32(tensors.array(name),
                                                                                 tensors.dtype(name))
                break
        else:
            raise UnsupportedModel(f"--lora {path.name}: {name} is not a LoRA matrix goinfer can merge "
                                   "(embedding adapters and extra weights are not supported)")
    for module, (a, b) in pairs.items():
        if a is None or b is None or a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ModelLoadError(f"--lora {path.name}: {module} lacks a matching lora_A / lora_B pair")
    if not pairs:
        raise ModelLoadError(f"--lora {path.name}: the adapter has no LoRA matrices")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:16]
    return Adapter(path, scale, {m: tuple(p) for m, p in pairs.items()}, digest)


class AdaptedSource(TensorImage):
    """A model's tensors (a GGUF file, its shards or a converted checkpoint: models/weights.TensorSource) with
    adapters merged, all in one in-memory buffer."""

    def __init__(self, base, adapters: list[Adapter], config, family, *, exact: bool, quantize_stored: bool = False):
        """exact: merged matrices stay f32 (the exact path), else Q8_0. quantize_stored: the base holds its
        matrices as stored words (a checkpoint converted without quantizing, so that adapted matrices are
        quantized once, after the merge): every float matrix becomes Q8_0 as the default path's conversion makes
        it."""
        self.path, self.metadata, self._base = base.path, base.metadata, base
        tensors = {name: base.tensor(name) for name in base.names}
        deltas = _deltas(adapters, config, family, {name: t.shape for name, t in tensors.items()})
        items = [(name, t, deltas.get(name)) for name, t in tensors.items()]
        self._buffer, self._tensors = _lay_out(items, exact, quantize_stored)
        self._freeze()

    @property
    def architecture(self) -> str:
        return self._base.architecture

    def check_tensor_types(self) -> None:
        self._base.check_tensor_types()


def _deltas(adapters: list[Adapter], config, family, shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """GGUF tensor name (`blk.0.attn_q.weight`) -> the f32 sum of every adapter's scale * B @ A, in the GGUF's row
    order; `shapes`: the model's tensors by name."""
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[config.arch]
    table = gguf.get_tensor_name_map(arch_id, config.n_layer)
    permute = {"attn_q": config.n_head, "attn_k": config.n_head_kv} if config.rope_style == "interleaved" else {}
    out: dict[str, np.ndarray] = {}
    for adapter in adapters:
        for module, (a, b) in adapter.pairs.items():
            known = module + ".weight"
            for part, spelling in family.hf_aliases:
                known = known.replace(part, spelling)
            name = table.get_name(known, try_suffixes=(".weight",))
            if name is None and ".experts." in module:
                raise UnsupportedModel(f"--lora {adapter.path.name}: {module}: adapters on MoE experts are not "
                                       "supported")
            if name is None or name not in shapes:
                raise ModelLoadError(f"--lora {adapter.path.name}: {module} is not a matrix of this "
                                     f"{config.arch} model (an adapter for another model?)")
            stem = name.split(".")[2] if name.startswith("blk.") else ""
            if stem in family.hf_reshaped:
                raise UnsupportedModel(f"--lora {adapter.path.name}: {module}: goinfer reshapes this tensor at "
                                       "conversion and cannot merge an adapter into it")
            if (b.shape[0], a.shape[1]) != shapes[name]:
                raise ModelLoadError(f"--lora {adapter.path.name}: {module} is {(b.shape[0], a.shape[1])} in the "
                                     f"adapter and {shapes[name]} in the model (an adapter for another model?)")
            delta = np.float32(adapter.scale) * (b @ a)  # (out, r) @ (r, in)
            if stem in permute:  # the converter's q/k row order for adjacent-pair RoPE
                delta = interleave_heads(delta, permute[stem])
            out[name] = out[name] + delta if name in out else delta
    return out


def _lay_out(items: list, exact: bool, quantize_stored: bool) -> tuple[np.ndarray, dict[str, QTensor]]:
    """Every tensor into one page-aligned anonymous buffer: unadapted ones as stored (float matrices as Q8_0
    with quantize_stored), adapted ones merged as Q8_0 (f32 on the exact path, or where a row is not whole
    32-wide blocks)."""
    from engine.kernels.reference import dequantize_raw

    plans = []
    for name, t, delta in items:
        # what hf_checkpoint's default-path conversion would have made of a stored float matrix (vectors are f32)
        converted = quantize_stored and t.ggml_type in _FLOATS and t.rows > 1
        if delta is None and not converted:
            gtype, nbytes = t.ggml_type, t.raw.nbytes
        else:
            gtype = GGMLType.F32 if exact or t.cols % 32 else GGMLType.Q8_0
            block, bsize = BLOCK_GEOMETRY[gtype]
            nbytes = t.rows * (t.cols // block) * bsize
        plans.append((name, t, delta, gtype, nbytes))
    buf, offsets = aligned_buffer([p[4] for p in plans])
    out = {}
    for (name, t, delta, gtype, nbytes), off in zip(plans, offsets):
        raw = buf[off : off + nbytes].reshape(t.rows, nbytes // t.rows)
        if gtype == t.ggml_type and delta is None:
            raw[:] = t.raw.reshape(t.rows, -1)
        else:
            for r0 in range(0, t.rows, 4096):  # a slab at a time: the f32 copy of a large matrix stays small
                merged = np.array(dequantize_raw(t.raw[r0 : r0 + 4096], t.ggml_type, t.cols), np.float32)
                if delta is not None:
                    merged += delta[r0 : r0 + 4096]
                raw[r0 : r0 + 4096] = (merged.view(np.uint8) if gtype == GGMLType.F32 else
                                       gguf.quants.quantize(merged, gguf.GGMLQuantizationType.Q8_0))
        out[name] = QTensor(name, gtype, (t.rows, t.cols), raw)
    return buf, out
