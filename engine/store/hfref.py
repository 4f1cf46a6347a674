"""`hf:` model references and where their pulls live on disk (no network, no huggingface_hub import).

    hf:OWNER/REPO                 the repo's only GGUF (or split set); with several, pull lists the quants
    hf:OWNER/REPO:Q4_K_M          the GGUF of that quant (every shard of it when split)
    hf:OWNER/REPO:FILE.gguf       that file (every shard of its split set when it is one shard)
    hf:OWNER/REPO:safetensors     the whole safetensors checkpoint (config, tokenizer, every shard)
    hf:OWNER/REPO@REV:...         a branch, tag or commit instead of main

A complete pull is <home>/models/hf/OWNER/REPO/SELECTOR/ holding the files and manifest.json (written
last, then the directory is renamed into place in one step); a pull in progress is
<home>/staging/hf--OWNER--REPO--SELECTOR/.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ModelNotFound
from engine.store.paths import locks_dir, models_dir, staging_dir

__all__ = ["HFRef", "parse_hf_ref", "quant_of", "match_quant", "MANIFEST", "Plan", "PlannedFile", "read_manifest"]

MANIFEST = "manifest.json"
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# Quant names as llama.cpp's quantizer and the common repos write them in file names: Q4_K_M, Q8_0, Q4_0_4_4,
# IQ4_XS, IQ2_XXS, TQ1_0, F16, BF16, MXFP4, and the dynamic quants' UD- names (Unsloth: UD-Q2_K_XL, UD-IQ1_M...).
_QUANT = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|TQ\d_\d|BF16|F16|F32|MXFP4(?:_MOE)?))"
                    r"(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class HFRef:
    repo: str  # OWNER/REPO
    selector: str | None  # "Q4_K_M", "some/file.gguf", "safetensors", or None (decide from the listing)
    revision: str = "main"

    @property
    def kind(self) -> str | None:
        if self.selector is None:
            return None
        if self.selector == "safetensors":
            return "safetensors"
        return "file" if self.selector.lower().endswith(".gguf") else "quant"

    @property
    def name(self) -> str:
        """The reference in canonical form: what `cache` lists and `--model` takes."""
        rev = "" if self.revision == "main" else f"@{self.revision}"
        return f"hf:{self.repo}{rev}" + (f":{self.selector}" if self.selector else "")

    def with_selector(self, selector: str) -> HFRef:
        return HFRef(self.repo, selector, self.revision)

    def _key(self) -> str:
        assert self.selector is not None, "a reference without a selector has no place on disk"
        rev = "" if self.revision == "main" else f"@{self.revision}"
        return self.selector.replace("/", "--") + rev.replace("/", "--")

    @property
    def published_dir(self) -> Path:
        return models_dir() / "hf" / self.repo / self._key()

    @property
    def staging_dir(self) -> Path:
        return staging_dir() / f"hf--{self.repo.replace('/', '--')}--{self._key()}"

    @property
    def lock_path(self) -> Path:
        return locks_dir() / f"hf--{self.repo.replace('/', '--')}--{self._key()}.lock"


def parse_hf_ref(ref: str) -> HFRef:
    """Parse `hf:OWNER/REPO[@REV][:SELECTOR]`; ModelNotFound (one line, with the forms) when malformed."""
    body = ref.strip()[3:]
    repo_part, _, selector = body.partition(":")
    repo, _, revision = repo_part.partition("@")
    if not _REPO.match(repo) or (_ and not revision):
        raise ModelNotFound(f"{ref!r} is not a Hugging Face reference: use hf:OWNER/REPO[:QUANT | :FILE.gguf | "
                            f":safetensors]")
    selector = selector.strip() or None
    if selector is not None:
        if selector.lower() == "safetensors":
            selector = "safetensors"
        elif not selector.lower().endswith(".gguf"):
            if not _QUANT.fullmatch(selector):
                raise ModelNotFound(f"{ref!r}: {selector!r} is neither a quant name (Q4_K_M, Q8_0, ...), a .gguf "
                                    f"file nor 'safetensors'")
            selector = selector.upper()
        if ".." in selector.split("/"):
            raise ModelNotFound(f"{ref!r}: a file name may not contain '..'")
    return HFRef(repo, selector, revision or "main")


def quant_of(filename: str) -> str | None:
    """The quant a GGUF file name carries (the last one it names), upper-cased, or None."""
    found = _QUANT.findall(Path(filename).name)
    return found[-1].upper() if found else None


def match_quant(selector: str, quants) -> str | None:
    """The quant of `quants` (names quant_of gave) that `selector` names: itself, else the one name that differs
    only by the dynamic quants' UD- prefix (hf:unsloth/X:Q2_K_XL finds UD-Q2_K_XL, as Ollama's references do;
    a repo with both Q2_K_XL and UD-Q2_K_XL keeps them apart); None when there is no such one."""
    if selector in quants:
        return selector
    bare = selector.removeprefix("UD-")
    near = [q for q in quants if q.removeprefix("UD-") == bare]
    return near[0] if len(near) == 1 else None


def read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# A pull's plan: what hf.plan_pull decided and hf_download fetches (the manifest records it).


@dataclass(frozen=True)
class PlannedFile:
    path: str  # inside the repo
    size: int | None
    sha256: str | None  # the hub gives it for LFS files


@dataclass
class Plan:
    ref: HFRef  # with its selector decided
    commit: str  # files are fetched at this commit, so a resume never mixes revisions
    kind: str  # "gguf" or "safetensors"
    entry: str | None  # the file to load (first shard), None for safetensors
    files: list[PlannedFile] = field(default_factory=list)
    architecture: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)
