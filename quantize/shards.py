"""Streaming I/O of the quantizer: read a checkpoint's tensors lazily by canonical name from its
memory-mapped safetensors files, and write a bundle's tensors as size-capped safetensors shards
(one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
in the Hugging Face sharding convention).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from edgevlm.runtime.bundle import INT4_LAYOUT
from edgevlm.runtime.loader import ModelFiles, canonical_key


class CheckpointReader:
    """Tensor names of a checkpoint, read lazily from its memory-mapped safetensors files."""

    def __init__(self, files: ModelFiles) -> None:
        from safetensors import safe_open

        self.files = files
        self.file_of: dict[str, Path] = {}
        self.src_of: dict[str, str] = {}  # canonical name -> source key
        for path in files.weight_files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    self.file_of[key] = path
                    name = canonical_key(key, files)
                    if name is not None:
                        self.src_of[name] = key
        self.written: set[str] = set()  # canonical names already in the bundle

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Canonical names -> tensors (one safe_open per file; mappings closed on return)."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file_of[self.src_of[n]], []).append(n)
        out = {}
        for path, group in by_file.items():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for n in group:
                    out[n] = f.get_tensor(self.src_of[n])
        return out

    def names_under(self, prefix: str) -> list[str]:
        return [n for n in self.src_of if n.startswith(prefix)]

    def source_name(self, canonical: str) -> str:
        """Source key for a canonical tensor name, also for INT4 names (``.qweight`` etc.)."""
        if canonical in self.src_of:
            return self.src_of[canonical]
        module, _, param = canonical.rpartition(".")
        return self.src_of[module + ".weight"][: -len("weight")] + param


class ShardWriter:
    """Accumulate tensors and write safetensors shards of at most ``max_bytes`` (then an index):
    ``<stem>.safetensors``, or ``<stem>-0000i-of-0000n.safetensors`` (+ ``<stem>.safetensors.index.json``
    when ``index``); ``metadata`` replaces the files' header metadata."""

    def __init__(self, out_dir: Path, max_bytes: int, *, stem: str = "model", index: bool = True,
                 metadata: dict[str, str] | None = None) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.stem, self.index = stem, index
        self.metadata = metadata or {"format": "pt", "edgevlm_int4_layout": INT4_LAYOUT}
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.bytes_by_name: dict[str, int] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous().clone()
        self.pending[name] = t
        self.bytes_by_name[name] = t.numel() * t.element_size()
        self.pending_bytes += self.bytes_by_name[name]
        if self.pending_bytes >= self.max_bytes:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.out_dir / f"shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, str(path), metadata=self.metadata)
        path.chmod(0o644)
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        self._flush()
        n = len(self.shards)
        if n == 1:
            (self.out_dir / "shard-00000.safetensors").rename(self.out_dir / f"{self.stem}.safetensors")
            return [f"{self.stem}.safetensors"]
        weight_map, names = {}, []
        for i, keys in enumerate(self.shards):
            name = f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out_dir / f"shard-{i:05d}.safetensors").rename(self.out_dir / name)
            weight_map.update({k: name for k in keys})
            names.append(name)
        if self.index:
            index = {"metadata": {"total_size": sum(self.bytes_by_name.values())}, "weight_map": weight_map}
            (self.out_dir / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names
