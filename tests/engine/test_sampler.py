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


def _nucleus_by_full_sort(logits: torch.Tensor, temperature: float, top_p: float) -> set[int]:
    """The nucleus by its definition: sort the temperature-scaled probabilities (ties by
    lower id), keep each token whose mass before it is below top_p."""
    z = (logits - logits.amax()) / temperature
    sp, ranked = torch.sort(torch.softmax(z, dim=0), descending=True, stable=True)
    keep = (torch.cumsum(sp, dim=0) - sp) < top_p
    return set(ranked[keep].tolist())


@pytest.mark.parametrize("candidates", [256, 3], ids=["default", "levels_forced"])
def test_nucleus_kept_set_equals_the_sorted_cumsum_definition_with_ties(device, candidates):
    """Random rows, many with ties (logits rounded to a coarse grid), peaked and flat,
    tiny and near-one top_p: the kept set is the full sort's, whichever candidate
    level the batch needed."""
    vocab = 3000
    g = torch.Generator().manual_seed(21)
    rows = []
    for i in range(12):
        row = torch.randn(vocab, generator=g) * (0.3 + i)
        rows.append(torch.round(row * 2) / 2 if i % 2 else row)  # even rows: ties everywhere
    logits = torch.stack(rows).to(device)
    sampler = Sampler(vocab, device, top_p_candidates=candidates)
    for top_p in (1e-6, 0.3, 0.9, 0.95, 0.999):
        for t in (0.7, 1.3):
            probs = sampler.distribution(logits, [SP(temperature=t, top_p=top_p)] * len(rows))
            for r in range(len(rows)):
                assert support(probs[r]) == _nucleus_by_full_sort(logits[r].cpu(), t, top_p), (top_p, t, r)


def test_top_p_one_keeps_everything_and_a_tiny_top_p_is_greedy_with_ties(device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5] + [-2.0] * 400], device=device)  # tie at the top: ids 1, 2
    sampler = Sampler(404, device, top_p_candidates=2)
    assert support(sampler.distribution(logits, [SP(temperature=0.7, top_p=1.0)])[0]) == set(range(404))
    assert support(sampler.distribution(logits, [SP(temperature=0.7, top_p=1e-9)])[0]) == {1}
    out = sampler.sample(logits.repeat(50, 1), [SP(temperature=0.7, top_p=1e-9)] * 50)
    assert set(out.token_ids) == {1}


def test_min_p_after_top_p_keeps_the_renormalised_nucleus_above_its_bar(device):
    vocab = 2000
    logits = rand_logits(6, vocab, 33, device, scale=2.5)
    sampler = Sampler(vocab, device)
    probs = sampler.distribution(logits, [SP(temperature=0.8, top_p=0.9, min_p=0.05)] * 6)
    for r in range(6):
        nucleus = sorted(_nucleus_by_full_sort(logits[r].cpu(), 0.8, 0.9))
        p = torch.softmax((logits[r].cpu() - logits[r].cpu().amax()) / 0.8, dim=0)[nucleus]
        p = p / p.sum()
        expected = {t for t, v in zip(nucleus, p.tolist()) if v >= 0.05 * max(p.tolist())}
        assert support(probs[r]) == expected


def test_nucleus_draws_follow_the_renormalised_nucleus(device):
    """Drawing among the candidates only samples the same distribution: the empirical
    frequencies of 20000 unseeded rows and of 3000 seeded positions match the nucleus
    renormalised, and no token outside it is ever drawn."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04] + [0.0] * 300) + 1e-9
    logits = probs.log().unsqueeze(0).to(device)
    params = SP(temperature=1.0, top_p=0.85)  # keeps ids 0..3 (mass before id 4 is 0.9)
    want = probs[:4] / probs[:4].sum()
    sampler = Sampler(306, device, seed=5, top_p_candidates=8)
    out = sampler.sample(logits.repeat(20000, 1), [params] * 20000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=306).float() / 20000
    assert freq[4:].sum() == 0 and torch.allclose(freq[:4], want, atol=0.015)
    seeded = SP(temperature=1.0, top_p=0.85, seed=9)
    ids = [sampler.sample(logits, [seeded], [noise_key(9, i)]).token_ids[0] for i in range(3000)]
    freq = torch.bincount(torch.tensor(ids), minlength=306).float() / 3000
    assert freq[4:].sum() == 0 and torch.allclose(freq[:4], want, atol=0.03)


def test_seeded_nucleus_draw_does_not_depend_on_the_candidate_width_or_neighbours(device):
    """A seeded top-p row's token is the same alone, beside a flat row that makes the
    batch search 16x more candidates or sort the whole vocabulary, beside a top_p=1 row
    (drawn over the whole vocabulary) and in a fresh sampler."""
    vocab = 5000
    target = rand_logits(1, vocab, 77, device, scale=3.0)
    flat = torch.zeros(1, vocab, device=device)
    params = SP(temperature=0.9, top_p=0.9, seed=3)
    batches = {
        "alone": (target, [params]),
        "flat_neighbour": (torch.cat([flat, target]), [SP(temperature=1.0, top_p=0.99), params]),
        "top_p_one_neighbour": (torch.cat([target, flat]), [params, SP(temperature=1.0)]),
    }
    for k in range(20):
        got = set()
        for logits, ps in batches.values():
            keys = [noise_key(3, k) if p.seed == 3 else None for p in ps]
            out = Sampler(vocab, device, seed=k).sample(logits, ps, keys)
            got.add(out.token_ids[[p.seed for p in ps].index(3)])
        assert len(got) == 1, (k, got)


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


def test_frequency_and_presence_penalties_equal_the_whole_vocabulary_formula(device):
    """The penalties change only the generated tokens' logits (``PenaltyState.counted``):
    the same bits as ``x - f * counts - p * (counts > 0)`` over the whole row, drafts
    counted too, and rows without a penalty untouched."""
    vocab = 700
    logits = rand_logits(3, vocab, 41, device, scale=4.0)
    outputs = [[5, 9, 5, 600, 5], [], [42, 43]]
    extra = [[9, 699], [1], []]
    params = [SP(temperature=1.0, frequency_penalty=0.4), SP(temperature=1.0, frequency_penalty=-0.3,
              presence_penalty=0.7), SP(temperature=1.0)]
    states = [PenaltyState(vocab, device, prompt_ids=[1, 2, 3], output_ids=o) for o in outputs]
    states[2] = None
    sampler = Sampler(vocab, device)
    x, rows, _ = sampler._prepare(logits, params, None, states)
    pen = sampler._penalise(x, params, states, rows.penal, extra)
    want = logits.clone()
    for r in range(2):
        counts = torch.zeros(vocab, device=device)
        for t in outputs[r] + extra[r]:
            counts[t] += 1
        f, p = params[r].frequency_penalty, params[r].presence_penalty
        want[r] = want[r] - torch.tensor([f], device=device) * counts
        want[r] = want[r] - torch.tensor([p], device=device) * (counts > 0).float()
    assert torch.equal(pen, want)
    assert torch.equal(logits, rand_logits(3, vocab, 41, device, scale=4.0))  # the caller's logits stay raw


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
