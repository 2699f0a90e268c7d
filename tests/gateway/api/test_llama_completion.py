"""llama-server's native ``POST /completion`` against a real gateway and the tiny engine:
the same reply as ``/v1/completions``, llama-server's answer keys, its SSE stream, and
several prompts answered as a list."""

from __future__ import annotations

import json

import httpx

PROMPT = "The lighthouse keeper said"


def _post(gw, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{gw.base_url}{path}", json=body, timeout=60)


def test_completion_answers_as_llama_server_with_the_v1_completions_text(api_gateway):
    gw = api_gateway()
    r = _post(gw, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "ignore_eos": True,
                                  "return_tokens": True, "cache_prompt": True})
    assert r.status_code == 200, r.text
    b = r.json()
    v1 = _post(gw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                       "ignore_eos": True}).json()
    assert b["content"] == v1["choices"][0]["text"] and b["stop"] is True
    assert b["tokens_predicted"] == b["timings"]["predicted_n"] == 6 == len(b["tokens"])
    assert b["tokens_evaluated"] == b["timings"]["prompt_n"] + b["timings"]["cache_n"] == v1["usage"]["prompt_tokens"]
    assert b["stop_type"] == "limit" and b["truncated"] is False and isinstance(b["has_new_line"], bool)
    assert b["generation_settings"]["n_predict"] == 6


def test_streamed_completion_joins_to_the_whole_one(api_gateway):
    gw = api_gateway()
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0}
    whole = _post(gw, "/completion", body).json()
    events = []
    with httpx.stream("POST", f"{gw.base_url}/completion", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(isinstance(e["stop"], bool) for e in events) and events[-1]["stop"] is True
    assert [e["stop"] for e in events].count(True) == 1
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_token_and_object_prompts_and_several_prompts(api_gateway):
    gw = api_gateway()
    ids = _post(gw, "/tokenize", {"content": PROMPT}).json()["tokens"]
    body = {"n_predict": 4, "temperature": 0}
    one = _post(gw, "/completion", {**body, "prompt": ids}).json()
    many = _post(gw, "/completion", {**body, "prompt": [ids, PROMPT, {"prompt_string": PROMPT}]}).json()
    assert isinstance(many, list) and [m["content"] for m in many] == [one["content"]] * 3
    half = len(ids) // 2
    text_tail = _post(gw, "/detokenize", {"tokens": ids[half:]}).json()["content"]
    mixed = _post(gw, "/completion", {**body, "prompt": [*ids[:half], text_tail], "return_tokens": True}).json()
    assert mixed["tokens_evaluated"] == half + len(_post(gw, "/tokenize", {"content": text_tail}).json()["tokens"])
    assert isinstance(mixed["content"], str)


def test_bad_completion_bodies_get_a_400_naming_the_field(api_gateway):
    gw = api_gateway()
    for body, param in [({"prompt": PROMPT, "mirostat": 2}, "mirostat"), ({"prompt": 5}, "prompt"),
                        ({"prompt": {"prompt_string": "a", "multimodal_data": "x"}}, "prompt"),
                        ({"prompt": PROMPT, "return_tokens": 1}, "return_tokens"),
                        ({"prompt": PROMPT, "n_predict": "many"}, "n_predict")]:
        r = _post(gw, "/completion", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_n_probs_gives_each_tokens_alternatives(api_gateway):
    gw = api_gateway()
    b = _post(gw, "/completion", {"prompt": PROMPT, "n_predict": 3, "temperature": 0, "ignore_eos": True,
                                  "n_probs": 4, "return_tokens": True}).json()
    probs = b["completion_probabilities"]
    assert [p["id"] for p in probs] == b["tokens"]
    assert all(len(p["top_logprobs"]) == 4 and p["logprob"] <= 0 and isinstance(p["bytes"], list) for p in probs)


def test_llama_logit_bias_by_id_or_text_bans_those_tokens(api_gateway):
    gw = api_gateway()
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    first = _post(gw, "/completion", body).json()["tokens"]
    banned = sorted(set(first))
    by_pairs = _post(gw, "/completion", {**body, "logit_bias": [[t, False] for t in banned]}).json()
    by_dict = _post(gw, "/completion", {**body, "logit_bias": {str(t): -100 for t in banned}}).json()
    assert by_pairs["tokens"] == by_dict["tokens"] and not set(by_pairs["tokens"]) & set(banned)
    text = _post(gw, "/detokenize", {"tokens": first[:1]}).json()["content"]
    by_text = _post(gw, "/completion", {**body, "logit_bias": [[text, -100]]}).json()
    assert first[0] not in by_text["tokens"]


def test_post_sampling_probs_are_the_samplers_probabilities(api_gateway):
    gw = api_gateway()
    # top_p 1: the gateway's default top_p (0.95) could cut the top 3 to fewer
    body = {"prompt": PROMPT, "n_predict": 4, "temperature": 1.0, "top_k": 3, "top_p": 1.0, "ignore_eos": True,
            "n_probs": 5, "post_sampling_probs": True, "return_tokens": True, "seed": 5}
    b = _post(gw, "/completion", body).json()
    probs = b["completion_probabilities"]
    assert [p["id"] for p in probs] == b["tokens"]
    for p in probs:  # top-k 3: three tokens could be drawn, their probabilities sum to 1
        assert len(p["top_probs"]) == 3 and 0 < p["prob"] <= 1 and "logprob" not in p
        assert abs(sum(t["prob"] for t in p["top_probs"]) - 1) < 1e-3
        assert p["id"] in [t["id"] for t in p["top_probs"]]
    raw = _post(gw, "/completion", {**body, "post_sampling_probs": False}).json()["completion_probabilities"]
    assert [len(p["top_logprobs"]) for p in raw] == [5] * 4  # the model's own distribution: every alternative
    assert _post(gw, "/completion", {**body, "post_sampling_probs": 1}).status_code == 400
