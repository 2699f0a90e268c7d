"""Our Llama-family forward over the paged cache against transformers' own forward.

Reference: ``AutoModelForCausalLM`` loaded from the same folder, eager attention,
float32, run on each whole sequence at once. Ours runs the same tokens as a
serving engine would: a flat batch of several requests, whole prefills, chunked
prefills after a cached prefix, and one-token decode steps, with the KV blocks of
each request scattered over the pool in random order.

Tolerance (float32): max |ours - ref| <= 1e-4 * max |ref| per compared block of
logits. Both sides round at float32's 1.2e-7 per operation, in a different order
(fused QKV and gate/up matmuls, SDPA instead of matmul-softmax-matmul); the gap
seen is about 1e-6 of the logits' scale. 1e-4 leaves a 100x margin, while a wrong
position, mask, block or bias moves logits by a sizeable fraction of their scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.loader import LoadedModel, load_model
from tests.fixtures_models import build_tiny_model, tiny_engine_config

pytestmark = pytest.mark.model  # every test here runs a tiny or the real model

FLOAT32_RTOL = 1e-4


class PagedRunner:
    """Runs our model like the engine does: per-request block tables drawn from a
    shuffled pool, one ``ForwardBatch`` per step, a fresh ``prepare`` per step."""

    def __init__(self, loaded: LoadedModel, block_size: int, num_blocks: int = 512, seed: int = 0) -> None:
        self.loaded = loaded
        self.block_size = block_size
        self.kv = KVCache.allocate(loaded.model_config, num_blocks, block_size, loaded.dtype, loaded.device)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.attn = TorchAttentionBackend()

    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Compute each request's next tokens; returns per request [len(chunk), vocab] logits."""
        tables, prefixes = [], []
        for rid, tokens in chunks:
            prefix = self.lens.get(rid, 0)
            table = self.tables.setdefault(rid, [])
            while len(table) * self.block_size < prefix + len(tokens):
                table.append(self.free.pop())
            tables.append(list(table))
            prefixes.append(prefix)
            self.lens[rid] = prefix + len(tokens)
        batch = ForwardBatch.build(token_chunks=[t for _, t in chunks], prefix_lens=prefixes, block_tables=tables,
                                   sample_mask=[True] * len(chunks), block_size=self.block_size)
        batch.logits_indices = torch.arange(batch.num_tokens)  # every row, to compare all positions
        self.attn.prepare(batch)
        logits = self.loaded.model(batch, self.kv, self.attn)
        starts = batch.query_start_loc.tolist()
        return [logits[starts[b]:starts[b + 1]] for b in range(len(chunks))]


def reference_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for every position of ``tokens``: [len, vocab] float32."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = FLOAT32_RTOL) -> None:
    assert ours.shape == ref.shape, what
    assert ours.dtype == torch.float32, what
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rtol * scale, f"{what}: max abs diff {err:.3g} > {rtol:g} x logit scale {scale:.3g}"


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def load_pair(folder: Path, dtype: str = "float32") -> tuple[LoadedModel, torch.nn.Module]:
    """Our model and the transformers reference from the same folder."""
    from transformers import AutoModelForCausalLM

    ours = load_model(tiny_engine_config(folder, dtype=dtype))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, ref


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_pair(request: pytest.FixtureRequest) -> tuple[LoadedModel, torch.nn.Module]:
    folder = request.getfixturevalue("tiny_model_dir" if request.param == "llama" else "tiny_qwen2_dir")
    return load_pair(folder)


@pytest.mark.parametrize("block_size", [1, 16])
def test_whole_prefill_of_several_requests_matches_transformers(tiny_pair, block_size: int) -> None:
    ours, hf = tiny_pair
    prompts = random_prompts(ours.model_config.vocab_size, [1, 7, 16, 33, 50], seed=block_size)
    runner = PagedRunner(ours, block_size, seed=3)
    logits = runner.step([(f"r{i}", p) for i, p in enumerate(prompts)])
    for i, (prompt, got) in enumerate(zip(prompts, logits)):
        assert_logits_close(got, reference_logits(hf, prompt), f"request {i} ({len(prompt)} tokens)")


@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_steps_over_paged_cache_match_transformers(tiny_pair, block_size: int) -> None:
    ours, hf = tiny_pair
    full = random_prompts(ours.model_config.vocab_size, [20, 9, 31], seed=10 + block_size)
    prompt_lens = [5, 9, 17]
    runner = PagedRunner(ours, block_size, seed=4)
    refs = [reference_logits(hf, seq) for seq in full]
    runner.step([(f"r{i}", seq[:n]) for i, (seq, n) in enumerate(zip(full, prompt_lens))])
    pos = list(prompt_lens)
    while any(p < len(seq) for p, seq in zip(pos, full)):
        live = [i for i, seq in enumerate(full) if pos[i] < len(seq)]
        logits = runner.step([(f"r{i}", [full[i][pos[i]]]) for i in live])
        for i, got in zip(live, logits):
            assert_logits_close(got, refs[i][pos[i]:pos[i] + 1], f"request {i} decode at position {pos[i]}")
            pos[i] += 1


@pytest.mark.parametrize("block_size", [1, 16])
def test_chunked_prefill_after_cached_prefix_matches_transformers(tiny_pair, block_size: int) -> None:
    """Chunks of one prompt land after a cached prefix (aligned or not), beside a decode."""
    ours, hf = tiny_pair
    long, other = random_prompts(ours.model_config.vocab_size, [45, 12], seed=20 + block_size)
    ref_long, ref_other = reference_logits(hf, long), reference_logits(hf, other)
    runner = PagedRunner(ours, block_size, seed=5)
    runner.step([("long", long[:16]), ("other", other[:11])])
    cuts = [16, 21, 37, 45]  # 5- and 16-token chunks, the second starting mid-block
    for n, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        chunks = [("long", long[lo:hi])] + ([("other", other[11:12])] if n == 0 else [])
        logits = runner.step(chunks)
        assert_logits_close(logits[0], ref_long[lo:hi], f"chunk {lo}:{hi} after a {lo}-token prefix")
        if n == 0:
            assert_logits_close(logits[1], ref_other[11:12], "decode beside the chunk")


def test_requests_batched_give_the_same_logits_as_each_alone(tiny_model_dir: Path) -> None:
    ours = load_model(tiny_engine_config(tiny_model_dir))
    prompts = random_prompts(ours.model_config.vocab_size, [3, 18, 40, 1], seed=30)
    together = PagedRunner(ours, 16, seed=6).step([(f"r{i}", p) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        alone = PagedRunner(ours, 16, seed=7 + i).step([("solo", prompt)])[0]
        # Same kernels on different row counts: only matmul blocking order differs.
        torch.testing.assert_close(together[i], alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())


def test_logits_only_for_requested_rows(tiny_model_dir: Path) -> None:
    ours = load_model(tiny_engine_config(tiny_model_dir))
    kv = KVCache.allocate(ours.model_config, 8, 16, ours.dtype, ours.device)
    batch = ForwardBatch.build(token_chunks=[[5, 6, 7], [8], [9, 10]], prefix_lens=[0, 0, 0],
                               block_tables=[[0], [1], [2]], sample_mask=[True, False, True], block_size=16)
    logits = ours.model(batch, kv, TorchAttentionBackend())
    assert logits.shape == (2, ours.model_config.vocab_size)
    assert logits.dtype == torch.float32
    full = PagedRunner(ours, 16).step([("a", [5, 6, 7]), ("c", [9, 10])])
    assert_logits_close(logits[0:1], full[0][-1:], "last row of request a")
    assert_logits_close(logits[1:2], full[1][-1:], "last row of request c")
    silent = ForwardBatch.build(token_chunks=[[11, 12]], prefix_lens=[0], block_tables=[[3]], sample_mask=[False],
                                block_size=16)
    assert ours.model(silent, kv, TorchAttentionBackend()).shape == (0, ours.model_config.vocab_size)


def test_llama3_rope_scaling_and_untied_head_match_transformers(tmp_path: Path, smollm2_dir: Path) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    folder = build_tiny_model(tmp_path / "llama3", "llama", smollm2_dir, seed=5, rope_scaling=rope,
                              tie_word_embeddings=False)
    ours, hf = load_pair(folder)
    assert ours.model_config.rope_scaling and ours.model_config.rope_scaling["rope_type"] == "llama3"
    (prompt,) = random_prompts(ours.model_config.vocab_size, [90], seed=40)
    runner = PagedRunner(ours, 16)
    head = runner.step([("r", prompt[:70])])[0]
    tail = runner.step([("r", prompt[70:])])[0]
    assert_logits_close(torch.cat([head, tail]), reference_logits(hf, prompt), "llama3-scaled RoPE, untied head")


def test_bfloat16_forward_stays_close_to_float32_reference(tiny_model_dir: Path) -> None:
    ours, hf = load_pair(tiny_model_dir, dtype="bfloat16")
    assert next(ours.model.parameters()).dtype == torch.bfloat16
    prompts = random_prompts(ours.model_config.vocab_size, [24, 11], seed=50)
    runner = PagedRunner(ours, 16)
    prefill = runner.step([("a", prompts[0][:20]), ("b", prompts[1][:10])])
    decode = runner.step([("a", prompts[0][20:]), ("b", prompts[1][10:])])
    for i, prompt in enumerate(prompts):
        ref = reference_logits(hf, prompt)
        got = torch.cat([prefill[i], decode[i]])
        # bfloat16 keeps 8 mantissa bits (0.4% per rounding) and rounds weights,
        # activations and KV; over 2 layers the logits drift by a few percent of their
        # scale, far less than the distance between unrelated logit vectors.
        assert_logits_close(got, ref, f"bfloat16 request {i}", rtol=0.05)
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree >= 0.8, f"bfloat16 request {i}: top-1 agrees on only {agree:.0%} of positions"


@pytest.mark.slow
def test_smollm2_prefill_and_decode_match_transformers(smollm2_dir: Path) -> None:
    ours, hf = load_pair(smollm2_dir)
    tok = ours.tokenizer
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]]
    prompts = [list(tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True)["input_ids"]) for c in chats]
    runner = PagedRunner(ours, 16)
    logits = runner.step([(f"r{i}", p) for i, p in enumerate(prompts)])
    seqs, rows = [list(p) for p in prompts], [[got] for got in logits]
    for _ in range(4):  # greedy decode over the paged cache
        for seq, got in zip(seqs, logits):
            seq.append(int(got[-1].argmax()))
        logits = runner.step([(f"r{i}", s[-1:]) for i, s in enumerate(seqs)])
        for row, got in zip(rows, logits):
            row.append(got)
    for i, seq in enumerate(seqs):
        assert_logits_close(torch.cat(rows[i]), reference_logits(hf, seq), f"SmolLM2 request {i}, prefill + 4 decodes")
    answer = tok.decode(seqs[0][len(prompts[0]):])
    assert answer.startswith("The capital of France"), answer
