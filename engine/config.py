"""Typed configuration: the model's shapes (from its HF config) and the engine's settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import ConfigError, ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

# engine roles of prefill/decode disaggregation (docs/scaling.md)
ROLES = ("both", "prefill", "decode")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder, read from a transformers config.

    All sizes are element counts; ``max_model_len`` is in tokens.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_model_len: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a ``transformers.PretrainedConfig`` of a Llama-family model.

        Raises:
            ModelLoadError: the architecture is not one this engine implements.
        """
        archs = list(getattr(hf_config, "architectures", None) or [])
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "mistral": "MistralForCausalLM"}.get(hf_config.model_type, "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch or hf_config.model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope_scaling = getattr(hf_config, "rope_scaling", None)
        rope_theta = getattr(hf_config, "rope_theta", None)
        rope_params = getattr(hf_config, "rope_parameters", None)  # transformers >= 5
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_model_len=int(getattr(hf_config, "max_position_embeddings", 2048)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)) or arch == "Qwen2ForCausalLM",
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )


@dataclass
class EngineConfig:
    """Settings of one engine instance, validated on construction.

    Attributes:
        model: a local Hugging Face folder, a ``.gguf`` file, or None for the bundled
            SmolLM2-135M-Instruct.
        dtype: "auto", "float32", "bfloat16" or "float16": activations, and the weights
            unless ``quantization`` is set. "auto" and the other "auto" formats are
            resolved per device by ``engine.formats.resolve_format``.
        device: "cpu", "cuda" or "cuda:N"; "auto" picks cuda when torch sees one.
        block_size: tokens per KV block (>= 1).
        num_blocks: KV blocks in the pool; None sizes it from ``kv_cache_bytes`` (CPU)
            or ``gpu_memory_fraction`` of free device memory (GPU).
        kv_cache_bytes: CPU KV budget in bytes when ``num_blocks`` is None; None follows
            the free host memory (``engine.kv_cache.default_cpu_kv_bytes``: half of what is
            available after the weights are loaded, at most 8 GiB, at least 256 MiB).
        gpu_memory_fraction: fraction of free GPU memory for KV when on CUDA.
        max_model_len: context limit in tokens; None takes the model's.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: most requests running at once.
        enable_prefix_cache: reuse KV of matching prefixes through the radix tree.
        schedule_policy: "fcfs" or "lpm" (longest prefix match first).
        attention_backend: "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton".
        cache_dir: where converted default-model weights are kept.
        threads: torch intra-op threads on CPU (None leaves torch's default).
        seed: seed of the engine's generator for unseeded sampled requests.
        quantization: "auto", None (or "none": weights in ``dtype``), "int8": weight-only
            int8 with one scale per output row, or "int4" / "int4-sym": 4-bit weights in
            groups of 32 with a scale and an offset (a scale only) per group, on the CPU kernels
            (``engine.models.quant``).
        kv_cache_dtype: "auto" or a dtype name: the KV cache's element type.
        cpu_kernels: use the engine's CPU kernels (``engine/cpu``) where the format allows
            (float32 activations over quantized weights); False keeps torch's ops (the
            reference the kernels are tested against).
        cpu_isa: the instruction set the CPU kernels are built for: "auto" (the best the
            CPU lists) or one of ``engine.cpu.build.ISAS`` ("avx2" runs the AVX2-only
            machines' paths on an AVX-512 one).
        speculative: "auto" (n-gram speculation on the CPU, off elsewhere), "ngram" or
            "off" (``engine.spec``; it never changes the output, only the speed).
        num_draft_tokens: most draft tokens verified per request per step.
        spec_ngram_min, spec_ngram_max: n-gram sizes matched against the request's tokens.
        spec_max_batch: speculate only while at most this many requests decode in a step.
        role: "both" (prefill and decode, the default), "prefill" (every request stops
            after its first token: the engine computes prompts' KV for a decode engine to
            pull) or "decode" (serves replies; pulls a prompt's pages from the engine a
            request names, ``engine.disagg``). Prefill/decode disaggregation, docs/scaling.md.
        kv_pull_failure: what a request does when pulling its prompt's pages fails
            (a corrupt page, a cut link, pages gone at the source): "local" computes the
            missing pages itself, "fail" ends the request with error ``kv_transfer_failed``.
        kv_pull_timeout_s: the longest one pull of pages may take (seconds).
        kv_disk_dir: the disk KV tier's store directory (``engine.tiers``): pages of the
            prefix cache are written there and restored from it, across evictions and
            restarts; None turns the tier off (``python -m engine serve`` defaults it on,
            to ``engine.tiers.disk.default_disk_dir()``).
        kv_disk_write: when the disk tier writes a page: "through" (as it enters the
            radix tree), "back" (when the pool evicts it; pages never evicted are not on
            disk after a restart) or "idle" (as "back", plus the tree's pages while the
            engine has nothing to run and at a graceful stop). docs/kv_tiers.md has the
            measurement that chose the default.
        kv_disk_bytes: the most bytes the disk tier keeps; None follows
            ``engine.tiers.disk.default_disk_bytes`` (8 GiB, at most half the free disk).
        kv_host: the host-memory KV tier beneath the pool and above the disk
            (``engine.tiers.host``): "auto" (on when the pool is on a CUDA device, off on
            the CPU, where the pool already lives in host memory), "on" or "off". It also
            takes the "through"/"back" of ``kv_disk_write``: with "back", pages reach it
            when the pool evicts them and reach the disk when it evicts them.
        kv_host_bytes: the host tier's size in bytes; None follows
            ``engine.tiers.host.default_host_bytes`` (twice the pool, at most half the
            host memory available).

    Raises:
        ConfigError: a setting is out of range or unknown (from ``__post_init__``).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.85
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_cache: bool = True
    schedule_policy: str = "fcfs"
    attention_backend: str = "auto"
    cache_dir: str | None = None
    threads: int | None = None
    seed: int = 0
    cuda_graphs: bool = True
    quantization: str | None = "auto"
    kv_cache_dtype: str = "auto"
    cpu_kernels: bool = True
    cpu_isa: str = "auto"
    speculative: str = "auto"
    num_draft_tokens: int = 8
    spec_ngram_min: int = 2
    spec_ngram_max: int = 3
    spec_max_batch: int = 4
    role: str = "both"
    kv_pull_failure: str = "local"
    kv_pull_timeout_s: float = 30.0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int | None = None
    kv_disk_write: str = "through"
    kv_host: str = "auto"
    kv_host_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES:
            raise ConfigError(f"kv_cache_dtype must be 'auto' or one of {list(DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks must be >= 1")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ConfigError("schedule_policy must be 'fcfs' or 'lpm'")
        if self.attention_backend not in ("auto", "torch", "triton", "cpu"):
            raise ConfigError("attention_backend must be 'auto', 'torch', 'triton' or 'cpu'")
        if self.quantization not in (None, "none", "auto", "int8", "int4", "int4-sym"):
            raise ConfigError(f"quantization must be 'auto', 'int8', 'int4', 'int4-sym' or 'none', "
                              f"got {self.quantization!r}")
        if self.cpu_isa not in ("auto", "portable", "avx2", "avxvnni", "avx512"):
            raise ConfigError(f"cpu_isa must be 'auto', 'portable', 'avx2', 'avxvnni' or 'avx512', "
                              f"got {self.cpu_isa!r}")
        if self.quantization in ("int8", "int4", "int4-sym") and self.dtype == "float16":
            # x @ Q^T over integer-valued weights can pass float16's 65504 before the scale.
            raise ConfigError(f"{self.quantization} weights compute in bfloat16 or float32, not float16")
        if self.speculative not in ("auto", "ngram", "off"):
            raise ConfigError(f"speculative must be 'auto', 'ngram' or 'off', got {self.speculative!r}")
        if self.num_draft_tokens < 1 or self.spec_max_batch < 1 or not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            raise ConfigError("num_draft_tokens and spec_max_batch must be >= 1, and "
                              "1 <= spec_ngram_min <= spec_ngram_max")
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {list(ROLES)}, got {self.role!r}")
        if self.kv_pull_failure not in ("local", "fail"):
            raise ConfigError(f"kv_pull_failure must be 'local' or 'fail', got {self.kv_pull_failure!r}")
        if not self.kv_pull_timeout_s > 0:
            raise ConfigError("kv_pull_timeout_s must be > 0")
        if self.kv_disk_write not in ("through", "back", "idle"):
            raise ConfigError(f"kv_disk_write must be 'through', 'back' or 'idle', got {self.kv_disk_write!r}")
        if self.kv_host not in ("auto", "on", "off"):
            raise ConfigError(f"kv_host must be 'auto', 'on' or 'off', got {self.kv_host!r}")
        if self.kv_host_bytes is not None and self.kv_host_bytes < 1:
            raise ConfigError("kv_host_bytes must be >= 1")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ConfigError("kv_cache_bytes must be >= 1")
        if self.kv_disk_bytes is not None and self.kv_disk_bytes < 1:
            raise ConfigError("kv_disk_bytes must be >= 1")
        if not (0 < self.gpu_memory_fraction <= 1):
            raise ConfigError("gpu_memory_fraction must be in (0, 1]")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by ``dtype``.

        Raises:
            ConfigError: ``dtype`` is still "auto" (resolve the config first).
        """
        if self.dtype == "auto":
            raise ConfigError("dtype 'auto' is not resolved yet (engine.formats.resolved_config)")
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's torch dtype (``dtype``'s when ``kv_cache_dtype`` is "auto")."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else DTYPES[self.kv_cache_dtype]

    def resolved_device(self) -> torch.device:
        """``device`` with "auto" resolved (cuda when available, else cpu)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
