"""Speculative decoding by prompt lookup (engine/spec, EngineCore.step): drafts are looked
up right, verification keeps exactly the tokens one-by-one decoding would produce
(greedy, seeded and penalised requests alike, with logprobs, stop strings, EOS and
max_tokens landing inside the drafts), only kept tokens advance the KV and reach the
radix tree, block accounting stays exact under preemption and aborts, and the sampled
tokens of unseeded requests keep their distribution."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore, spec_config
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, ScheduledItem
from engine.spec.ngram import TokenHistory, propose
from engine.spec.policy import SpecConfig, SpecState
from tests.engine_helpers import make_engine

# ---- the proposer and the policy -------------------------------------------------------


def test_lookup_takes_the_longest_ngram_and_its_most_recent_occurrence():
    h = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 3, 6, 7], dtype=np.int64)
    # "6 7" occurred twice before the end: the most recent one is followed by 9, 2, 3
    assert propose(h, 3, 1, 2) == [9, 2, 3]
    # with a 3-gram, "3 6 7" never occurred before: falls back to the 2-gram
    assert propose(h, 2, 1, 3) == [9, 2]
    h2 = np.array([1, 2, 3, 4, 2, 3, 9, 1, 2, 3], dtype=np.int64)
    assert propose(h2, 4, 1, 3) == [4, 2, 3, 9]  # "1 2 3" at the start beats the later "2 3"
    assert propose(h2, 4, 2, 2) == [9, 1, 2, 3]  # only 2-grams: the most recent "2 3"


def test_lookup_never_matches_the_query_itself_and_stops_at_the_end():
    assert propose(np.array([1, 2, 3], dtype=np.int64), 4, 1, 3) == []  # no earlier occurrence
    assert propose(np.array([4, 4, 4, 4], dtype=np.int64), 5, 2, 2) == [4]  # the match ends one before the end
    assert propose(np.array([7, 8, 7], dtype=np.int64), 0, 1, 2) == []
    with pytest.raises(ValueError):
        propose(np.array([1, 2], dtype=np.int64), 2, 3, 2)


def test_token_history_grows_in_place():
    h = TokenHistory([1, 2, 3])
    for i in range(200):
        h.extend((i,))
    assert len(h) == 203 and h.view()[:3].tolist() == [1, 2, 3] and h.view()[-1] == 199


def test_a_request_backs_off_when_its_drafts_keep_failing_and_tries_again_later():
    cfg = SpecConfig(min_acceptance=0.3, backoff_steps=3, ema=0.5)
    st = SpecState()
    st.record(cfg, 4, 0)
    assert st.wants_drafts(cfg) is True  # 1.0 -> 0.5: still above 0.3
    st.record(cfg, 4, 0)  # 0.25 < 0.3: back off
    assert [st.wants_drafts(cfg) for _ in range(3)] == [False, False, False]
    assert st.wants_drafts(cfg) is True  # tries again
    assert (st.drafted, st.accepted, st.spec_steps) == (8, 0, 2)


def test_auto_speculates_on_the_cpu_only_and_off_turns_it_off():
    assert spec_config(EngineConfig(), torch.device("cpu")) is not None
    assert spec_config(EngineConfig(), torch.device("cuda")) is None
    assert spec_config(EngineConfig(speculative="off"), torch.device("cpu")) is None
    forced = spec_config(EngineConfig(speculative="ngram", num_draft_tokens=7), torch.device("cuda"))
    assert forced is not None and forced.num_draft_tokens == 7


# ---- verification keeps exactly what one-by-one decoding produces --------------------------


class Oracle:
    """A drafter for tests: proposes from a reference output (right drafts), corrupts
    some (wrong ones), or proposes random tokens, so every acceptance length happens."""

    def __init__(self, reference: dict[str, list[int]], mode: str, seed: int = 0) -> None:
        self.reference, self.mode, self.rng = reference, mode, random.Random(seed)
        self.proposed = 0

    def __call__(self, req, room, config):
        ref = self.reference.get(req.request_id.split("/")[-1], [])
        n = len(req.output_ids)
        drafts = ref[n:n + room] if self.mode != "random" else [self.rng.randrange(3, 5000) for _ in range(room)]
        if self.mode == "corrupt" and drafts:
            cut = self.rng.randrange(len(drafts))
            drafts = drafts[:cut] + [drafts[cut] + 1] + drafts[cut + 1:]
        self.proposed += len(drafts)
        return drafts


def run_core(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams, tag: str = "") -> dict:
    """Run requests to the end on the core; per request id: (token ids, text, finish
    reason, logprob values)."""
    for rid, ids in prompts.items():
        core.add_request(f"{tag}{rid}", ids, params)
    out: dict = {}
    texts: dict = {}
    lps: dict = {}
    while core.has_work():
        for o in core.step():
            rid = o.request_id.removeprefix(tag)
            texts[rid] = texts.get(rid, "") + o.text
            lps.setdefault(rid, []).extend(round(lp.logprob, 5) for lp in (o.logprobs or []))
            if o.finished:
                out[rid] = (o.output_token_ids, texts[rid], o.finish_reason, lps[rid])
    core.check_invariants()
    return out


PROMPTS = {f"p{i}": [random.Random(i).randrange(100, 30000) for _ in range(random.Random(i).randrange(20, 120))]
           for i in range(8)}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """One engine without speculation and one with (5 drafts, up to 8 requests), on the
    kernel path, shared by the tests below (each uses its own request ids)."""
    plain = make_engine(tiny_model_dir, dtype="auto", quantization="auto", speculative="off", num_blocks=1024).core
    spec = make_engine(tiny_model_dir, dtype="auto", quantization="auto", speculative="ngram", num_draft_tokens=5,
                       spec_max_batch=8, num_blocks=1024).core
    return plain, spec


@pytest.mark.parametrize("mode", ["right", "corrupt", "random"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=17, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True),
], ids=["greedy+logprobs", "seeded", "penalised"])
def test_speculation_never_changes_the_output(engines, mode, batch, params):
    """Drafts that are all right, right up to one wrong token, or random: the tokens,
    texts, finish reasons and logprobs equal those of the same engine without speculation
    (greedy, seeded sampling and penalties alike), on the kernel path at batch 1 and 8."""
    plain, core = engines
    tag = f"{mode}-{batch}-{params.temperature}-{params.repetition_penalty}/"
    prompts = dict(list(PROMPTS.items())[:batch])
    reference = run_core(plain, prompts, params, tag)
    oracle = Oracle({k: v[0] for k, v in reference.items()}, mode)
    core.draft = oracle
    before = core.stats()
    got = run_core(core, prompts, params, tag)
    assert got == reference
    stats = {k: v - before.get(k, 0) for k, v in core.stats().items() if k.endswith("_total")}
    assert oracle.proposed > 0 and stats["spec_drafted_total"] == oracle.proposed
    if mode == "right":  # every draft kept: far fewer steps than tokens
        assert stats["spec_accepted_total"] == stats["spec_drafted_total"]
        assert stats["steps_total"] < 0.5 * sum(len(v[0]) for v in reference.values()) + len(prompts) * 3
    if mode == "random":
        assert stats["spec_accepted_total"] < stats["spec_drafted_total"]


@pytest.mark.parametrize("stop,max_tokens", [(["@"], 30), ([], 7)])
def test_a_stop_string_or_max_tokens_inside_kept_drafts_ends_the_reply_exactly(engines, stop, max_tokens):
    """The reference's text decides a stop string that falls inside a run of right drafts;
    nothing after it is streamed, and max_tokens is never passed."""
    plain, core = engines
    tag = f"stop{max_tokens}/"
    prompts = {"a": PROMPTS["p1"]}
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    full = run_core(plain, prompts, base, "full" + tag)["a"]
    if stop:  # stop at a piece of text in the middle of the reference reply
        piece = full[1][len(full[1]) // 2: len(full[1]) // 2 + 3]
        stop = [piece] if piece.strip() else ["@"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stop)
    reference = run_core(plain, prompts, params, tag)
    core.draft = Oracle({"a": full[0]}, "right")
    got = run_core(core, prompts, params, tag)
    assert got == reference
    assert len(got["a"][0]) <= max_tokens
    if stop and stop != ["@"]:
        assert got["a"][2] == "stop" and stop[0] not in got["a"][1]


@pytest.mark.parametrize("end", ["stop_string", "stop_token", "max_tokens"])
def test_drafts_past_the_end_of_a_reply_count_as_neither_drafted_nor_accepted(engines, end):
    """Right drafts that run on past the reply's end (a stop string or stop token inside
    them; max_tokens, which drafts never pass) are dropped with the tokens after the end,
    and the counters count only drafts that reached the output: with every draft right,
    each decode step's tokens are its accepted drafts plus the one it sampled, except a
    last step that ended inside its drafts, so a reply of n tokens after D decode steps
    has n - 1 - D or n - D accepted drafts. The request's timings and the engine's totals
    agree."""
    plain, core = engines
    tag = f"count-{end}/"
    prompts = {"a": PROMPTS["p2"]}
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ids, text = run_core(plain, prompts, base, "full" + tag)["a"][:2]
    if end == "stop_string":
        at = next(i for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].strip())
        params = dataclasses.replace(base, stop=[text[at:at + 3]])
    elif end == "stop_token":
        # the engine drafts 5 a step, so output tokens 1-6, 7-12, ... come a step each: a
        # stop token early in a step's run leaves right drafts after it
        at = next(k for k in range(12, len(ids)) if ids[k] not in ids[:k] and (k - 1) % 6 < 4)
        params = dataclasses.replace(base, stop_token_ids=[ids[at]])
    else:
        params = dataclasses.replace(base, max_tokens=17)
    core.draft = Oracle({"a": ids}, "right")
    before = core.stats()
    core.add_request(f"{tag}a", prompts["a"], params)
    outputs = []
    while core.has_work():
        outputs += [o for o in core.step() if o.progress is None]
    after = core.stats()
    done, n, steps = outputs[-1], len(outputs[-1].output_token_ids), len(outputs) - 1
    t = done.timings
    assert done.finish_reason == ("length" if end == "max_tokens" else "stop") and n < len(ids)
    assert t.accepted_tokens == t.draft_tokens and n - 1 - steps <= t.accepted_tokens <= n - steps
    assert (after["spec_drafted_total"] - before["spec_drafted_total"],
            after["spec_accepted_total"] - before["spec_accepted_total"]) == (t.draft_tokens, t.accepted_tokens)
    assert t.acceptance_rate == 1.0 and steps < n - 1  # drafts were used


def test_rejected_drafts_leave_no_kv_no_blocks_and_nothing_in_the_tree(tiny_model_dir):
    """After steps whose drafts are all rejected, the request holds only the blocks its
    kept tokens need, and what the radix tree stores equals the tokens it kept."""
    core = make_engine(tiny_model_dir, dtype="auto", quantization="auto", speculative="ngram", num_draft_tokens=6,
                       block_size=4).core
    core.draft = Oracle({}, "random")  # type: ignore[method-assign]
    core.add_request("a", PROMPTS["p2"], SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True))
    while core.has_work():
        core.step()
        req = core.requests.get("a")
        if req is not None:
            assert req.num_computed_tokens == req.num_tokens - 1
            assert len(req.block_table) <= -(-req.num_tokens // 4)  # no block past the next token
            core.check_invariants()
    out = list(PROMPTS["p2"])
    # the tree now holds the kept tokens' pages: a new request with the same tokens hits them
    ref = run_core(make_engine(tiny_model_dir, dtype="auto", quantization="auto", speculative="off").core,
                   {"a": PROMPTS["p2"]}, SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True))
    out += ref["a"][0]
    match = core.cache.match_prefix(out[:-1], f"{core.namespace}|")
    assert match.num_tokens >= (len(out) - 1) // 4 * 4 - 4


def test_blocks_stay_exact_under_preemption_and_random_aborts_while_speculating(tiny_model_dir):
    """A pool too small for all requests forces preemption mid-speculation; random aborts
    hit requests with drafts in flight. Afterwards every block is free or evictable."""
    core = make_engine(tiny_model_dir, dtype="auto", quantization="auto", speculative="ngram", num_draft_tokens=5,
                       num_blocks=24, block_size=8, spec_max_batch=8).core
    core.draft = Oracle({}, "random", seed=3)  # type: ignore[method-assign]
    rng = random.Random(5)
    for i in range(10):
        core.add_request(f"r{i}", PROMPTS[f"p{i % 8}"][:40], SamplingParams(max_tokens=30, temperature=0.0,
                                                                            ignore_eos=True))
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        core.check_invariants()
        if rng.random() < 0.15 and core.requests:
            core.abort(rng.choice(sorted(core.requests)))
    assert core.scheduler.num_preemptions > 0
    assert core.pool.num_free + core.cache.num_evictable_blocks == core.pool.num_blocks


# ---- unseeded sampling keeps its distribution ------------------------------------------


def test_a_verified_position_keeps_the_samplers_distribution():
    """The rule verification applies: sample the position as usual, keep the draft x when
    it equals the sample, else take the sample. Over many unseeded trials the kept token
    is distributed as p (x kept with probability p(x): the rejection rule for a point-mass
    draft, Leviathan et al. 2023), within 0.02 of every probability."""
    probs = torch.tensor([0.45, 0.25, 0.2, 0.1])
    logits = probs.log().repeat(20000, 1)
    sampler = Sampler(4, "cpu", seed=11)
    drawn = sampler.sample(logits, [SamplingParams(temperature=1.0)] * 20000).token_ids
    item = ScheduledItem(request=None, num_new=2, sample=True, spec=[1])
    kept = []
    for b in range(0, 20000, 2):  # pairs: the draft's position, then the bonus position
        batch = ScheduledBatch(items=[item])
        from engine.sampler import SamplerOutput

        n = EngineCore._verify(batch, SamplerOutput(token_ids=[drawn[b], drawn[b + 1]]))[0]
        kept.append(drawn[b] if n == 0 else 1)
        assert (n == 1) == (drawn[b] == 1)
    freq = torch.tensor([Counter(kept)[i] for i in range(4)], dtype=torch.float32) / len(kept)
    assert torch.allclose(freq, probs, atol=0.02), freq


@pytest.mark.parametrize("mode", ["right", "random"])
def test_done_timings_report_each_requests_acceptance_and_tokens_per_step(engines, mode):
    """A finished request's timings carry its drafts, the accepted ones, their rate and
    its output tokens per decode step; they add up to the engine's counters. Without
    speculation a step yields one token."""
    plain, core = engines
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = dict(list(PROMPTS.items())[:3])
    tag = f"timings-{mode}/"

    def finished(c: EngineCore) -> dict:
        for rid, ids in prompts.items():
            c.add_request(f"{tag}{rid}", ids, params)
        done: dict = {}
        while c.has_work():
            done.update({o.request_id: o for o in c.step() if o.finished})
        return done

    for o in finished(plain).values():
        t = o.timings
        assert (t.draft_tokens, t.accepted_tokens, t.acceptance_rate, t.tokens_per_step) == (0, 0, 0.0, 1.0)
    reference = run_core(plain, prompts, params, tag + "ref/")
    core.draft = Oracle({k: v[0] for k, v in reference.items()}, mode)
    before = core.stats()
    done = finished(core)
    after = core.stats()
    drafted = sum(o.timings.draft_tokens for o in done.values())
    accepted = sum(o.timings.accepted_tokens for o in done.values())
    assert drafted == after["spec_drafted_total"] - before["spec_drafted_total"] > 0
    assert accepted == after["spec_accepted_total"] - before["spec_accepted_total"]
    for o in done.values():
        t = o.timings
        assert t.acceptance_rate == pytest.approx(t.accepted_tokens / t.draft_tokens, abs=1e-4)
        if mode == "right":
            assert t.acceptance_rate == 1.0 and t.tokens_per_step > 2
        else:
            assert t.acceptance_rate < 1.0 and 1.0 <= t.tokens_per_step < 2
