"""``POST /tokenize`` and ``/detokenize`` against a real gateway and the tiny engine: the
engine's tokenizer in llama-server's and vLLM's body shapes, and clear 400s for bad bodies."""

from __future__ import annotations

import httpx


def _post(gw, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{gw.base_url}{path}", json=body, timeout=60)


def _hf_tokenizer(gw):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gw.state.router.clients[0].info.tokenizer_dir)


def test_tokenize_gives_the_engine_tokenizers_ids_and_detokenize_reverses_them(api_gateway):
    gw = api_gateway()
    text = "What is the capital of France ?"
    r = _post(gw, "/tokenize", {"content": text})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == _hf_tokenizer(gw).encode(text, add_special_tokens=False)
    assert r.json()["count"] == len(ids)
    back = _post(gw, "/detokenize", {"tokens": ids})
    assert back.status_code == 200 and back.json()["content"] == text == back.json()["prompt"]


def test_vllm_prompt_form_and_pieces(api_gateway):
    gw = api_gateway()
    text = "unicode 媽 and emoji 🤗"
    ids = _post(gw, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    pieces = _post(gw, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert all(isinstance(p["piece"], str) and p["piece"] for p in pieces)


def test_bad_tokenize_bodies_get_a_400_naming_the_field(api_gateway):
    gw = api_gateway()
    cases = [({"content": 5}, "content"), ({}, "content"), ({"content": "a", "prompt": "b"}, "content"),
             ({"content": "a", "with_pieces": "yes"}, "with_pieces"), ({"content": "a", "bogus": 1}, "bogus")]
    for body, param in cases:
        r = _post(gw, "/tokenize", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    for body in ({"tokens": "1 2"}, {"tokens": [1, -1]}, {"tokens": [10 ** 9]}, {"tokens": [True]}, []):
        r = _post(gw, "/detokenize", body)
        assert r.status_code == 400 and "error" in r.json(), (body, r.text)
