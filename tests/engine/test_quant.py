"""Weight-only int8 quantization (engine/models/quant.py) and the engine with it on."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.loader import load_model
from engine.models import quant
from engine.models.quant import Int8Weight, quantize_int8
from engine.outputs import GenerateRequest
from tests.engine_helpers import collect, first_divergence_is_a_near_tie, greedy


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_quantized_weight_is_within_half_a_step_of_the_original(scale_dtype):
    """With the scale as stored (bfloat16 scales are rounded before Q is chosen); a
    row's largest weights may also carry the scale's own rounding (2^-8 relative)."""
    w = torch.randn(33, 70, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 33)[:, None]
    q, scale = quantize_int8(w, scale_dtype)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (33,) and scale.dtype == scale_dtype
    assert q.abs().max() <= 127
    s = scale.float()[:, None]
    err = (q.float() * s - w).abs()
    slack = 0.0 if scale_dtype == torch.float32 else 2.0**-8
    assert (err <= s / 2 + slack * w.abs() + 1e-7).all()
    # every row uses (nearly) its whole range: its largest weight maps to about +-127
    assert (q.abs().amax(dim=1) >= 126).all()


def test_all_zero_row_quantizes_to_zero_with_a_finite_scale():
    w = torch.zeros(3, 8)
    w[1] = torch.arange(8.0)
    q, scale = quantize_int8(w)
    assert torch.isfinite(scale).all()
    assert (q[0] == 0).all() and (q[2] == 0).all()


def test_quantize_refuses_a_non_matrix():
    with pytest.raises(ValueError, match="2-D"):
        quantize_int8(torch.ones(2, 3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, quant.SMALL_BATCH_ROWS + 1, 40])
def test_int8_linear_matches_the_dequantized_matmul_on_both_kernels(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 64, generator=g)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    qw = Int8Weight.from_float(w, dtype)
    ref = (x.double() @ (qw.qweight.double() * qw.scale.double()[:, None]).T) + bias.double()
    y = qw.linear(x, bias)
    assert y.dtype == dtype and y.shape == (rows, 48)
    tol = 1e-4 if dtype == torch.float32 else 0.03
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_small_and_large_batch_kernels_agree_row_by_row():
    """The GEMV kernel (small batch) and the wide matmul (large batch) give the same
    row for the same input, up to summation order: a request's numbers do not depend
    on how many others share its step beyond rounding."""
    g = torch.Generator().manual_seed(3)
    qw = Int8Weight.from_float(torch.randn(96, 128, generator=g), torch.bfloat16)
    x = torch.randn(1, 128, generator=g).bfloat16()
    alone = qw.linear(x)
    crowd = qw.linear(torch.cat([x, torch.randn(quant.SMALL_BATCH_ROWS + 4, 128, generator=g).bfloat16()]))[:1]
    assert torch.allclose(alone.float(), crowd.float(), rtol=0.02, atol=0.02)


def test_wide_copy_is_kept_on_the_cpu_only_when_asked():
    w = torch.randn(8, 16)
    assert Int8Weight.from_float(w, torch.bfloat16).wide is not None  # CPU default
    slim = Int8Weight.from_float(w, torch.bfloat16, keep_wide=False)
    assert slim.wide is None
    assert slim.nbytes() == 8 * 16 + 8 * 2
    x = torch.randn(20, 16).bfloat16()  # above the small-batch rows: converts per call
    assert torch.allclose(slim.linear(x).float(), Int8Weight.from_float(w, torch.bfloat16).linear(x).float())


def test_int8_embedding_returns_the_dequantized_rows():
    w = torch.randn(100, 16)
    qw = Int8Weight.from_float(w, torch.float32)
    ids = torch.tensor([0, 7, 7, 99])
    rows = qw.embedding(ids)
    assert torch.allclose(rows, qw.qweight[ids].float() * qw.scale[ids, None])
    assert (rows - w[ids]).abs().max() <= qw.scale.max() / 2 + 1e-6


def test_engine_config_refuses_an_unknown_quantization_and_float16_activations():
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization="int3", dtype="bfloat16")
    with pytest.raises(ConfigError, match="float16"):  # x @ Q^T could pass float16's range
        EngineConfig(quantization="int8", dtype="float16")
    for dtype in ("bfloat16", "float32"):  # float32 activations run on the CPU kernels
        assert EngineConfig(quantization="int8", dtype=dtype).quantization == "int8"


def test_int8_linear_of_zero_rows_is_empty():
    """A step whose chunks all stop mid-prompt samples nothing: the LM head sees 0 rows."""
    qw = Int8Weight.from_float(torch.randn(8, 16), torch.bfloat16)
    assert qw.linear(torch.randn(0, 16).bfloat16()).shape == (0, 8)


def prompt_logits(folder, quantization: str | None, ids: list[int]) -> tuple[torch.Tensor, torch.nn.Module]:
    """Load ``folder`` in bfloat16 (int8 weights when ``quantization``), run one prefill of
    ``ids`` and return its logits at every position ([len(ids), vocab] float32) and the model."""
    from engine.forward_batch import ForwardBatch
    from engine.kv_cache import KVCache
    from engine.model_runner import make_attention_backend

    lm = load_model(EngineConfig(model=str(folder), device="cpu", dtype="bfloat16", quantization=quantization))
    blocks = max(8, -(-len(ids) // 16))
    kv = KVCache.allocate(lm.model_config, blocks, 16, torch.bfloat16, torch.device("cpu"))
    b = ForwardBatch.build(token_chunks=[ids], prefix_lens=[0], block_tables=[list(range(blocks))],
                           sample_mask=[True], block_size=16, device=torch.device("cpu"))
    b.logits_indices = torch.arange(len(ids))
    return lm.model(b, kv, make_attention_backend("torch", torch.device("cpu"))).float(), lm.model


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory, smollm2_dir):
    from tests.fixtures_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-untied"), "llama", smollm2_dir, seed=5,
                            tie_word_embeddings=False)


@pytest.mark.parametrize("which", ["tied llama", "qwen2 with biases", "untied llama"])
def test_quantized_model_replaces_every_projection_and_stays_close(which, tiny_model_dir, tiny_qwen2_dir,
                                                                   untied_dir):
    """Every projection becomes an Int8Weight (the tie kept, a separate LM head
    quantized on its own, biases and norms left in bfloat16), and the logits stay
    within int8's error of the bfloat16 model's."""
    folder = {"tied llama": tiny_model_dir, "qwen2 with biases": tiny_qwen2_dir, "untied llama": untied_dir}[which]
    ids = list(range(200, 260))
    ref, _ = prompt_logits(folder, None, ids)
    q8, m = prompt_logits(folder, "int8", ids)
    tied = which == "tied llama" or which == "qwen2 with biases"
    assert isinstance(m.embed, Int8Weight) and isinstance(m.lm_head, Int8Weight)
    assert (m.lm_head is m.embed) == tied
    for layer in m.layers:
        for w in (layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight, layer.mlp.down_weight):
            assert isinstance(w, Int8Weight) and w.qweight.dtype == torch.int8
        assert layer.attn_norm.weight.dtype == torch.bfloat16
        if which == "qwen2 with biases":
            assert layer.attn.qkv_bias is not None and layer.attn.qkv_bias.dtype == torch.bfloat16
    rel = (q8 - ref).norm() / ref.norm()
    assert rel < 0.05, rel  # int8 with per-row scales: about 1% here; a lost bias or scale is far above
    assert (q8.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_quantization_gets_its_own_prefix_cache_namespace(tiny_model_dir):
    """Cache namespaces (docs/acceptance.md#cache-namespaces): a quantized twin of the same files never shares KV
    with them."""
    base = load_model(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="bfloat16"))
    q8 = load_model(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="bfloat16", quantization="int8"))
    assert base.weights_id != q8.weights_id


def test_int8_smollm2_scores_text_like_its_bfloat16_weights(smollm2_dir):
    """The real model's mean log-likelihood of a text moves by under 0.05 nats with int8
    weights (against the same bfloat16 activations without them; llama.cpp's Q4_1 is
    within 0.03 of float32 here) and its greedy next token agrees on most positions."""

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok("Paris is the capital of France, and Berlin is the capital of Germany. Water boils at "
              "100 degrees Celsius at sea level, and ice melts at zero. The Earth goes around the Sun once a "
              "year and turns on its axis once a day, which gives us night and day. Plants take in carbon "
              "dioxide and water and, with the energy of sunlight, make sugar and release oxygen. The heart "
              "pumps blood through the body; the lungs bring oxygen into it. A triangle has three sides, a "
              "square has four, and the angles of a triangle add up to 180 degrees.")["input_ids"]
    ref, q8 = prompt_logits(smollm2_dir, None, ids)[0], prompt_logits(smollm2_dir, "int8", ids)[0]
    target = torch.tensor(ids[1:])[:, None]
    nll = [-torch.log_softmax(x[:-1].double(), -1).gather(1, target).mean().item() for x in (ref, q8)]
    assert abs(nll[0] - nll[1]) < 0.05
    assert (ref.argmax(-1) == q8.argmax(-1)).float().mean() >= 0.85


async def test_int8_greedy_output_does_not_depend_on_its_neighbours(tiny_model_dir, tiny_tok, start_engine):
    """Batch-invariant greedy output with int8 weights: the prompt alone runs on the small-batch kernel,
    beside 14 others on the wide one; the texts agree up to a near-tie."""
    eng = start_engine(tiny_model_dir, dtype="bfloat16", quantization="int8", num_blocks=1024)
    rng = random.Random(2)
    p_ids = tiny_tok("Explain in three sentences why the sky appears blue.")["input_ids"]
    async def solo(tag):
        c = await collect(eng, GenerateRequest(tag, p_ids, params=greedy(20, logprobs=2)))
        c.final.logprobs_all = [lp for d in c.deltas for lp in (d.logprobs or [])]
        return c.final

    ref = await solo("alone")
    assert (await solo("alone-again")).output_token_ids == ref.output_token_ids

    async def neighbour(k):
        ids = [rng.randrange(100, 40000) for _ in range(rng.randrange(5, 60))]
        return await collect(eng, GenerateRequest(f"n{k}", ids, params=greedy(30)))

    outs = await asyncio.gather(solo("crowded"), *(neighbour(k) for k in range(quant.SMALL_BATCH_ROWS + 2)))
    assert first_divergence_is_a_near_tie(ref, outs[0], eps=0.05)


async def test_int8_engine_runs_a_prompt_longer_than_one_step(tiny_model_dir, start_engine):
    """A 300-token prompt with 64-token steps: the first steps only prefill (their LM head
    sees no rows), then the request decodes to the end."""
    eng = start_engine(tiny_model_dir, dtype="bfloat16", quantization="int8", max_num_batched_tokens=64)
    out = await collect(eng, GenerateRequest("long", list(range(300, 600)), params=greedy(5)))
    assert out.final.finish_reason == "length" and len(out.token_ids) == 5
