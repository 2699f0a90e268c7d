"""Cut replies and their continuations in the engine (``GenerateRequest.continued_tokens``):
a reply cut at ``max_tokens`` never ends in U+FFFD, one that truly ends on broken bytes
still shows it, and a cut reply continued from its token ids equals, token for token and
character for character, the reply written at once: cut inside a character, inside a stop
string, at a page boundary, once or twice; greedy, and seeded with penalties. The tiny model
that writes mostly non-ASCII tokens (``tiny_bytes_model_dir``) puts cuts inside characters."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import decode_text
from engine.errors import InvalidRequestError
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from tests.engine_helpers import Collected, collect, greedy, run_all

BLOCK = 16  # make_engine's block size (tokens)
N = 40  # tokens of the reply written at once
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "seeded_penalised": dict(temperature=0.9, seed=7, frequency_penalty=2.0, presence_penalty=1.0,
                             repetition_penalty=1.2),
}


def shown(cut: Collected, *continuations: Collected) -> str:
    """The reply's text after each continuation took back its ``trim_prior`` characters."""
    text = cut.text
    for cont in continuations:
        trim = sum(d.trim_prior for d in cont.deltas)
        text = text[: len(text) - trim] + cont.text
    return text


def trims_come_first(cont: Collected) -> bool:
    """A continuation's ``trim_prior`` comes on its first item with text, or its last."""
    for i, d in enumerate(cont.deltas):
        if d.trim_prior:
            return all(not e.text for e in cont.deltas[:i]) and sum(e.trim_prior for e in cont.deltas) == d.trim_prior
    return True


def cont_request(rid: str, prompt: list[int], done: list[int], params: SamplingParams) -> GenerateRequest:
    """Continue a reply of which ``done`` tokens were written, as the gateway does."""
    return GenerateRequest(rid, prompt_token_ids=prompt + done, continued_tokens=len(done), params=params)


async def test_a_cut_reply_never_ends_in_a_replacement_but_a_truly_ended_one_shows_it(tiny_bytes_model_dir,
                                                                                       start_engine):
    eng = start_engine(tiny_bytes_model_dir)
    tok = eng.core.tokenizer
    prompts = [tok.encode(t) for t in ("今天天气", "Hello", "😀 emoji")]
    whole = await run_all(eng, [GenerateRequest(f"w{i}", prompt_token_ids=p, params=greedy(N))
                                for i, p in enumerate(prompts)])
    reqs, want = [], []
    for i, (p, w) in enumerate(zip(prompts, whole)):
        out = w.final.output_token_ids
        for c in range(1, N):
            reqs.append(GenerateRequest(f"c{i}-{c}", prompt_token_ids=p, params=greedy(c)))
            want.append(out[:c])
    inside = 0
    for r, ids in zip(await run_all(eng, reqs), want):
        full = decode_text(tok, ids)
        inside += full.endswith("\ufffd")
        assert r.final.finish_reason == "length" and r.final.output_token_ids == ids
        assert r.text == r.final.output_text == full.rstrip("\ufffd")
        assert not r.text.endswith("\ufffd") and sum(d.trim_prior for d in r.deltas) == 0
    assert inside >= 10  # many cuts fell inside a character
    # a reply that truly ends (here a stop token) right after broken bytes shows them
    out, p = whole[0].final.output_token_ids, prompts[0]
    ends = [c for c in range(1, N) if decode_text(tok, out[:c]).endswith("\ufffd") and out[c] not in out[:c]]
    assert ends
    end = ends[0]
    r = await collect(eng, GenerateRequest("stop-tok", prompt_token_ids=p, params=greedy(N, stop_token_ids=[out[end]])))
    assert r.final.finish_reason == "stop" and r.final.output_token_ids == out[:end + 1]
    assert r.text == decode_text(tok, out[:end]) and r.text.endswith("\ufffd")


@pytest.mark.parametrize("sampling", list(SAMPLING))
async def test_a_continued_reply_equals_the_reply_written_at_once(tiny_bytes_model_dir, start_engine, sampling):
    eng = start_engine(tiny_bytes_model_dir)
    tok = eng.core.tokenizer
    prompt = tok.encode("今天天气很好")

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, **SAMPLING[sampling])

    whole = await collect(eng, GenerateRequest("whole", prompt_token_ids=prompt, params=params(N)))
    out = whole.final.output_token_ids
    rng = random.Random(sampling)
    page = [c for c in range(1, N) if (len(prompt) + c) % BLOCK in (0, 1, BLOCK - 1)]  # around a page's end
    inside = [c for c in range(1, N) if decode_text(tok, out[:c]).endswith("\ufffd")]
    assert page and len(inside) >= 4
    cuts = sorted({*page, *rng.sample(inside, 4), *rng.sample(range(1, N), 4)})
    cut = await run_all(eng, [GenerateRequest(f"cut{c}", prompt_token_ids=prompt, params=params(c)) for c in cuts])
    cont = await run_all(eng, [cont_request(f"cont{c}", prompt, out[:c], params(N - c)) for c in cuts])
    for c, a, b in zip(cuts, cut, cont):
        assert a.final.output_token_ids == out[:c] and not a.text.endswith("\ufffd")
        assert b.final.output_token_ids == out[c:], c
        assert shown(a, b) == whole.text, c
        assert b.final.usage.completion_tokens == N - c and trims_come_first(b)
        assert b.final.usage.cached_tokens >= (len(prompt) + c - 1) // BLOCK * BLOCK - BLOCK
    # cut twice: the second continuation's shown text is the first one's result
    c1, c2 = rng.choice(inside[: len(inside) // 2]), rng.choice(inside[len(inside) // 2:])
    first = await collect(eng, GenerateRequest("twice-1", prompt_token_ids=prompt, params=params(c1)))
    second = await collect(eng, cont_request("twice-2", prompt, out[:c1], params(c2 - c1)))
    third = await collect(eng, cont_request("twice-3", prompt, out[:c2], params(N - c2)))
    assert second.final.output_token_ids + third.final.output_token_ids == out[c1:]
    assert not shown(first, second).endswith("\ufffd") and shown(first, second, third) == whole.text


async def test_a_stop_string_across_the_cut_ends_the_continuation_as_the_uncut_reply_ends(tiny_bytes_model_dir,
                                                                                         start_engine):
    eng = start_engine(tiny_bytes_model_dir)
    tok = eng.core.tokenizer
    prompt = tok.encode("Hello")
    whole = await collect(eng, GenerateRequest("whole", prompt_token_ids=prompt, params=greedy(N)))
    text, rng = whole.text, random.Random(1)
    stops: list[str] = []
    while len(stops) < 4:  # a few stop strings of 2-4 characters from the middle of the reply
        at = rng.randrange(len(text) // 4, len(text) - 5)
        s = text[at:at + rng.randint(2, 4)]
        if "\ufffd" not in s and s not in stops:
            stops.append(s)
    took_back = 0
    for i, s in enumerate(stops):
        uncut = await collect(eng, GenerateRequest(f"u{i}", prompt_token_ids=prompt, params=greedy(N, stop=[s])))
        assert uncut.final.finish_reason == "stop" and uncut.final.stop_reason == s
        out = uncut.final.output_token_ids
        cuts = list(range(1, len(out)))
        cut = await run_all(eng, [GenerateRequest(f"c{i}-{c}", prompt_token_ids=prompt, params=greedy(c, stop=[s]))
                                  for c in cuts])
        live = [(c, a) for c, a in zip(cuts, cut) if a.final.finish_reason == "length"]
        cont = await run_all(eng, [cont_request(f"k{i}-{c}", prompt, out[:c], greedy(N - c, stop=[s]))
                                   for c, _ in live])
        for (c, a), b in zip(live, cont):
            assert (b.final.finish_reason, b.final.stop_reason) == ("stop", s), (s, c)
            assert b.final.output_token_ids == out[c:] and shown(a, b) == uncut.text, (s, c)
            assert trims_come_first(b)
            took_back += sum(d.trim_prior for d in b.deltas) > 0
        for a in cut:  # a cut whose own text completed the stop ends there
            if a.final.finish_reason == "stop":
                assert a.text == uncut.text and a.final.stop_reason == s
    assert took_back > 0  # some cut showed the start of a stop string that the continuation took back


async def test_continued_tokens_must_be_part_of_the_prompt_ids(tiny_model_dir, start_engine):
    eng = start_engine(tiny_model_dir)
    for req in (GenerateRequest("a", prompt_token_ids=[1, 2, 3], continued_tokens=3),
                GenerateRequest("b", prompt_token_ids=[1, 2, 3], continued_tokens=-1),
                GenerateRequest("c", messages=[{"role": "user", "content": "hi"}], continued_tokens=1)):
        with pytest.raises(InvalidRequestError, match="continued_tokens"):
            await collect(eng, req)
