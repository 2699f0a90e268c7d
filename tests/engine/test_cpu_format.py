"""The CPU serving format (engine/formats.py): which format "auto" picks, and that the
kernel path (int8 or 4-bit weights, float32 activations, bfloat16 KV on engine/cpu's kernels)
computes what the torch reference computes on the same weights, that its fused layers
equal its per-op kernels bit for bit, that its greedy output does not depend on the
batch, the cache or the prefill chunking at all, and that on the real model it scores
text like the float32 weights."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.cpu.ops import cpu_kernels
from engine.errors import ConfigError
from engine.formats import resolve_format, resolved_config
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.model_runner import make_attention_backend, make_layer_runner
from engine.outputs import GenerateRequest
from tests.engine_helpers import collect, greedy, make_engine

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels did not build (no C compiler)")


def test_auto_picks_int4_float32_bfloat16_kv_on_the_cpu_kernels_and_float32_alone_is_exact():
    fmt = resolve_format(EngineConfig(device="cpu"))
    assert (fmt.dtype, fmt.quantization, fmt.kv_cache_dtype, fmt.cpu_kernels) == ("float32", "int4", "bfloat16", True)
    assert "int4 weights, float32 activations, bfloat16 KV (CPU kernels)" == fmt.describe()
    exact = resolve_format(EngineConfig(device="cpu", dtype="float32"))
    assert exact.exact and exact.quantization is None and exact.kv_cache_dtype == "float32"
    assert resolve_format(EngineConfig(device="cpu", quantization="int8")).dtype == "float32"
    assert resolve_format(EngineConfig(device="cpu", dtype="bfloat16", quantization="int8")).cpu_kernels is False
    assert resolve_format(EngineConfig(device="cpu", quantization="none")).quantization is None
    gpu = resolve_format(EngineConfig(device="cuda"))
    assert (gpu.dtype, gpu.quantization, gpu.kv_cache_dtype, gpu.cpu_kernels) == ("bfloat16", None, "bfloat16", False)
    with pytest.raises(ConfigError, match="KV"):  # torch's ops need one dtype throughout
        resolve_format(EngineConfig(device="cpu", dtype="float32", quantization="none", kv_cache_dtype="bfloat16"))
    concrete, _ = resolved_config(EngineConfig(device="cpu"))
    assert (concrete.dtype, concrete.quantization, concrete.kv_cache_dtype) == ("float32", "int4", "bfloat16")


def prefill_and_decode_logits(folder, ids: list[int], decode: list[int], **overrides) -> torch.Tensor:
    """Logits of a prefill of ``ids`` then one decode step per token of ``decode``, over a
    shuffled block table; [len(ids) + len(decode), vocab] float64."""
    cfg, _ = resolved_config(EngineConfig(model=str(folder), device="cpu", **overrides))
    lm = load_model(cfg)
    bs = 16
    total = len(ids) + len(decode)
    blocks = -(-total // bs) + 4
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).tolist()
    kv = KVCache.allocate(lm.model_config, blocks, bs, cfg.kv_torch_dtype, "cpu")
    attn = make_attention_backend(cfg.attention_backend, torch.device("cpu"), lm.cpu_kernels)
    layers = make_layer_runner(lm.model, kv, attn, lm.cpu_kernels)  # as the engine runs them
    rows = []
    b = ForwardBatch.build(token_chunks=[ids], prefix_lens=[0], block_tables=[table], sample_mask=[True],
                           block_size=bs)
    b.logits_indices = torch.arange(len(ids))
    rows.append(lm.model(b, kv, attn, layers))
    for i, tok in enumerate(decode):
        b = ForwardBatch.build(token_chunks=[[tok]], prefix_lens=[len(ids) + i], block_tables=[table],
                               sample_mask=[True], block_size=bs)
        rows.append(lm.model(b, kv, attn, layers))
    return torch.cat(rows).double()


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory, smollm2_dir):
    from tests.fixtures_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-untied-cpu"), "llama", smollm2_dir, seed=5,
                            tie_word_embeddings=False)


@pytest.mark.parametrize("which", ["tied llama", "qwen2 with biases", "untied llama"])
def test_kernel_path_computes_what_torch_computes_on_the_same_int8_weights(which, tiny_model_dir, tiny_qwen2_dir,
                                                                          untied_dir):
    """Same int8 weights, float32 KV in both: only the kernels' int16 rounding of the
    activations and their summation order differ from torch's float32 ops."""
    folder = {"tied llama": tiny_model_dir, "qwen2 with biases": tiny_qwen2_dir, "untied llama": untied_dir}[which]
    ids, decode = list(range(300, 340)), [7, 900, 31, 5000]
    ref = prefill_and_decode_logits(folder, ids, decode, dtype="float32", quantization="int8", cpu_kernels=False)
    ours = prefill_and_decode_logits(folder, ids, decode, dtype="float32", quantization="int8",
                                     kv_cache_dtype="float32")
    assert ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("quant", ["int4", "int4-sym"])
def test_kernel_path_computes_what_torch_computes_on_the_same_int4_weights(quant, tiny_qwen2_dir):
    """4-bit weights: the kernels (int8 activation blocks, integer products, fused
    layers) against torch's float32 ops over the same dequantized weights (the kernel's
    own arithmetic is checked exactly in test_cpu_int4.py)."""
    ids, decode = list(range(300, 340)), [7, 900, 31, 5000]
    ref = prefill_and_decode_logits(tiny_qwen2_dir, ids, decode, dtype="float32", quantization=quant,
                                    cpu_kernels=False)
    ours = prefill_and_decode_logits(tiny_qwen2_dir, ids, decode, dtype="float32", quantization=quant,
                                     kv_cache_dtype="float32")
    # int8 activations (1/254 of each block's range) through every layer of a random model
    assert ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.1
    assert (ours.argmax(-1) == ref.argmax(-1)).double().mean() >= 0.9


def test_the_forced_avx2_engine_computes_what_the_best_isa_computes(tiny_model_dir):
    """The AVX2-only machines' kernels, forced here (cpu_isa "avx2"), give the same logits
    as the best build this CPU runs, on the default format (4-bit weights)."""
    from engine.cpu.build import best_isa

    if best_isa() in ("portable", "avx2"):
        pytest.skip("this CPU runs no build above AVX2")
    ids, decode = list(range(300, 340)), [7, 900, 31]
    best = prefill_and_decode_logits(tiny_model_dir, ids, decode)
    avx2 = prefill_and_decode_logits(tiny_model_dir, ids, decode, cpu_isa="avx2")
    assert torch.allclose(best, avx2, rtol=1e-4, atol=1e-4)
    assert torch.equal(best.argmax(-1), avx2.argmax(-1))


def test_the_load_log_names_the_instruction_set_the_kernels_run(tiny_model_dir, caplog):
    """A forced ``cpu_isa`` shows in the start-up log line, so a benchmark of the AVX2 build
    on a better CPU can be checked to have run it."""
    from engine.cpu.build import best_isa

    if best_isa() == "portable":
        pytest.skip("this CPU runs no SIMD build")
    cfg, _ = resolved_config(EngineConfig(model=str(tiny_model_dir), device="cpu", cpu_isa="avx2"))
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        load_model(cfg)
    assert "kernels built for avx2" in caplog.text


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_fused_layers_equal_the_per_op_kernels_bit_for_bit(quant, tiny_qwen2_dir):
    """One C call per layer (engine/cpu/fused.py, the layer runner the model runner picks
    on the kernels) runs the same kernels in the same order as the model's per-op path,
    so the logits are identical, not just close."""
    from engine.cpu.fused import FusedLayers

    cfg, _ = resolved_config(EngineConfig(model=str(tiny_qwen2_dir), device="cpu", quantization=quant))
    lm = load_model(cfg)
    ids = list(range(500, 530))

    def logits(fuse: bool) -> torch.Tensor:
        kv = KVCache.allocate(lm.model_config, 8, 16, cfg.kv_torch_dtype, "cpu")
        attn = make_attention_backend("cpu", torch.device("cpu"), lm.cpu_kernels)
        layers = make_layer_runner(lm.model, kv, attn, lm.cpu_kernels)
        assert isinstance(layers, FusedLayers)
        b = ForwardBatch.build(token_chunks=[ids, [3]], prefix_lens=[0, 0], block_tables=[[0, 1], [2]],
                               sample_mask=[True, True], block_size=16)
        b.logits_indices = torch.arange(31)
        return lm.model(b, kv, attn, layers if fuse else None)

    fused, per_op = logits(True), logits(False)
    assert torch.equal(fused, per_op)


def test_the_model_does_not_import_the_cpu_executor():
    """The model runner picks the layer runner; the model module stays free of it (no
    import circle between engine/models and engine/cpu/fused.py)."""
    import subprocess
    import sys

    code = "import sys, engine.models.llama; sys.exit('engine.cpu.fused' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


async def test_kernel_engine_greedy_output_is_the_same_alone_in_a_crowd_chunked_and_cache_off(tiny_model_dir):
    """The strict determinism policy holds on the kernel path: every row is computed alone
    (linear, norms, attention chunks), so a prompt's greedy tokens are identical decoded
    alone, beside 12 other requests, with its prompt prefilled 16 tokens a step, and with
    the prefix cache off (its turn-1 KV computed in prefill instead of decode)."""
    rng = random.Random(4)
    prompt = [rng.randrange(200, 40000) for _ in range(90)]

    async def run(tag: str, neighbours: int = 0, **overrides) -> list[int]:
        eng = make_engine(tiny_model_dir, dtype="auto", quantization="auto", num_blocks=1024, **overrides)
        eng.start()
        try:
            assert eng.core.runner.attn.name == "cpu"
            others = [collect(eng, GenerateRequest(f"n{k}", [rng.randrange(200, 40000) for _ in range(
                rng.randrange(5, 300))], params=greedy(40))) for k in range(neighbours)]
            first, *_ = await asyncio.gather(collect(eng, GenerateRequest(tag, prompt, params=greedy(48))), *others)
            # a second turn: the first turn's reply is in the cache (or, cache off, recomputed)
            second = await collect(eng, GenerateRequest(tag + "2", prompt + first.token_ids + [11, 12],
                                                        params=greedy(24)))
            return first.token_ids + second.token_ids
        finally:
            eng.shutdown()

    alone = await run("alone")
    assert await run("crowd", neighbours=12) == alone
    assert await run("chunked", max_num_batched_tokens=16) == alone
    assert await run("nocache", enable_prefix_cache=False) == alone


@pytest.mark.slow
def test_default_cpu_format_scores_text_like_float32_and_answers_like_it(smollm2_dir):
    """The real model: the default format moves the mean log-likelihood of a text by under
    0.03 nats against the exact float32 model, and agrees with it on the next token at
    most positions."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = ("Paris is the capital of France, and Berlin is the capital of Germany. Water boils at "
            "100 degrees Celsius at sea level, and ice melts at zero. The Earth goes around the Sun once a "
            "year and turns on its axis once a day, which gives us night and day. Plants take in carbon "
            "dioxide and water and, with the energy of sunlight, make sugar and release oxygen. The heart "
            "pumps blood through the body; the lungs bring oxygen into it. A triangle has three sides, a "
            "square has four, and the angles of a triangle add up to 180 degrees.")
    ids = tok(text)["input_ids"]
    ref = prefill_and_decode_logits(smollm2_dir, ids[:-8], ids[-8:], dtype="float32")
    ours = prefill_and_decode_logits(smollm2_dir, ids[:-8], ids[-8:])
    target = torch.tensor(ids[1:])[:, None]
    nll = [-torch.log_softmax(x[:-1], -1).gather(1, target).mean().item() for x in (ref, ours)]
    assert abs(nll[0] - nll[1]) < 0.03
    assert (ref.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.85


@pytest.mark.slow
def test_default_cpu_format_gives_greedy_answers_like_float32(smollm2_dir):
    """The real model on short chat prompts (``bench/decode_step.py --quality --agreement``'s
    set): scored along the exact model's own greedy answers, the default format picks the
    same top-1 token at 93% or more of the positions and stays within a mean KL of 0.02 nats
    of its distributions. A mean log-likelihood bar alone let a default through whose
    answers drifted (e.g. "What is the capital of France?" answered in French)."""
    from transformers import AutoTokenizer

    from bench.decode_step import AGREEMENT_PROMPTS, greedy_tokens

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False))
               for q in AGREEMENT_PROMPTS[:16]]
    ref_lp: list[torch.Tensor] = []
    lp: list[torch.Tensor] = []
    ref = greedy_tokens(str(smollm2_dir), {"dtype": "float32", "quantization": "none"}, prompts, 16, logprobs=ref_lp)
    ours = greedy_tokens(str(smollm2_dir), {}, prompts, 16, forced=ref, logprobs=lp)
    same = sum(a == b for o, r in zip(ours, ref) for a, b in zip(o, r)) / (len(ref) * 16)
    kl = torch.stack([(r.exp() * (r - q)).sum(-1) for r, q in zip(ref_lp, lp)]).mean().item()
    assert same >= 0.93, f"same top-1 as float32 at {same:.1%} of the positions"
    assert kl < 0.02, f"mean KL {kl:.4f} nats"
