"""Random-weight models of real shapes, built from a config (no weights carried).

Used by the GPU benchmark, where the working tree cannot carry real weights: the
engine's speed depends on shapes and dtype, not on the values of the weights.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

SHAPES = {
    # Llama-3-8B: 32 layers, 32 heads, 8 KV heads, head_dim 128, hidden 4096, MLP 14336.
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # SmolLM2-135M's shapes.
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
}


class ByteTokenizer:
    """A stand-in tokenizer for random models: id i decodes to byte (i mod 94) + 33.

    Enough for the engine's detokenizer (``decode``, ``convert_ids_to_tokens``,
    special-id sets); prompts are given as token ids.
    """

    all_special_ids: list[int] = []
    added_tokens_decoder: dict = {}
    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(chr(33 + int(i) % 94) for i in ids)

    def convert_ids_to_tokens(self, i):
        return chr(33 + int(i) % 94)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def hf_config(name: str):
    """A transformers LlamaConfig with the named shapes.

    Raises:
        KeyError: unknown shape name (see ``SHAPES``).
    """
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SHAPES[name], bos_token_id=None, eos_token_id=None)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


@torch.no_grad()
def random_loaded_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Our model with the named shapes and random weights, as an ``engine.loader.LoadedModel``."""
    from engine.config import ModelConfig
    from engine.formats import ServingFormat
    from engine.loader import LoadedModel
    from engine.models import model_class_for

    cfg = hf_config(name)
    mc = ModelConfig.from_hf(cfg)
    torch.manual_seed(seed)
    model = model_class_for(mc.architecture)(mc, dtype, device)
    for _, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # norms
        else:
            p.normal_(0.0, 0.02)
    wid = hashlib.sha1(f"random:{name}:{seed}:{dtype}".encode()).hexdigest()[:16]
    name_of = str(dtype).removeprefix("torch.")
    fmt = ServingFormat(dtype=name_of, quantization=None, kv_cache_dtype=name_of, cpu_kernels=False)
    return LoadedModel(model=model.eval(), model_config=mc, hf_config=cfg, tokenizer=ByteTokenizer(),
                       name=f"random-{name}", path=Path("."), weights_id=wid, dtype=dtype, device=device,
                       format=fmt)


@torch.no_grad()
def random_hf_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """transformers' LlamaForCausalLM with the same shapes and random weights (the peer)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        m = LlamaForCausalLM(hf_config(name)).to(dtype)
    return m.eval()
