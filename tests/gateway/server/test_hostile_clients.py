"""Hostile clients are bounded: request heads are capped in bytes, fields and time
(431/408, gateway/server/http_limits.py), hosts are allowed by name (DNS rebinding fails), the
page's CSP is an HTTP header, sockets per user and per address are capped, and what
anonymous users see and get is limited (docs/reliability.md, the probe table)."""

from __future__ import annotations

import logging
import socket
import time

import httpx

HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def _port(gw) -> int:
    return int(gw.base_url.rsplit(":", 1)[1])


def _read_all(s: socket.socket, limit_s: float = 30.0) -> bytes:
    """Everything the server sends until it closes (fails after ``limit_s``)."""
    s.settimeout(limit_s)
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def test_a_64_mib_header_is_refused_with_431_after_a_bounded_number_of_bytes(gateway_factory):
    gw = gateway_factory(wait_for_engine=False)
    limit = gw.config.limits.http_max_header_bytes
    s = socket.create_connection(("127.0.0.1", _port(gw)), timeout=30)
    sent = 0
    chunk = b"b" * 65536
    try:
        s.sendall(HEAD + b"X-Big: ")
        while sent < 64 * 1024 * 1024:
            s.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server closed the connection: what it read of the header is bounded
    try:
        answer = _read_all(s)
    except ConnectionResetError:
        answer = b""
    s.close()
    # the kernel buffers some bytes on both sides; the server itself stops reading at the cap
    assert sent < 64 * 1024 * 1024, "the whole 64 MiB header was accepted"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert limit < 1024 * 1024
    assert httpx.get(gw.base_url + "/healthz", timeout=10).status_code == 200  # still serving


def test_a_header_just_over_the_cap_gets_431_and_one_under_it_is_served(gateway_factory):
    gw = gateway_factory(wait_for_engine=False)
    limit = gw.config.limits.http_max_header_bytes
    with socket.create_connection(("127.0.0.1", _port(gw)), timeout=30) as s:
        s.sendall(HEAD + b"X-Big: " + b"b" * limit + b"\r\n\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 431")
    r = httpx.get(gw.base_url + "/healthz", headers={"X-Big": "b" * (limit // 2)}, timeout=10)
    assert r.status_code == 200


def test_too_many_header_fields_get_431(gateway_factory):
    gw = gateway_factory(wait_for_engine=False)
    n = gw.config.limits.http_max_headers + 1
    with socket.create_connection(("127.0.0.1", _port(gw)), timeout=30) as s:
        s.sendall(HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(n)) + b"\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 431")


def test_a_trickled_header_gets_408_and_the_connection_is_closed(gateway_factory):
    gw = gateway_factory(wait_for_engine=False, limits={"http_header_timeout_s": 1.0})
    with socket.create_connection(("127.0.0.1", _port(gw)), timeout=30) as s:
        s.sendall(HEAD + b"X-Slow: ")
        s.setblocking(False)
        answer, deadline = b"", time.monotonic() + 60  # a bound for a broken server, not a timing assert
        while time.monotonic() < deadline:
            try:
                s.sendall(b"b" * 10)
            except (BrokenPipeError, ConnectionResetError, BlockingIOError):
                pass
            try:
                chunk = s.recv(4096)
            except BlockingIOError:
                time.sleep(0.2)
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]


def test_a_silent_connection_is_closed_after_the_header_timeout(gateway_factory):
    gw = gateway_factory(wait_for_engine=False, limits={"http_header_timeout_s": 1.0})
    with socket.create_connection(("127.0.0.1", _port(gw)), timeout=30) as s:
        assert _read_all(s).startswith(b"HTTP/1.1 408")


def test_keep_alive_requests_and_large_bodies_are_unaffected(gateway_factory):
    gw = gateway_factory(wait_for_engine=False, limits={"http_header_timeout_s": 1.0})
    with httpx.Client(base_url=gw.base_url, timeout=10) as c:
        for _ in range(3):
            assert c.get("/healthz").status_code == 200
        r = c.post("/api/sessions", json={"system_prompt": "x" * 30_000})  # body in many reads
        assert r.status_code == 201, r.text


# ---- hosts, origins, headers ---------------------------------------------------------------


def test_an_unknown_host_name_is_refused_so_dns_rebinding_fails(gateway_factory):
    gw = gateway_factory(wait_for_engine=False)
    r = httpx.get(gw.base_url + "/api/config", headers={"Host": f"evil.example:{_port(gw)}"}, timeout=10)
    assert r.status_code == 400
    for host in ("127.0.0.1", "localhost"):
        assert httpx.get(gw.base_url + "/healthz", headers={"Host": f"{host}:{_port(gw)}"},
                         timeout=10).status_code == 200


def test_a_rebinding_page_cannot_open_the_socket_even_with_matching_host_and_origin(gateway_factory):
    from gateway.api.auth import COOKIE_NAME, origin_allowed

    gw = gateway_factory(wait_for_engine=False)
    cookie = gw.new_cookie()
    evil = f"evil.example:{_port(gw)}"
    with socket.create_connection(("127.0.0.1", _port(gw)), timeout=30) as s:
        s.sendall((f"GET /ws HTTP/1.1\r\nHost: {evil}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                   f"Origin: http://{evil}\r\nCookie: {COOKIE_NAME}={cookie}\r\n\r\n").encode())
        status = _read_all(s).split(b"\r\n", 1)[0]
    assert status.split()[1] in (b"400", b"403"), status
    # the Origin check itself no longer trusts Host alone
    scope = {"headers": [(b"host", evil.encode()), (b"origin", f"http://{evil}".encode())]}
    assert not origin_allowed(scope, (), ["localhost", "127.0.0.1"])
    assert origin_allowed({"headers": [(b"host", b"127.0.0.1:1"), (b"origin", b"http://127.0.0.1:1")]},
                          (), ["localhost", "127.0.0.1"])


def test_allowed_hosts_setting_admits_a_configured_name(gateway_factory):
    gw = gateway_factory(wait_for_engine=False, allowed_hosts=("chat.example.com",))
    ok = httpx.get(gw.base_url + "/healthz", headers={"Host": "chat.example.com"}, timeout=10)
    assert ok.status_code == 200
    assert httpx.get(gw.base_url + "/healthz", timeout=10).status_code == 400  # only the listed names


def test_the_page_has_its_csp_as_a_header_with_connect_src_self(gateway_factory):
    gw = gateway_factory(wait_for_engine=False)
    r = httpx.get(gw.base_url + "/", timeout=10)
    csp = r.headers["content-security-policy"]
    directives = {d.split()[0]: d.split()[1:] for d in csp.split("; ")}
    assert directives["connect-src"] == ["'self'"] and directives["script-src"] == ["'self'"]
    assert "frame-ancestors" in directives


def test_probes_set_no_cookie_and_a_401_says_how_to_authenticate(gateway_factory):
    gw = gateway_factory(wait_for_engine=False, api_key="sekrit")
    for path in ("/healthz", "/readyz"):
        assert "set-cookie" not in httpx.get(gw.base_url + path, timeout=10).headers
    r = httpx.get(gw.base_url + "/v1/models", timeout=10)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")


def test_engine_addresses_are_shown_only_with_the_api_key(gateway_factory):
    gw = gateway_factory(api_key="sekrit")
    anon = httpx.get(gw.base_url + "/api/engine/stats", timeout=30).json()["engines"]
    assert anon and all("url" not in e for e in anon) and anon[0]["name"] == "engine-1"
    assert gw.config.engine_urls[0] not in httpx.get(gw.base_url + "/api/engine/stats", timeout=30).text
    op = httpx.get(gw.base_url + "/api/engine/stats", headers={"Authorization": "Bearer sekrit"},
                   timeout=30).json()["engines"]
    assert op[0]["url"] == gw.config.engine_urls[0]


# ---- sockets per user and per address ------------------------------------------------------


async def test_sockets_per_user_are_capped_and_a_closed_one_frees_its_place(gateway_factory):
    from tests.gateway_helpers import recv, send, wait_for

    gw = gateway_factory(wait_for_engine=False, limits={"ws_max_sockets_per_user": 2})
    cookie, other = gw.new_cookie(), gw.new_cookie()
    async with gw.connect(cookie) as a, gw.connect(cookie) as b:
        async with gw.connect(cookie) as c:
            err = await recv(c)
            assert (err["type"], err["code"]) == ("error", "rate_limited") and "user" in err["message"]
        async with gw.connect(other) as d:  # another user is not affected
            await send(d, {"type": "ping"})
            assert await recv(d) == {"type": "pong"}
        for ws in (a, b):
            await send(ws, {"type": "ping"})
            assert await recv(ws) == {"type": "pong"}
    async with gw.connect(cookie) as again:
        await send(again, {"type": "ping"})
        assert await recv(again) == {"type": "pong"}
    await wait_for(lambda: gw.state.ws_stats.by_user == {})  # the server saw every close


async def test_sockets_per_address_are_capped(gateway_factory):
    from tests.gateway_helpers import recv

    gw = gateway_factory(wait_for_engine=False, limits={"ws_max_sockets_per_address": 2})
    cookies = [gw.new_cookie() for _ in range(3)]
    async with gw.connect(cookies[0]), gw.connect(cookies[1]):
        async with gw.connect(cookies[2]) as c:
            err = await recv(c)
            assert err["code"] == "rate_limited" and "address" in err["message"]


# ---- the engine link's shared secret --------------------------------------------------------


async def test_the_engine_link_secret_is_required_when_set():
    import asyncio

    from websockets.asyncio.server import serve

    from engine.protocol import EngineInfo, HelloFrame, encode
    from engine.server import secret_check
    from gateway.engines.client import EngineClient
    from tests.gateway_helpers import wait_for

    async def hello(ws):
        await ws.send(encode(HelloFrame(EngineInfo(model="m", max_model_len=8, block_size=16, num_blocks=4))))
        await ws.wait_closed()

    async with serve(hello, "127.0.0.1", 0, process_request=secret_check("s3cret")) as server:
        url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        without, wrong, right = EngineClient(url), EngineClient(url, secret="nope"), EngineClient(url, secret="s3cret")
        for c in (without, wrong, right):
            await c.start()
        await wait_for(lambda: right.healthy, 10)
        await asyncio.sleep(0.5)  # the refused ones have had their tries
        assert not without.healthy and not wrong.healthy
        for c in (without, wrong, right):
            await c.close()


# ---- clients that go away ---------------------------------------------------------------------


class _Records(logging.Handler):
    """Every record at WARNING or above of the loggers it is attached to."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of ``/metrics`` (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_hangs_up_mid_body_or_mid_stream_is_counted_not_an_error(gateway_factory):
    """A hang-up during a request body (any route that reads one) or while an answer
    streams: no 500, nothing at WARNING or above in the gateway's or uvicorn's log, and a
    count by route and stage in /metrics."""
    gw = gateway_factory()
    seen = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "gateway", "uvicorn.access")]
    for lg in loggers:
        lg.addHandler(seen)
    try:
        for path in ("/api/sessions", "/v1/chat/completions", "/api/defaults"):
            method = "PUT" if path == "/api/defaults" else "POST"
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", _port(gw)), timeout=30) as s:
                    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                              f"Content-Length: 1000\r\n\r\n{{\"messages\": [".encode())
                    time.sleep(0.05)  # the handler is reading the body when the client leaves
        body = {"messages": [{"role": "user", "content": "Tell a long story."}], "stream": True,
                "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        for _ in range(3):
            with httpx.Client(base_url=gw.base_url, timeout=60) as c, \
                    c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # the first chunk came; then the client goes away mid-stream
        text = ""
        deadline = time.monotonic() + 60  # a bound for a broken gateway, not a timing assert
        while time.monotonic() < deadline:
            text = httpx.get(gw.base_url + "/metrics", timeout=30).text
            counts = [_metric(text, "gateway_client_disconnects_total", route=p, stage="body")
                      for p in ("/api/sessions", "/v1/chat/completions", "/api/defaults")]
            if counts == [5, 5, 5] and _metric(text, "gateway_client_disconnects_total",
                                               route="/v1/chat/completions", stage="response") >= 3:
                break
            time.sleep(0.2)
        assert counts == [5, 5, 5], text
        assert _metric(text, "gateway_client_disconnects_total", route="/v1/chat/completions", stage="response") >= 3
        assert "status=\"500\"" not in text
    finally:
        for lg in loggers:
            lg.removeHandler(seen)
    assert [r.getMessage() for r in seen.records] == []


# ---- memory and descriptors per connection -------------------------------------------------


def _ws_handshake(port: int, cookie: str, origin: str, sndbuf: int | None = None) -> socket.socket:
    from bench.raw_ws import handshake
    from gateway.api.auth import COOKIE_NAME

    sock = handshake("127.0.0.1", port, f"{COOKIE_NAME}={cookie}", origin, rcvbuf=4096)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    return sock


def test_a_ping_flood_that_never_reads_is_not_read_either_and_is_aborted(gateway_factory):
    """A client that sends WebSocket pings and never reads their pongs: once the pongs
    fill the connection's write buffer the gateway stops reading it (so what the client can
    push in is bounded by the kernel's buffers, not by the gateway's memory), and aborts it
    when its writes stay paused."""
    from bench.raw_ws import client_frame

    gw = gateway_factory(wait_for_engine=False, limits={"ws_send_timeout_s": 1.0})
    stats = gw.state.connections
    sock = _ws_handshake(_port(gw), gw.new_cookie(), gw.origin, sndbuf=65536)
    chunk = client_frame(b"p" * 125, opcode=0x9) * 8000  # about 1 MiB of pings
    pushed, cap = 0, 64 << 20
    sock.settimeout(5)
    try:
        while pushed < cap:
            sock.sendall(chunk)
            pushed += len(chunk)
    except (TimeoutError, OSError):
        pass  # the gateway stopped reading (the send blocked), or aborted the connection
    finally:
        sock.close()
    assert pushed < 16 << 20, f"the gateway kept reading pings it could not answer: {pushed} bytes taken"
    deadline = time.monotonic() + 60  # a bound for a broken gateway, not a timing assert
    while stats.ws_stalled_aborted_total < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats.ws_stalled_aborted_total >= 1


def test_a_frame_over_the_limit_is_refused_from_its_header_without_its_payload(gateway_factory):
    """A frame whose header announces more than max_frame_bytes gets a frame_too_large
    error frame and close 1009 before any of its payload is sent."""
    gw = gateway_factory(wait_for_engine=False)
    limit = gw.config.limits.max_frame_bytes
    sock = _ws_handshake(_port(gw), gw.new_cookie(), gw.origin)
    try:
        n = 15 << 20
        sock.sendall(bytes([0x81, 0x80 | 127]) + n.to_bytes(8, "big") + b"\0\0\0\0" + b"{" * 100)
        answer = _read_all(sock)
    finally:
        sock.close()
    assert answer[0] == 0x81 and b'"frame_too_large"' in answer and str(limit).encode() in answer, answer[:200]
    close = answer[answer.index(b"\x88"):]  # the close frame: its code is 1009
    assert int.from_bytes(close[2:4], "big") == 1009 and len(close) > 4
    assert gw.state.connections.ws_frames_too_large_total == 1


def test_a_slow_body_gets_408_and_connections_are_capped_per_address_and_in_total(gateway_factory):
    gw = gateway_factory(wait_for_engine=False, limits={"http_body_timeout_s": 1.0,
                                                        "http_max_connections_per_address": 4})
    port = _port(gw)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /api/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
        assert _read_all(s).startswith(b"HTTP/1.1 408")
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            answer = _read_all(s)  # refused before it sent anything
        assert answer.startswith(b"HTTP/1.1 429") and b"retry-after" in answer.lower()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 30  # the server saw the closes
    while gw.state.connections.http_by_address and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(gw.base_url + "/healthz", timeout=10).status_code == 200

    total = gateway_factory(wait_for_engine=False, limits={"http_max_connections": 3,
                                                           "http_max_connections_per_address": None})
    held = [socket.create_connection(("127.0.0.1", _port(total)), timeout=30) for _ in range(3)]
    try:
        with socket.create_connection(("127.0.0.1", _port(total)), timeout=30) as s:
            assert _read_all(s).startswith(b"HTTP/1.1 503")
    finally:
        for s in held:
            s.close()
    stats = total.state.connections
    assert stats.refused_total.get("total") == 1 and gw.state.connections.refused_total["per_address"] == 1
