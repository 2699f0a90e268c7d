"""Sampler: greedy equivalences (sampling edge values (docs/acceptance.md#sampling-edge-values)), exact
top-k/top-p/min-p masks,
penalties, per-request seeds independent of batch neighbours (seeded requests are reproducible), logprobs, and
robustness to non-finite logits."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import LOGPROB_FLOOR, PenaltyState, Sampler, noise_key
from engine.sampling_params import SamplingParams as SP

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _few_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def rand_logits(rows: int, vocab: int, seed: int, device, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(device)


def support(probs_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs_row > 0).flatten().tolist())


# -- greedy and its equivalents (sampling edge values) ----------------------------------------------------


def test_greedy_is_argmax_of_raw_logits(device):
    logits = rand_logits(8, 300, 0, device)
    out = Sampler(300, device, seed=0).sample(logits, [SP(temperature=0.0)] * 8)
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.logprobs == [None] * 8


@pytest.mark.parametrize(
    "params",
    [
        SP(temperature=1.0, top_p=1e-8),
        SP(temperature=1.0, top_k=1),
        SP(temperature=1e-6),
        SP(temperature=0.0, top_p=0.5),
        SP(temperature=1.5, top_p=1e-8, top_k=100, min_p=0.0),
        SP(temperature=1.0, min_p=1.0),
    ],
    ids=["tiny_top_p", "top_k_1", "temperature_1e-6", "greedy_with_top_p", "tiny_top_p_hot", "min_p_1"],
)
def test_degenerate_settings_behave_like_greedy(device, params):
    logits = rand_logits(16, 500, 1, device)
    sampler = Sampler(500, device, seed=1)
    for _ in range(3):  # random draws must not matter
        assert sampler.sample(logits, [params] * 16).token_ids == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize("candidates", [256, 2, 3])
def test_tiny_top_p_keeps_the_lowest_id_among_tied_top_tokens(device, candidates):
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [5.0, 0.0, 1.0, 5.0]], device=device)
    for seed in range(5):
        sampler = Sampler(4, device, seed=seed, top_p_candidates=candidates)
        out = sampler.sample(logits, [SP(temperature=1.0, top_p=1e-8)] * 2)
        assert out.token_ids == [1, 0] == logits.argmax(dim=1).tolist()


def test_nucleus_from_candidates_equals_full_sort(device):
    """The top-k shortcut gives the same nucleus as sorting the whole vocabulary: when the
    first 256 candidates hold it, when it needs the 4096-candidate level, and when a
    flat row forces the full sort."""
    vocab = 49152
    logits = torch.cat([rand_logits(1, vocab, 11, device, scale=4.0), rand_logits(1, vocab, 11, device, scale=2.0),
                        torch.zeros(1, vocab, device=device)])  # flat: 4096 candidates hold 8% of the mass
    params = [SP(temperature=0.8, top_p=0.9), SP(temperature=1.0, top_p=0.6), SP(temperature=1.0, top_p=0.3)]
    full = Sampler(vocab, device, top_p_candidates=vocab).distribution(logits, params)
    sizes = [int((row > 0).sum()) for row in full]
    assert 1 < sizes[0] < 256 < sizes[1] < 4096 < sizes[2]
    assert abs(sizes[2] - 0.3 * vocab) <= 2
    fast = Sampler(vocab, device)
    for rows in ([0], [1], [0, 1], [0, 1, 2]):
        got = fast.distribution(logits[rows], [params[r] for r in rows])
        assert torch.equal(got > 0, full[rows] > 0)
        assert torch.allclose(got, full[rows])


# -- the distribution sampled from -------------------------------------------------------


def test_top_p_one_keeps_the_full_temperature_scaled_distribution(device):
    logits = rand_logits(3, 64, 2, device, scale=8.0)  # peaked: the tail has tiny mass
    sampler = Sampler(64, device)
    for t in (1.0, 0.5, 2.0):
        probs = sampler.distribution(logits, [SP(temperature=t, top_p=1.0)] * 3)
        assert torch.allclose(probs, torch.softmax(logits / t, dim=1), atol=1e-6, rtol=1e-4)
        assert bool((probs > 0).all())  # no token is dropped, however unlikely


def test_top_p_one_keeps_every_token_beside_a_nucleus_row(device):
    """Float cumsum over a 49152-token vocab reaches 1.0 before the tail; top_p=1 must
    still keep the tail when another row in the batch runs the nucleus filter."""
    vocab = 49152
    logits = rand_logits(2, vocab, 10, device, scale=3.0)
    probs = Sampler(vocab, device).distribution(logits, [SP(top_p=1.0), SP(top_p=0.5)])
    assert bool((probs[0] > 0).all())
    assert torch.allclose(probs[0], torch.softmax(logits[0], dim=0), atol=1e-7, rtol=1e-4)
    assert int((probs[1] > 0).sum()) < vocab // 2


def test_empirical_frequencies_match_softmax(device):
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log().repeat(20000, 1).to(device)
    out = Sampler(4, device, seed=3).sample(logits, [SP(temperature=1.0)] * 20000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_seeded_draws_follow_the_distribution(device):
    """A single seeded row over many steps samples the right distribution too."""
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().unsqueeze(0).to(device)
    sampler = Sampler(3, device)
    ids = [sampler.sample(logits, [SP(temperature=1.0, seed=7)], [noise_key(7, i)]).token_ids[0] for i in range(3000)]
    freq = torch.bincount(torch.tensor(ids), minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.03)


# probabilities 0.5, 0.3, 0.12, 0.05, 0.03 as logits, shuffled so masks must follow ids
HAND_PROBS = [0.12, 0.5, 0.03, 0.3, 0.05]
HAND_ORDER = [1, 3, 0, 4, 2]  # ids from most to least likely


@pytest.mark.parametrize(
    "params,kept",
    [
        (SP(temperature=1.0, top_k=2), {1, 3}),
        (SP(temperature=1.0, top_k=4), {1, 3, 0, 4}),
        (SP(temperature=1.0, top_k=-1), {0, 1, 2, 3, 4}),
        (SP(temperature=1.0, top_p=0.45), {1}),  # mass before id 3 is 0.5 >= 0.45
        (SP(temperature=1.0, top_p=0.7), {1, 3}),  # 0.5 < 0.7 <= 0.8
        (SP(temperature=1.0, top_p=0.85), {1, 3, 0}),  # 0.8 < 0.85 <= 0.92
        (SP(temperature=1.0, min_p=0.2), {1, 3, 0}),  # keep p >= 0.1
        (SP(temperature=1.0, min_p=0.5), {1, 3}),  # keep p >= 0.25
        (SP(temperature=1.0, top_k=3, top_p=0.6), {1, 3}),  # top-p over the renormalised top-3
        (SP(temperature=1.0, top_k=4, min_p=0.2), {1, 3, 0}),
    ],
)
@pytest.mark.parametrize("candidates", [256, 2], ids=["full_sort", "top_p_candidates_2"])
def test_filters_keep_exactly_the_expected_tokens(device, params, kept, candidates):
    logits = torch.tensor([HAND_PROBS], device=device).log()
    probs = Sampler(5, device, top_p_candidates=candidates).distribution(logits, [params])[0]
    assert support(probs) == kept
    expected = torch.tensor([HAND_PROBS[i] if i in kept else 0.0 for i in range(5)])
    assert torch.allclose(probs.cpu(), expected / expected.sum(), atol=1e-6)
    # Sampling never leaves the kept set.
    out = Sampler(5, device, seed=0).sample(logits.repeat(200, 1), [params] * 200)
    assert set(out.token_ids) <= kept


def test_each_row_uses_its_own_parameters(device):
    logits = torch.tensor([HAND_PROBS] * 3, device=device).log()
    params = [SP(temperature=1.0, top_k=2), SP(temperature=0.0), SP(temperature=1.0, min_p=0.2)]
    probs = Sampler(5, device).distribution(logits, params)
    assert [support(r) for r in probs] == [{1, 3}, {1}, {1, 3, 0}]


# -- seeds (seeded requests are reproducible) -----------------------------------------------------------------------


TARGET = "target"


def _run_seeded(device, layout, steps: int = 12, vocab: int = 1000) -> list[int]:
    """Sample ``steps`` tokens for a seed-42 target row placed in the batch that
    ``layout(step)`` describes (a list of neighbour kinds and ``TARGET``); return the
    target's tokens. Neighbours get fresh random logits every step."""
    sampler = Sampler(vocab, device, seed=123)
    target = SP(temperature=0.8, top_p=0.95, seed=42)
    neighbour_params = {
        "unseeded": SP(temperature=1.0),
        "greedy": SP(temperature=0.0),
        "penalised": SP(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5),
        "seeded": SP(temperature=0.7, seed=1000),
    }
    states: dict[int, PenaltyState] = {}
    tokens = []
    for step in range(steps):
        kinds = layout(step)
        logits = rand_logits(len(kinds), vocab, 5000 + step, device, scale=2.0)
        logits[kinds.index(TARGET)] = rand_logits(1, vocab, 1000 + step, device, scale=1.0)[0]
        params, row_gens, counts = [], [], []
        for i, kind in enumerate(kinds):
            p = target if kind == TARGET else neighbour_params[kind]
            params.append(p)
            if kind == TARGET:
                row_gens.append(noise_key(42, step))
            elif kind == "seeded":
                row_gens.append(noise_key(1000 + i, step))
            else:
                row_gens.append(None)
            if PenaltyState.needed(p) and i not in states:
                states[i] = PenaltyState(vocab, device, prompt_ids=[1, 2, 3])
            counts.append(states.get(i) if PenaltyState.needed(p) else None)
        out = sampler.sample(logits, params, row_gens, counts)
        for i, state in states.items():  # the caller records the tokens it keeps
            if i < len(kinds) and PenaltyState.needed(params[i]):
                state.append(out.token_ids[i])
        tokens.append(out.token_ids[kinds.index(TARGET)])
    return tokens


def test_seeded_row_is_independent_of_its_neighbours(device):
    layouts = {
        "alone": lambda step: [TARGET],
        "unseeded_after": lambda step: [TARGET, "unseeded"],
        "unseeded_before": lambda step: ["unseeded", "unseeded", TARGET],
        "greedy_and_penalised": lambda step: ["greedy", TARGET, "penalised"],
        "other_seeded": lambda step: ["seeded", TARGET, "seeded"],
        # the batch changes size and order from step to step (continuous batching)
        "changing": lambda step: ["unseeded"] * (step % 3) + [TARGET] + ["seeded", "penalised"][: step % 3],
    }
    results = {name: _run_seeded(device, layout) for name, layout in layouts.items()}
    assert all(r == results["alone"] for r in results.values()), results
    assert len(set(results["alone"])) > 3  # it really sampled (not a constant)


def test_different_seeds_give_different_streams(device):
    logits = rand_logits(1, 1000, 9, device, scale=0.5)
    sampler = Sampler(1000, device)
    streams = []
    for seed in (1, 2):
        streams.append([sampler.sample(logits, [SP(seed=seed)], [noise_key(seed, i)]).token_ids[0] for i in range(10)])
    assert streams[0] != streams[1]


# -- penalties -------------------------------------------------------------------------


def _logprob_shift(sampler, logits, params, state) -> torch.Tensor:
    """log p_penalised - log p_raw at temperature 1: the logit change up to one constant."""
    raw = sampler.distribution(logits, [SP(temperature=1.0)])[0].log()
    pen = sampler.distribution(logits, [params], [state])[0].log()
    return (pen - raw).cpu()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits(device):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5, 1.0]], device=device)
    state = PenaltyState(6, device, prompt_ids=[0, 1], output_ids=[4])
    shift = _logprob_shift(Sampler(6, device), logits, SP(temperature=1.0, repetition_penalty=2.0), state)
    change = torch.tensor([1.0 - 2.0, -2.0 - -1.0, 0.0, 0.0, -1.0 - -0.5, 0.0])
    c = shift[2]  # an unpenalised token gives the normalisation constant
    assert torch.allclose(shift - c, change, atol=1e-5)


def test_frequency_and_presence_penalties_use_output_counts_only(device):
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]], device=device)
    state = PenaltyState(5, device, prompt_ids=[0], output_ids=[1, 1, 1, 2])
    params = SP(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25)
    shift = _logprob_shift(Sampler(5, device), logits, params, state)
    change = torch.tensor([0.0, -(0.5 * 3 + 0.25), -(0.5 + 0.25), 0.0, 0.0])  # prompt id 0 untouched
    assert torch.allclose(shift - shift[3], change, atol=1e-5)


def test_penalties_change_greedy_choice_and_count_kept_and_extra_tokens(device):
    logits = torch.tensor([[5.0, 4.0, 0.0]], device=device)
    sampler = Sampler(3, device)
    state = PenaltyState(3, device)
    params = SP(temperature=0.0, presence_penalty=2.0)
    assert sampler.sample(logits, [params], None, [state]).token_ids == [0]
    assert state.output_counts.tolist() == [0, 0, 0]  # sampling records nothing: the caller keeps tokens
    state.append(0)
    # 5 -> 3 after token 0 was generated once, so token 1 (4.0) wins next.
    assert sampler.sample(logits, [params], None, [state]).token_ids == [1]
    # a draft token before the position counts too (speculative verification), in that row only
    both = sampler.sample(logits.repeat(2, 1), [params] * 2, None, [state, state], [[], [1]])
    assert both.token_ids == [1, 0] and state.output_counts.tolist() == [1, 0, 0]  # row 2: 3 > 4 - 2


def test_penalties_of_one_row_never_affect_another(device):
    logits = rand_logits(3, 50, 4, device)
    sampler = Sampler(50, device)
    plain = [SP(temperature=0.9, top_k=20), SP(temperature=0.0)]
    alone = sampler.distribution(logits[:2], plain)
    pen = SP(temperature=0.9, repetition_penalty=3.0, frequency_penalty=2.0, presence_penalty=2.0)
    state = PenaltyState(50, device, prompt_ids=list(range(25)), output_ids=list(range(10, 40)))
    mixed = sampler.distribution(logits, plain + [pen], [None, None, state])
    assert torch.equal(mixed[:2], alone)
    assert not torch.allclose(mixed[2], sampler.distribution(logits[2:], [SP(temperature=0.9)])[0])


def test_missing_penalty_state_is_a_clear_error(device):
    with pytest.raises(ValueError, match="PenaltyState"):
        Sampler(4, device).sample(torch.zeros(1, 4, device=device), [SP(repetition_penalty=1.2)])


def test_extreme_penalties_stay_finite(device):
    logits = rand_logits(2, 30, 5, device, scale=1e30)
    state = PenaltyState(30, device, prompt_ids=range(30))
    params = [SP(temperature=1.0, repetition_penalty=1e-30), SP(temperature=0.0, repetition_penalty=10.0)]
    out = Sampler(30, device, seed=0).sample(logits, params, None, [state, PenaltyState(30, device, range(30))])
    assert all(0 <= t < 30 for t in out.token_ids)


# -- logprobs ----------------------------------------------------------------------------


def test_logprobs_are_finite_sorted_and_match_log_softmax(device):
    logits = rand_logits(4, 200, 6, device)
    state = PenaltyState(200, device, prompt_ids=range(50))
    params = [
        SP(temperature=0.0, logprobs=5),
        SP(temperature=1.3, top_p=0.9, logprobs=20),
        SP(temperature=0.7, repetition_penalty=1.5, logprobs=0),
        SP(temperature=1.0),
    ]
    out = Sampler(200, device, seed=0).sample(logits, params, None, [None, None, state, None])
    ref = torch.log_softmax(logits.double(), dim=1).cpu()
    for b, n in enumerate([5, 20, 0]):
        lp = out.logprobs[b]
        assert lp.token_id == out.token_ids[b]
        assert math.isclose(lp.logprob, ref[b, lp.token_id].item(), abs_tol=1e-4)
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and all(math.isfinite(v) for v in values)
        for tid, v in lp.top:
            assert math.isclose(v, ref[b, tid].item(), abs_tol=1e-4)
        if n:
            assert lp.top[0][0] == int(logits[b].argmax())
    assert out.logprobs[3] is None


def test_processed_logprobs_are_the_distribution_the_token_was_drawn_from(device):
    logits = rand_logits(3, 200, 8, device)
    params = [SP(temperature=0.7, top_k=5, logprobs=10, processed_logprobs=True),
              SP(temperature=0.0, logprobs=3, processed_logprobs=True),
              SP(temperature=0.7, top_k=5, logprobs=10)]
    sampler = Sampler(200, device, seed=0)
    out = sampler.sample(logits, params)
    probs = sampler.distribution(logits, params).double().cpu()
    top5 = out.logprobs[0].top[:5]
    assert [t for t, _ in top5] == probs[0].topk(5).indices.tolist()
    assert all(math.isclose(math.exp(v), probs[0, t].item(), abs_tol=1e-4) for t, v in top5)
    assert math.isclose(sum(math.exp(v) for _, v in top5), 1.0, abs_tol=1e-4)
    assert all(v == LOGPROB_FLOOR for _, v in out.logprobs[0].top[5:])  # filtered out: could not be drawn
    assert math.isclose(out.logprobs[0].logprob, math.log(probs[0, out.token_ids[0]].item()), abs_tol=1e-4)
    greedy = out.logprobs[1]
    assert greedy.logprob == 0.0 and greedy.top[0] == (out.token_ids[1], 0.0)
    assert [v for _, v in greedy.top[1:]] == [LOGPROB_FLOOR] * 2
    raw = torch.log_softmax(logits.double(), dim=1).cpu()
    assert math.isclose(out.logprobs[2].logprob, raw[2, out.token_ids[2]].item(), abs_tol=1e-4)  # raw unless asked


def test_logprobs_request_larger_than_vocab_is_capped(device):
    out = Sampler(4, device).sample(torch.randn(1, 4, device=device), [SP(temperature=0.0, logprobs=20)])
    assert len(out.logprobs[0].top) == 4


# -- robustness --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_never_crash_and_pick_a_finite_argmax(device, temperature):
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [0.0, nan, 2.0, 1.0],
            [inf, 0.5, -1.0, 0.0],
            [-inf, -inf, 3.0, -inf],
            [nan, nan, nan, nan],
            [inf, -inf, nan, inf],
        ],
        device=device,
    )
    params = [SP(temperature=temperature, top_p=0.9, top_k=3, logprobs=3)] * 5
    for seed in range(3):
        out = Sampler(4, device, seed=seed).sample(logits, params)
        assert out.token_ids[:3] == [2, 1, 2]  # argmax over the finite values
        assert all(0 <= t < 4 for t in out.token_ids)
        for lp in out.logprobs:
            assert math.isfinite(lp.logprob) and lp.logprob >= LOGPROB_FLOOR
            assert all(math.isfinite(v) for _, v in lp.top)


def test_padding_columns_beyond_vocab_are_ignored(device):
    logits = torch.zeros(2, 10, device=device)
    logits[:, 7:] = 100.0  # padded embedding rows
    out = Sampler(7, device, seed=0).sample(logits, [SP(temperature=0.0), SP(temperature=1.0)])
    assert all(0 <= t < 7 for t in out.token_ids)


def test_bad_shapes_raise_value_error(device):
    sampler = Sampler(8, device)
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, 8, device=device), [SP()])
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(1, 4, device=device), [SP()])
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(1, 8, device=device), [SP()], noise_keys=[None, None])


def test_bfloat16_logits_greedy_is_exact_argmax(device):
    logits = rand_logits(4, 100, 8, device).to(torch.bfloat16)
    out = Sampler(100, device).sample(logits, [SP(temperature=0.0)] * 4)
    assert out.token_ids == logits.float().argmax(dim=1).tolist()
