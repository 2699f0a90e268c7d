"""Model implementations, looked up by the ``architectures`` name of a transformers config."""

from __future__ import annotations

from engine.config import SUPPORTED_ARCHITECTURES
from engine.errors import ModelLoadError
from engine.models.llama import LlamaForCausalLM

# Architecture name (config.json "architectures"[0]) -> our implementation. Qwen2 differs
# from Llama only by the q/k/v bias, Mistral (within its window) not at all.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = dict.fromkeys(SUPPORTED_ARCHITECTURES, LlamaForCausalLM)


def model_class_for(architecture: str) -> type[LlamaForCausalLM]:
    """The class implementing ``architecture``.

    Raises:
        ModelLoadError: no implementation is registered under that name.
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "model_class_for"]
