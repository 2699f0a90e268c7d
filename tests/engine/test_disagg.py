"""Prefill/decode disaggregation on the tiny random Llama: a prefill engine computes a
prompt's KV, a decode engine pulls the pages it lacks over the internal link, checks
each, and decodes. Greedy output must equal one engine's; every failed move either
falls back to local prefill or fails the request clearly; both engines' block
accounting stays whole."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

import engine.kv_page as kv_page
from engine.async_engine import AsyncEngine
from engine.errors import EngineError
from engine.outputs import GenerateRequest
from engine.server import run_server
from tests.engine_helpers import collect, greedy, make_engine

BS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def _serving(eng: AsyncEngine) -> AsyncIterator[str]:
    """``eng`` served on a free port of this loop; yields its ws:// URL."""
    port = _free_port()
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_server(eng, "127.0.0.1", port, ready=ready, stop=stop))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        stop.set()
        await task


@contextlib.asynccontextmanager
async def _pair(model_dir, prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
                ) -> AsyncIterator[tuple[AsyncEngine, str, AsyncEngine, AsyncEngine]]:
    """(prefill engine, its URL, decode engine, a reference engine of role both)."""
    p = make_engine(model_dir, role="prefill", **(prefill or {}))
    d = make_engine(model_dir, role="decode", **(decode or {}))
    ref = make_engine(model_dir)
    ref.start()
    d.start()
    try:
        async with _serving(p) as url:
            yield p, url, d, ref
    finally:
        d.shutdown()
        ref.shutdown()


def _req(rid: str, ids: list[int], n: int = 12, source: str | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=ids, params=greedy(n), kv_source=source)


async def _disaggregated(p: AsyncEngine, url: str, d: AsyncEngine, rid: str, ids: list[int], n: int = 12):
    """One turn as the gateway runs it: prefill engine first, then decode with its pages."""
    first = await collect(p, _req(rid + "-p", ids, n))
    assert first.final is not None and first.final.usage.completion_tokens == 1  # the role stops it at one
    return await collect(d, _req(rid, ids, n, url))


async def _assert_idle_whole(*engines: AsyncEngine) -> None:
    for eng in engines:
        await eng.call(lambda c: c.check_invariants())
        s = await eng.stats()
        assert s["running"] == s["waiting"] == 0 and s["blocks_held_by_requests"] == 0
        assert s["blocks_free"] + s["blocks_evictable"] == s["num_blocks"]


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 5 for i in range(n)]


async def test_greedy_output_through_prefill_and_decode_equals_one_engines(tiny_model_dir):
    async with _pair(tiny_model_dir) as (p, url, d, ref):
        ids = _prompt(1, 100)  # 6 whole pages before the last token
        want = await collect(ref, _req("ref", ids))
        got = await _disaggregated(p, url, d, "a", ids)
        assert got.final is not None and got.final.output_token_ids == want.final.output_token_ids
        assert got.final.usage.cached_tokens == 96  # the pulled pages served as a cache hit
        s = await d.stats()
        assert (s["kv_pulls_total"], s["kv_pull_pages_total"], s["kv_pull_failures_total"]) == (1, 6, 0)
        assert s["kv_pull_bytes_total"] > 6 * kv_page.DIGEST_BYTES
        await _assert_idle_whole(p, d)


async def test_a_prompt_shorter_than_one_page_moves_nothing_and_matches(tiny_model_dir):
    async with _pair(tiny_model_dir) as (p, url, d, ref):
        ids = _prompt(2, BS - 3)
        want = await collect(ref, _req("ref", ids))
        got = await _disaggregated(p, url, d, "short", ids)
        assert got.final.output_token_ids == want.final.output_token_ids
        assert (await d.stats())["kv_pulls_total"] == 0
        await _assert_idle_whole(p, d)


async def test_a_prompt_cached_on_the_decode_side_only_pulls_nothing_and_matches(tiny_model_dir):
    async with _pair(tiny_model_dir) as (p, url, d, ref):
        ids = _prompt(3, 90)
        want = await collect(ref, _req("ref", ids))
        await collect(d, _req("warm", ids))  # the decode engine holds the whole prompt
        got = await collect(d, _req("b", ids, source=url))  # the prefill engine never saw it
        assert got.final.output_token_ids == want.final.output_token_ids
        assert (await d.stats())["kv_pulls_total"] == 0
        await _assert_idle_whole(p, d)


async def test_a_partial_hit_on_the_decode_side_pulls_only_the_rest_and_matches(tiny_model_dir):
    async with _pair(tiny_model_dir) as (p, url, d, ref):
        ids = _prompt(4, 120)  # 7 pages wanted
        await collect(d, _req("warm", ids[:3 * BS + 5], n=1))  # 3 pages on the decode side
        want = await collect(ref, _req("ref", ids))
        got = await _disaggregated(p, url, d, "c", ids)
        assert got.final.output_token_ids == want.final.output_token_ids
        s = await d.stats()
        assert (s["kv_pulls_total"], s["kv_pull_pages_total"]) == (1, 4)
        await _assert_idle_whole(p, d)


async def test_a_later_long_turn_reuses_the_reply_held_on_the_decode_side(tiny_model_dir):
    # the prefill engine pulls the earlier reply's pages from the decode engine and
    # computes only the new message; the decode engine then pulls only the new pages
    async with _pair(tiny_model_dir) as (p, url, d, ref), _serving(d) as d_url:
        first = _prompt(12, 100)
        want1 = await collect(ref, _req("ref1", first, n=40))
        got1 = await _disaggregated(p, url, d, "turn1", first, n=40)
        assert got1.final.output_token_ids == want1.final.output_token_ids
        # the decode engine computed 100 + 39 tokens: 8 whole pages; the prefill engine 6
        second = first + got1.final.output_token_ids + _prompt(13, 60)  # 200 tokens, 12 pages wanted
        want2 = await collect(ref, _req("ref2", second))
        p0, d0 = await p.stats(), await d.stats()
        pre = await collect(p, _req("turn2-p", second, source=d_url))
        assert pre.final.usage.cached_tokens == 8 * BS  # 6 pages its own, 2 pulled: not recomputed
        p1 = await p.stats()
        assert (p1["kv_pulls_total"] - p0["kv_pulls_total"], p1["kv_pull_pages_total"] - p0["kv_pull_pages_total"],
                p1["kv_pull_failures_total"] - p0["kv_pull_failures_total"]) == (1, 2, 0)
        got2 = await collect(d, _req("turn2", second, source=url))
        assert got2.final.output_token_ids == want2.final.output_token_ids
        assert got2.final.usage.cached_tokens == 12 * BS
        d1 = await d.stats()
        assert d1["kv_pull_pages_total"] - d0["kv_pull_pages_total"] == 4  # the new message's pages only
        await _assert_idle_whole(p, d)


@contextlib.asynccontextmanager
async def _a_reply_decoding(eng: AsyncEngine, rid: str) -> AsyncIterator[None]:
    """A long reply decoding on ``eng`` (its first token out) for the block's duration."""
    first = asyncio.Event()

    async def run() -> None:
        async for _out in eng.generate(_req(rid, _prompt(99, 10), n=1500)):
            first.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(first.wait(), 30)
    try:
        yield
    finally:
        eng.abort(rid)  # the reply ends with its "abort" output once the engine freed it
        await asyncio.wait_for(task, 30)


async def test_a_moved_prompt_puts_no_prefill_chunk_in_the_decode_engines_steps(tiny_model_dir):
    async with _pair(tiny_model_dir) as (p, url, d, ref):
        ids = _prompt(16, 100)
        async with _a_reply_decoding(ref, "stream"):  # one engine: the prompt rides in its decode steps
            await collect(ref, _req("ref", ids))
        s = await ref.stats()
        assert s["mixed_steps_total"] >= 1 and s["long_chunk_steps_total"] >= 1
        async with _a_reply_decoding(d, "stream"):  # the pair: the decode engine computes 4 tokens
            got = await _disaggregated(p, url, d, "moved", ids)
        assert got.final.usage.cached_tokens == 96
        s = await d.stats()
        assert s["mixed_steps_total"] >= 1 and s["mixed_prompt_tokens_total"] <= 4 * s["mixed_steps_total"]
        assert s["long_chunk_steps_total"] == 0
        await _assert_idle_whole(p, d)


def _flip_a_byte_of_page(monkeypatch, index: int) -> None:
    """The source serializes its ``index``-th page of every fetch with one payload byte flipped."""
    real = kv_page.encode_page
    count = {"n": 0}

    def corrupt(header, kv):
        data = bytearray(real(header, kv))
        count["n"] += 1
        if count["n"] == index + 1:
            data[len(data) // 2] ^= 0x40
        return bytes(data)

    monkeypatch.setattr(kv_page, "encode_page", corrupt)


async def test_a_corrupt_page_is_refused_and_the_rest_is_computed_locally(tiny_model_dir, monkeypatch):
    _flip_a_byte_of_page(monkeypatch, 2)
    async with _pair(tiny_model_dir) as (p, url, d, ref):
        ids = _prompt(5, 100)
        want = await collect(ref, _req("ref", ids))
        got = await _disaggregated(p, url, d, "x", ids)
        assert got.final.output_token_ids == want.final.output_token_ids
        s = await d.stats()
        assert (s["kv_pull_failures_total"], s["kv_pull_pages_total"]) == (1, 2)  # the pages before it
        assert got.final.usage.cached_tokens == 2 * BS
        await _assert_idle_whole(p, d)


async def test_a_corrupt_page_fails_the_request_clearly_when_set_to_fail(tiny_model_dir, monkeypatch):
    _flip_a_byte_of_page(monkeypatch, 0)
    async with _pair(tiny_model_dir, decode={"kv_pull_failure": "fail"}) as (p, url, d, _ref):
        with pytest.raises(EngineError) as e:
            await _disaggregated(p, url, d, "y", _prompt(6, 100))
        assert e.value.code == "kv_transfer_failed" and "checksum" in e.value.message
        await _assert_idle_whole(p, d)


@contextlib.asynccontextmanager
async def _relay(upstream: str, after_pages: int, on_reach: str = "cut",
                 reached: asyncio.Event | None = None, release: asyncio.Event | None = None) -> AsyncIterator[str]:
    """A link to ``upstream`` that passes ``after_pages`` binary page frames, sets
    ``reached``, then either dies at once, both sides closed (``on_reach="cut"``: a
    source engine lost in the middle of a transfer), or holds the rest back until
    ``release`` (``"hold"``: a transfer stuck midway, for as long as the test likes)
    and then passes what the upstream still sends, closing when the upstream does.
    With ``on_reach="hold_fetch"`` it is the asker's ``kv_fetch`` that waits for
    ``release`` (``reached`` set when it arrives; ``after_pages`` unused): the source
    has not answered yet, whatever happens to it meanwhile."""

    async def handle(client) -> None:
        async with connect(upstream, max_size=None) as up:
            async def down() -> None:
                sent = 0
                with contextlib.suppress(Exception):
                    async for msg in up:
                        if isinstance(msg, bytes):
                            if sent == after_pages and on_reach != "hold_fetch":
                                if reached is not None:
                                    reached.set()
                                if on_reach == "cut":
                                    break
                                await (release or asyncio.Event()).wait()
                            sent += 1
                        await client.send(msg)
                await client.close()
                await up.close()

            task = asyncio.create_task(down())
            with contextlib.suppress(Exception):
                async for msg in client:
                    if on_reach == "hold_fetch" and isinstance(msg, str) and json.loads(msg)["type"] == "kv_fetch":
                        if reached is not None:
                            reached.set()
                        await (release or asyncio.Event()).wait()
                    await up.send(msg)
            task.cancel()
            await client.close()

    port = _free_port()
    async with serve(handle, "127.0.0.1", port, max_size=None):
        yield f"ws://127.0.0.1:{port}"


async def test_a_transfer_cut_midway_falls_back_to_local_prefill(tiny_model_dir):
    async with _pair(tiny_model_dir) as (p, url, d, ref):
        ids = _prompt(7, 100)
        want = await collect(ref, _req("ref", ids))
        await collect(p, _req("z-p", ids))
        async with _relay(url, after_pages=3) as cut:
            got = await collect(d, _req("z", ids, source=cut))
        assert got.final.output_token_ids == want.final.output_token_ids
        s = await d.stats()
        assert (s["kv_pull_failures_total"], s["kv_pull_pages_total"]) == (1, 3)
        await _assert_idle_whole(p, d)


async def test_a_transfer_cut_midway_fails_clearly_when_set_to_fail(tiny_model_dir):
    async with _pair(tiny_model_dir, decode={"kv_pull_failure": "fail"}) as (p, url, d, _ref):
        ids = _prompt(8, 100)
        await collect(p, _req("w-p", ids))
        async with _relay(url, after_pages=1) as cut:
            with pytest.raises(EngineError) as e:
                await collect(d, _req("w", ids, source=cut))
        assert e.value.code == "kv_transfer_failed" and "closed" in e.value.message
        await _assert_idle_whole(p, d)


async def test_pages_evicted_at_the_source_before_the_read_fall_back_or_fail(tiny_model_dir):
    # a prefill pool of 8 pages: the next prompt evicts the first one's pages before it is read
    async with _pair(tiny_model_dir, prefill={"num_blocks": 8}) as (p, url, d, ref):
        ids, other = _prompt(9, 100), _prompt(10, 100)
        want = await collect(ref, _req("ref", ids))
        await collect(p, _req("v-p", ids))
        await collect(p, _req("u-p", other))
        got = await collect(d, _req("v", ids, source=url))
        assert got.final.output_token_ids == want.final.output_token_ids
        s = await d.stats()
        assert s["kv_pull_failures_total"] == 1 and s["kv_pull_pages_total"] < 6
        await d.call(lambda c: c.config.__setattr__("kv_pull_failure", "fail"))
        await d.call(lambda c: c.evict_all())
        await collect(p, _req("v-p2", ids))
        await collect(p, _req("u-p2", other))
        with pytest.raises(EngineError) as e:
            await collect(d, _req("v2", ids, source=url))
        assert e.value.code == "kv_transfer_failed" and "evicted" in e.value.message
        await _assert_idle_whole(p, d)


async def test_an_abort_during_a_transfer_leaves_both_engines_whole(tiny_model_dir):
    async with _pair(tiny_model_dir) as (p, url, d, _ref):
        ids = _prompt(11, 200)
        await collect(p, _req("t-p", ids))
        reached = asyncio.Event()
        async with _relay(url, 4, "hold", reached) as stuck:
            task = asyncio.create_task(collect(d, _req("t", ids, source=stuck)))
            await asyncio.wait_for(reached.wait(), 30)
            task.cancel()  # the user's Stop while the pages are in flight
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await _assert_idle_whole(p, d)
        for eng in (p, d):  # with every cached page evicted, every block is free
            assert await eng.call(lambda c: (c.evict_all(), c.pool.num_free)[1]) == eng.core.pool.num_blocks


async def _prefill_over_the_link(url: str, rid: str, ids: list[int]) -> None:
    """One prefill on the engine process at ``url`` (the internal protocol), to its end."""
    async with connect(url, max_size=None) as ws:
        await ws.recv()  # hello
        await ws.send(json.dumps({"type": "generate", "request_id": rid, "prompt_token_ids": ids,
                                  "params": {"max_tokens": 1, "temperature": 0}}))
        async for raw in ws:
            items = json.loads(raw).get("items", [])
            assert not any(i["type"] == "error" for i in items), items
            if any(i["type"] == "done" for i in items):
                return


@pytest.mark.parametrize("setting", ["local", "fail"])
async def test_the_prefill_engine_process_killed_during_a_pull_falls_back_or_fails_per_the_setting(
        tiny_model_dir, setting):
    from gateway.server.local import LocalEngine

    # the prefill engine is a real process, in the decode engine's format (float32 KV, pages of 16)
    proc = LocalEngine(model=str(tiny_model_dir), extra_args=[
        "--role", "prefill", "--device", "cpu", "--dtype", "float32", "--block-size", str(BS), "--num-blocks",
        "256", "--threads", "1", "--no-kv-disk", "--speculative", "off"])
    url = proc.start(timeout_s=600)
    d = make_engine(tiny_model_dir, role="decode", kv_pull_failure=setting)
    ref = make_engine(tiny_model_dir)
    d.start()
    ref.start()
    try:
        # a first move goes through: the process's pages are the decode engine's format
        ok = _prompt(14, 100)
        await _prefill_over_the_link(url, "ok-p", ok)
        got = await collect(d, _req("ok", ok, source=url))
        assert got.final.output_token_ids == (await collect(ref, _req("ref-ok", ok))).final.output_token_ids
        assert ((await d.stats())["kv_pull_pages_total"], (await d.stats())["kv_pull_failures_total"]) == (6, 0)

        ids = _prompt(15, 150)
        await _prefill_over_the_link(url, "k-p", ids)
        # killed between the ask and the answer: pages a process wrote before it died still
        # arrive (the kernel delivers them), so this is where a kill leaves pages unsent
        reached, release = asyncio.Event(), asyncio.Event()
        async with _relay(url, 0, "hold_fetch", reached, release) as link:
            task = asyncio.create_task(collect(d, _req("k", ids, source=link)))
            await asyncio.wait_for(reached.wait(), 30)  # the decode engine has asked for the pages
            assert proc.process is not None
            proc.process.send_signal(signal.SIGKILL)
            assert await asyncio.to_thread(proc.process.wait, 30) == -signal.SIGKILL
            release.set()
            if setting == "local":  # computed here instead, the same greedy answer
                got = await asyncio.wait_for(task, 60)
                assert got.final.output_token_ids == (await collect(ref, _req("ref-k", ids))).final.output_token_ids
                assert got.final.usage.cached_tokens == 0
            else:
                with pytest.raises(EngineError) as e:
                    await asyncio.wait_for(task, 60)
                assert e.value.code == "kv_transfer_failed" and "after 0 pages" in e.value.message
        s = await d.stats()
        assert (s["kv_pulls_total"], s["kv_pull_failures_total"], s["kv_pull_pages_total"]) == (2, 1, 6)
        await _assert_idle_whole(d)
    finally:
        proc.stop()
        d.shutdown()
        ref.shutdown()


@pytest.mark.parametrize("bad", [{"role": "router"}, {"kv_pull_failure": "retry"}, {"kv_pull_timeout_s": 0}])
def test_bad_role_and_pull_settings_are_config_errors(bad):
    from engine.config import EngineConfig
    from engine.errors import ConfigError

    with pytest.raises(ConfigError):
        EngineConfig(**bad)
