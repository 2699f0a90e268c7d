"""The disk KV tier seen from outside: after an engine restart a chat's next turn
restores its KV from disk, and the OpenAI API's usage and /metrics say so."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.fixtures_servers import ENGINE_ARGS, _running_engine
from tests.gateway_helpers import openai_client as client

KEY = "sk-tiers-test"
CHAT = [{"role": "system", "content": "You are a careful assistant who answers in full sentences."},
        {"role": "user", "content": "Describe, in some detail, how a lighthouse keeper spent a winter night "
                                    "on a rocky island in the nineteenth century, what the lamp needed, "
                                    "and what the keeper wrote in the log before dawn."}]


def _turn(gw: Any) -> Any:
    # one API key: one user, so one cache salt (anonymous requests are a new user each)
    return client(gw, api_key=KEY).chat.completions.create(model="default", messages=CHAT, max_tokens=8, temperature=0)


def test_after_an_engine_restart_the_chat_comes_back_from_disk_and_usage_says_so(
        tiny_model_dir: Path, tmp_path: Path, api_gateway) -> None:
    args = ENGINE_ARGS + ["--threads", "1", "--kv-disk-dir", str(tmp_path / "kv")]
    with _running_engine(tiny_model_dir, args) as engine:
        assert engine.url is not None
        gw = api_gateway(engine_urls=[engine.url], api_key=KEY)
        first = _turn(gw)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        engine.stop()
        engine.start(timeout_s=600)  # a restart: same port, same directory, an empty pool
        deadline = time.monotonic() + 60
        while not gw.state.router.healthy and time.monotonic() < deadline:
            time.sleep(0.05)  # the gateway reconnects
        back = _turn(gw)
        details = back.usage.prompt_tokens_details
        split = details.model_extra["cached_tokens_by_tier"]
        assert back.choices[0].message.content == first.choices[0].message.content
        assert details.cached_tokens >= 16 and split == {"pool": 0, "host": 0, "disk": details.cached_tokens}
        metrics = httpx.get(gw.base_url + "/metrics", timeout=30).text
        read = [ln for ln in metrics.splitlines() if ln.startswith("engine_kv_disk_pages_read_total")]
        assert read and float(read[0].split()[-1]) * 16 >= details.cached_tokens


def test_with_write_idle_a_sigterm_writes_the_cache_and_the_restarted_engine_restores_the_chat(
        tiny_model_dir: Path, tmp_path: Path, api_gateway) -> None:
    args = ENGINE_ARGS + ["--threads", "1", "--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-write", "idle"]
    with _running_engine(tiny_model_dir, args) as engine:
        assert engine.url is not None
        gw = api_gateway(engine_urls=[engine.url], api_key=KEY)
        first = _turn(gw)
        engine.stop()  # SIGTERM: a graceful stop writes the pages the disk lacks
        assert any("pages of the cache at stop, 0 left unwritten" in ln for ln in engine.output_tail)
        engine.start(timeout_s=600)
        deadline = time.monotonic() + 60
        while not gw.state.router.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        back = _turn(gw)
        details = back.usage.prompt_tokens_details
        assert back.choices[0].message.content == first.choices[0].message.content
        assert details.cached_tokens >= 16
        assert details.model_extra["cached_tokens_by_tier"] == {"pool": 0, "host": 0, "disk": details.cached_tokens}
