"""Architecture name -> family module (forward pass + the tensors each block needs)."""

from types import ModuleType

from engine.models import gemma3, llama

FAMILIES: dict[str, ModuleType] = {"llama": llama, "gemma3": gemma3}


def family(arch: str) -> ModuleType:
    return FAMILIES[arch]
