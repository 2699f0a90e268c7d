"""Helpers for engine tests: build an engine on a model folder, run requests to the end."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams


def make_engine(model_dir, **overrides) -> AsyncEngine:
    """An AsyncEngine on ``model_dir`` (cpu, float32, small pool), not started."""
    cfg = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=16, num_blocks=256,
               max_num_batched_tokens=256, max_num_seqs=32)
    cfg.update(overrides)
    return AsyncEngine.from_config(EngineConfig(**cfg), verbose=False)


@dataclass
class Collected:
    """Everything one request streamed."""

    deltas: list[RequestOutput] = field(default_factory=list)
    final: RequestOutput | None = None

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]


async def collect(engine: AsyncEngine, req: GenerateRequest) -> Collected:
    """Run one request through ``engine.generate`` and keep every item."""
    c = Collected()
    async for out in engine.generate(req):
        c.deltas.append(out)
        if out.finished:
            c.final = out
    return c


async def run_all(engine: AsyncEngine, reqs: list[GenerateRequest]) -> list[Collected]:
    """Run requests concurrently; results in the same order."""
    return list(await asyncio.gather(*(collect(engine, r) for r in reqs)))


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    """Greedy params that ignore EOS (random tiny models rarely emit it anyway)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)


def run_core(core: EngineCore, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step a synchronous EngineCore until idle; returns each request's final output."""
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    assert not core.has_work(), "engine did not drain"
    return finals


@torch.inference_mode()
def hf_greedy(hf_model, prompt_ids: list[int], n: int) -> list[int]:
    """Reference greedy continuation with transformers' own forward (no EOS stop)."""
    out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
    toks: list[int] = []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        toks.append(nxt)
        out = hf_model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return toks


def first_divergence_is_a_near_tie(ref, other, eps: float = 1e-4) -> bool:
    """The determinism policy (docs/architecture.md): identical, or the first differing position is one
    where the reference's top-1/top-2 log-probability gap is below eps."""
    a, b = ref.output_token_ids, other.output_token_ids
    if a == b:
        return True
    i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
    top = ref.logprobs_all[i].top
    return len(top) >= 2 and top[0][1] - top[1][1] < eps
