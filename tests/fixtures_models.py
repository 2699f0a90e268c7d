"""Model fixtures shared by the test suite (loaded by tests/conftest.py).

- ``smollm2_dir``: the real SmolLM2-135M-Instruct, converted once to a HF folder.
- ``tiny_model_dir``: a 2-layer random Llama with SmolLM2's real tokenizer.
- ``tiny_qwen2_dir``: the same shapes as Qwen2 (q/k/v bias).
- ``tiny_bytes_model_dir``: the tiny Llama made to write mostly non-ASCII tokens (parts
  of multi-byte characters, many of them invalid together), to cut replies inside
  characters.
- ``tiny_thinker_dir``: the tiny Llama (other weights) with a chat template that thinks:
  it declares ``<think>``/``</think>``, drops the reasoning of past replies, and its
  generation prompt opens the reasoning (as DeepSeek-R1's does), so every reply of the
  random model is reasoning.
- ``tiny_engine_config(model_dir, **overrides)``: a small CPU float32 ``EngineConfig``.

Random weights are drawn so that greedy decoding is not degenerate: the embedding
has std 1 and the projections std 4/sqrt(fan_in) (q and k 1/sqrt(fan_in), so that
attention is spread rather than one-hot). With a std 0.02 init the logits are so
flat that the top-1/top-2 gap is below 1e-3 on a few percent of steps; with this
one the median gap is about 1 and greedy output does not repeat one token.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.loader import ensure_default_model

TINY_SHAPES: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=49152,  # SmolLM2's tokenizer
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def tiny_engine_config(model_dir: Path | str, **overrides: Any) -> EngineConfig:
    """A small CPU float32 engine config for ``model_dir`` (256 blocks of 16 tokens,
    256-token steps); keyword arguments override any field."""
    fields: dict[str, Any] = dict(model=str(model_dir), dtype="float32", device="cpu", block_size=16,
                                  num_blocks=256, max_num_batched_tokens=256)
    fields.update(overrides)
    return EngineConfig(**fields)


def random_llama_state(config: Any, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights, HF names, for a transformers Llama/Qwen2 config.

    Biases (Qwen2's q/k/v) are nonzero so that a dropped bias shows in the logits.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, param in skeleton.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        shape = tuple(param.shape)
        if name.endswith("norm.weight"):
            # Near 1, not exactly 1, so a missing norm weight would change the output.
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            tensor = 0.5 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            tensor = torch.randn(shape, generator=gen)
        else:
            gain = 1.0 if ("q_proj" in name or "k_proj" in name) else 4.0
            tensor = gain * torch.randn(shape, generator=gen) / shape[1] ** 0.5
        state[name] = tensor.contiguous()
    return state


def build_tiny_model(folder: Path, architecture: str, tokenizer_dir: Path, seed: int = 0,
                     **config_overrides: Any) -> Path:
    """Write a tiny random ``architecture`` ("llama" or "qwen2") model with the
    tokenizer files of ``tokenizer_dir`` into ``folder``; returns ``folder``.

    ``config_overrides`` replace entries of ``TINY_SHAPES`` or add config fields
    (e.g. ``rope_scaling``, ``tie_word_embeddings=False``).
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig, Qwen2Config

    folder.mkdir(parents=True, exist_ok=True)
    fields = {**TINY_SHAPES, **config_overrides}
    config: LlamaConfig | Qwen2Config
    if architecture == "llama":
        config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"])
    elif architecture == "qwen2":
        config = Qwen2Config(**fields, architectures=["Qwen2ForCausalLM"], use_sliding_window=False)
    else:
        raise ValueError(f"unknown tiny architecture {architecture!r}")
    config.save_pretrained(folder)
    save_file(random_llama_state(config, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as a Hugging Face folder (converted on first use).

    Every model fixture depends on this one. ``make test-fast`` sets
    ``TESTS_WITHOUT_MODEL=1``, which makes it fail: a test that reaches a model without
    being marked ``model`` (see tests/conftest.py) shows up there instead of slowing it.
    """
    if os.environ.get("TESTS_WITHOUT_MODEL"):
        pytest.fail("this test needs a model: request a model fixture as an argument or mark it "
                    "@pytest.mark.model", pytrace=False)
    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, SmolLM2's tokenizer)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", smollm2_dir, seed=0)


NON_ASCII_GAIN = 3.0  # tiny_bytes_model_dir: how much longer the non-ASCII tokens' embeddings are


@pytest.fixture(scope="session")
def tiny_bytes_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny Llama with the (tied) embeddings of SmolLM2's 904 tokens that decode to
    non-ASCII text made ``NON_ASCII_GAIN`` times longer, so greedy replies are mostly
    such tokens: about a third of the cut points of a reply fall inside a character
    (valid ones: CJK, Cyrillic, Greek; and bytes that never form one)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-bytes"), "llama", smollm2_dir, seed=0)
    tok = AutoTokenizer.from_pretrained(folder)
    non_ascii = [i for i in range(len(tok)) if any(ord(c) >= 0x80 for c in tok.decode([i]))]
    state = load_file(str(folder / "model.safetensors"))
    state["model.embed_tokens.weight"][non_ascii] *= NON_ASCII_GAIN
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny model as Qwen2 (nonzero q/k/v biases), SmolLM2's tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", smollm2_dir, seed=1)



# A chat template that thinks (tiny_thinker_dir): ChatML, past replies without their
# reasoning, and a generation prompt that opens it.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_thinker_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama whose chat template thinks (``THINKING_TEMPLATE``); served, its
    model name is the folder's (``tiny-thinker0``), another model than ``tiny_model_dir``'s."""
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-thinker"), "llama", smollm2_dir, seed=3)
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
    return folder
