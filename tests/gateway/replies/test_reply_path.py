"""The reply path under operators' load: a busy engine stays up and keeps its replies
while ``/metrics`` and ``/readyz`` are hammered, and latency to Redis never turns into
``503 store_unavailable``. Real engine (the tiny model, in-process so the test can hold
its step thread: ``AsyncEngine.call`` with a function that blocks until released, the
way a long prefill holds it), real gateway, real Redis behind a latency proxy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.server import run_server
from tests.engine_helpers import make_engine
from tests.gateway_helpers import read_reply, recv, send


class ThreadedEngine:
    """A real engine server on its own thread and event loop (so a test's own loop, or a
    gateway fixture that waits synchronously, never stalls it)."""

    def __init__(self, model_dir: Any) -> None:
        self.eng = make_engine(model_dir, num_blocks=256)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.url = ""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        assert self._ready.wait(60), "the engine server did not start"

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        ready = asyncio.Event()
        task = asyncio.create_task(run_server(self.eng, "127.0.0.1", 0, ready=ready, stop=self._stop))
        await ready.wait()
        self._ready.set()
        await task

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture
def threaded_engine(tiny_model_dir, capsys) -> Iterator[ThreadedEngine]:
    e = ThreadedEngine(tiny_model_dir)
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ENGINE READY")][-1]
    e.url = line.split()[-1]
    yield e
    e.stop()


class HeldStep:
    """Holds the engine's step thread between two steps until ``release``."""

    def __init__(self, eng: Any) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.done = threading.Event()
        threading.Thread(target=self._submit, args=(eng,), daemon=True).start()

    def _submit(self, eng: Any) -> None:
        asyncio.run(eng.call(self._hold))
        self.done.set()

    def _hold(self, _core: Any) -> None:
        self.entered.set()
        self.go.wait(120)

    async def held(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 30), "the step thread never took the call"

    def release(self) -> None:
        self.go.set()


def engine_up(text: str) -> list[float]:
    return [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == "engine_up"]


async def test_engine_stays_up_and_replies_finish_while_metrics_are_hammered_during_a_long_step(
        gateway_factory, threaded_engine):
    gw = gateway_factory(engine_urls=[threaded_engine.url])
    cookie = gw.new_cookie()
    body = {"model": "default", "stream": True, "max_tokens": 24, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "item0 item1 item2. How many items?"}]}
    async with gw.connect(cookie) as ws, httpx.AsyncClient(base_url=gw.base_url, timeout=120) as http:
        await send(ws, {"type": "chat", "content": "Count to ten.",
                        "params": {"temperature": 0, "max_tokens": 24, "ignore_eos": True}})
        start = await recv(ws)
        assert start["type"] == "start"
        first = await recv(ws)
        assert first["type"] == "delta"  # the reply is running
        async with http.stream("POST", "/v1/chat/completions", json=body) as sse:
            assert sse.status_code == 200
            lines = sse.aiter_lines()
            while not (await lines.__anext__()).startswith("data: {"):
                pass  # its first chunk: the API's reply is in the engine too
            held = HeldStep(threaded_engine.eng)
            await held.held()
            try:
                async def scraper() -> list[tuple[int, int, list[float]]]:
                    seen = []
                    for _ in range(10):
                        m = await http.get("/metrics")
                        r = await http.get("/readyz")
                        seen.append((m.status_code, r.status_code, engine_up(m.text)))
                    return seen
                results = [x for xs in await asyncio.gather(*(scraper() for _ in range(8))) for x in xs]
                assert len(results) == 80
                assert all(m == 200 and r == 200 and up == [1.0] for m, r, up in results), results[:3]
                ages = [s.value for fam in text_string_to_metric_families((await http.get("/metrics")).text)
                        for s in fam.samples if s.name == "engine_stats_age_seconds"]
                assert len(ages) == 1 and ages[0] >= 0
            finally:
                held.release()
            rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            chunks = [json.loads(line[6:]) for line in rest[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length" or any(
                c["choices"] and c["choices"][0].get("finish_reason") == "length" for c in chunks)
        r = await read_reply(ws, start["request_id"], timeout=60)
        assert r.error is None and r.done["finish_reason"] == "length"
        assert r.done["usage"]["completion_tokens"] == 24
        assert r.seqs == list(range(2, 2 + len(r.seqs)))  # after the first delta, gapless


class LatencyProxy:
    """An asyncio TCP proxy that delays every chunk by ``delay_s`` in each direction
    (each chunk on its own timer, so chunks are not serialized behind each other)."""

    def __init__(self, upstream_host: str, upstream_port: int, delay_s: float) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = delay_s
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: set[asyncio.StreamWriter] = set()  # every socket it holds, closed by close()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self.writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(65536):
                loop.call_later(self.delay_s, _write, writer, data)
        finally:
            loop.call_later(self.delay_s, writer.close)

    async def close(self) -> None:
        """Stop accepting and close every socket now, on this event loop (a delayed close
        scheduled after the loop ends would leave them to the garbage collector)."""
        if self.server is not None:
            self.server.close()
        for w in self.writers:
            w.close()
        for w in self.writers:
            with contextlib.suppress(Exception):
                await w.wait_closed()


def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    if not writer.is_closing():
        writer.write(data)


async def test_redis_latency_under_a_burst_of_users_never_answers_503(gateway_factory, redis_url):
    host_port = redis_url.split("//", 1)[1].split("/", 1)[0]
    host, port = host_port.rsplit(":", 1)
    proxy = LatencyProxy(host, int(port), 0.05)
    await proxy.start()
    try:
        db = redis_url.rsplit("/", 1)[1] if redis_url.count("/") >= 3 else "0"
        # a small pool: 30 users at once need more connections than it has, so callers must queue
        gw = gateway_factory(redis_url=f"redis://127.0.0.1:{proxy.port}/{db}", redis_max_connections=8)
        cookies = await asyncio.gather(*(asyncio.to_thread(gw.new_cookie) for _ in range(30)))

        async def user(cookie: str) -> tuple[str | None, int]:
            async with gw.connect(cookie) as ws, gw.http(cookie) as http:
                await send(ws, {"type": "chat", "content": "Hi.", "params": {"max_tokens": 4, "temperature": 0}})
                listed = await http.get("/api/sessions")
                r = await read_reply(ws, timeout=120)
                return (r.error or {}).get("code"), listed.status_code

        results = await asyncio.gather(*(user(c) for c in cookies))
        assert [code for code, _ in results] == [None] * 30
        assert [status for _, status in results] == [200] * 30
    finally:
        await proxy.close()
