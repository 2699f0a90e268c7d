"""Finding, streaming and fingerprinting the weight files of a Hugging Face folder."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.errors import ModelLoadError


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint files of ``folder``, in load order.

    Preference: the safetensors index's shards, ``model.safetensors``, other
    ``model*.safetensors`` shards, then the same for PyTorch ``.bin`` files. Stray
    files beside them (Mistral's ``consolidated.safetensors``) are not read.

    Raises:
        ModelLoadError: no weight file, or an index naming a file that is absent.
    """
    layouts = (("model.safetensors.index.json", "model.safetensors", "model*.safetensors"),
               ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin"))
    for index_name, single, shard_glob in layouts:
        index = folder / index_name
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError) as exc:
                raise ModelLoadError(f"unreadable weight index {index}: {exc}") from exc
            files = [folder / n for n in names]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise ModelLoadError(f"weight files listed in {index_name} are missing: {', '.join(absent)}")
            return files
        if (folder / single).is_file():
            return [folder / single]
        shards = sorted(folder.glob(shard_glob))
        if shards:
            return shards
    raise ModelLoadError(f"no weights in {folder} (expected model.safetensors or pytorch_model.bin)")


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one tensor at a time, on the CPU in the file's dtype.

    safetensors files are memory-mapped, so only the tensor being copied is read.

    Raises:
        ModelLoadError: a file that cannot be parsed.
    """
    from safetensors import safe_open

    for path in files:
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            else:
                yield from _load_bin(path).items()
        except (OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"cannot read weights from {path}: {exc}") from exc


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch checkpoint, memory-mapped when its format allows (zip, torch >= 1.6)."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # legacy (non-zip) pickles cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def weights_fingerprint(files: list[Path], dtype: torch.dtype, quantization: str | None = None,
                        kv_cache_dtype: str | None = None) -> str:
    """A stable id of these weights: sha256 over each file's resolved path, size and
    mtime (ns), the load dtype, the quantization (None: none) and the KV cache's dtype
    when it differs from the load dtype; 16 hex digits.

    Rewriting or replacing a file changes its mtime, so a reload of different weights
    under the same model name gets a new id (the prefix cache's namespace; docs/acceptance.md,
    cache namespaces) without hashing gigabytes.
    """
    h = hashlib.sha256(str(dtype).encode())
    if quantization:  # a quantized twin computes different logits: its own namespace
        h.update(f"\0quantization={quantization}".encode())
    if kv_cache_dtype and kv_cache_dtype != str(dtype).removeprefix("torch."):  # cached K/V differ too
        h.update(f"\0kv={kv_cache_dtype}".encode())
    for path in files:
        st = path.stat()
        h.update(f"\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]
