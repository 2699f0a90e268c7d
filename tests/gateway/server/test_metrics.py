"""``/metrics``, ``/healthz`` and ``/readyz`` on a real gateway (real Redis, real engine
on the tiny model); ``/readyz`` also against a private Redis that the test stops."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.openai_api import openai_routes
from gateway.config import GatewayConfig
from gateway.server.app import new_secret
from gateway.server.extensions import create_app_with_extras, default_extras
from gateway.server.serving import ThreadedServer
from tests.gateway_helpers import chat
from tests.gateway_helpers import openai_client as client

QUESTION = [{"role": "user", "content": "Tell me about lighthouses."}]

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(base_url: str) -> Samples:
    """Every sample of ``/metrics``, parsed by prometheus-client's own parser, keyed by
    (sample name, sorted labels)."""
    r = httpx.get(f"{base_url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value (0 when absent: a labelled counter appears on first use)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_move_after_a_chat_completion(api_gateway):
    gw = api_gateway()
    url = gw.config.engine_urls[0]
    before = scrape(gw.base_url)
    assert value(before, "engine_up", engine=url) == 1
    assert value(before, "engine_kv_blocks_total", engine=url) == 512  # the fixture's --num-blocks
    r = client(gw).chat.completions.create(model="default", messages=QUESTION, max_tokens=9, temperature=0)
    after = scrape(gw.base_url)
    route = dict(route="/v1/chat/completions", method="POST", status="200")
    assert value(after, "gateway_http_requests_total", **route) == value(before, "gateway_http_requests_total",
                                                                         **route) + 1
    for kind in ("prompt", "cached", "completion"):
        name = f"gateway_{kind}_tokens_total"
        grew = value(after, name) - value(before, name)
        assert grew == (r.usage.prompt_tokens_details.cached_tokens if kind == "cached"
                        else getattr(r.usage, f"{kind}_tokens"))
    assert value(after, "gateway_ttft_seconds_count") == value(before, "gateway_ttft_seconds_count") + 1
    assert value(after, "gateway_tpot_seconds_count") == value(before, "gateway_tpot_seconds_count") + 1
    assert value(after, "gateway_replies_total", finish_reason=r.choices[0].finish_reason) >= 1
    assert value(after, "engine_requests_total", engine=url) > value(before, "engine_requests_total", engine=url)
    assert value(after, "engine_completion_tokens_total", engine=url) >= \
        value(before, "engine_completion_tokens_total", engine=url) + r.usage.completion_tokens
    assert value(after, "engine_requests_running", engine=url) == 0
    assert value(after, "gateway_replies_in_progress") == 0
    scrapes = dict(route="/metrics", method="GET", status="200")
    assert value(after, "gateway_http_requests_total", **scrapes) >= 1


def test_failed_requests_count_with_their_status_and_unknown_paths_under_one_label(api_gateway):
    gw = api_gateway()
    httpx.post(f"{gw.base_url}/v1/chat/completions", json={"model": "default", "messages": []}, timeout=30)
    for path in ("/nope/1", "/nope/2"):
        httpx.get(f"{gw.base_url}{path}", timeout=30)
    s = scrape(gw.base_url)
    assert value(s, "gateway_http_requests_total", route="/v1/chat/completions", method="POST", status="400") == 1
    assert value(s, "gateway_http_requests_total", route="unmatched", method="GET", status="404") == 2
    assert not any("/nope" in dict(labels).get("route", "") for _, labels in s)


async def test_browser_replies_and_open_websockets_are_counted(api_gateway):
    gw = api_gateway()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        during = scrape(gw.base_url)
        reply = await chat(ws, "Hello there.", max_tokens=6)
        assert reply.error is None
        after = scrape(gw.base_url)
    assert value(during, "gateway_websockets_open") == 1
    assert value(after, "gateway_completion_tokens_total") == reply.done["usage"]["completion_tokens"]
    assert value(after, "gateway_websocket_frames_sent_total") >= len(reply.deltas) + 2
    assert value(scrape(gw.base_url), "gateway_websockets_open") == 0


def test_an_unreachable_engine_reports_down(api_gateway):
    gw = api_gateway(engine_urls=["ws://127.0.0.1:9"], wait_for_engine=False)
    s = scrape(gw.base_url)
    assert value(s, "engine_up", engine="ws://127.0.0.1:9") == 0
    assert not any(name == "engine_kv_blocks_total" for name, _ in s)


def test_each_app_has_its_own_registry(api_gateway):
    a, b = api_gateway(), api_gateway()
    client(a).chat.completions.create(model="default", messages=QUESTION, max_tokens=2)
    route = dict(route="/v1/chat/completions", method="POST", status="200")
    assert value(scrape(a.base_url), "gateway_http_requests_total", **route) == 1
    assert value(scrape(b.base_url), "gateway_http_requests_total", **route) == 0
    routes, events, middleware = default_extras(a.config)
    paths = {getattr(r, "path", None) for r in routes}
    assert paths == {getattr(r, "path", None) for r in openai_routes()} | {"/metrics"}
    assert {"/v1/chat/completions", "/v1/models", "/metrics"} <= paths
    assert len(events) == 1 and len(middleware) == 1


# ---- health and readiness with a Redis that goes away -------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int) -> subprocess.Popen:
    """A private, non-persistent redis-server on ``port`` (waits until it answers)."""
    proc = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--daemonize", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "private redis-server did not start"
        time.sleep(0.05)


def stop_redis(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_status(url: str, status: int, timeout: float = 30) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url, timeout=10)
        if r.status_code == status:
            return r
        assert time.monotonic() < deadline, f"{url} stayed {r.status_code}: {r.text}"
        time.sleep(0.1)


def test_readyz_turns_503_while_redis_is_down_and_back_when_it_returns(engine_url, tmp_path):
    port = free_port()
    proc = start_redis(port)
    server: ThreadedServer | None = None
    try:
        config = GatewayConfig(host="127.0.0.1", port=0, redis_url=f"redis://127.0.0.1:{port}/0",
                               engine_urls=(engine_url,), secret_key=new_secret(), data_dir=tmp_path / "data")
        server = ThreadedServer(create_app_with_extras(config), config)
        base = f"http://127.0.0.1:{server.start()}"
        ready = wait_status(f"{base}/readyz", 200).json()
        assert ready["redis"] is True and ready["engines"] == 1
        stop_redis(proc)
        down = wait_status(f"{base}/readyz", 503).json()
        assert down["redis"] is False and down["engines"] == 1  # the reason: Redis, not the engine
        assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
        proc = start_redis(port)
        assert wait_status(f"{base}/readyz", 200).json()["redis"] is True
        assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
        s = scrape(base)
        assert value(s, "gateway_http_requests_total", route="/readyz", method="GET", status="503") >= 1
    finally:
        if server is not None:
            server.stop()
        stop_redis(proc)
