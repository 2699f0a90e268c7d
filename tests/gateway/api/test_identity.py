"""One identity across the browser, the terminal client and the OpenAI API: personal
access tokens (gateway/api/access_tokens.py) map to the browser cookie's user, so a chat started
anywhere is listed in that user's sidebar and continues anywhere. Also the terminal
client's URL forms, its --help, its refusal messages and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from websockets.asyncio.client import connect

from gateway.api.access_tokens import TOKEN_PREFIX, token_hash
from gateway.api.auth import COOKIE_NAME
from gateway.client import DEFAULT_URL, build_parser, gateway_url, http_base, refusal_text, socket_url
from tests.engine_gate import of_type, text_delta
from tests.fixtures_servers import RunningGateway

ROOT = Path(__file__).resolve().parents[3]
SHORT = {"max_tokens": 4, "temperature": 0.0}


def as_cookie(cookie: str) -> dict[str, str]:
    return {"Cookie": f"{COOKIE_NAME}={cookie}"}


def new_token(gw: RunningGateway, cookie: str, name: str = "laptop") -> dict[str, Any]:
    r = httpx.post(f"{gw.base_url}/api/tokens", json={"name": name}, headers=as_cookie(cookie), timeout=30)
    assert r.status_code == 201, r.text
    return r.json()


async def browser_chat(gw: RunningGateway, cookie: str, text: str, sid: str | None = None) -> str:
    """A turn over the browser's socket (cookie + Origin); returns the chat id."""
    async with gw.connect(cookie) as ws:
        frame: dict[str, Any] = {"type": "chat", "content": text, "params": SHORT}
        if sid:
            frame["session_id"] = sid
        await ws.send(json.dumps(frame))
        while True:
            f = json.loads(await ws.recv())
            assert f["type"] != "error", f
            if f["type"] == "done":
                return str(f["session_id"])


def run_client(gw: RunningGateway, *args: str, env: dict[str, str] | None = None,
               url: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.client", "--url", url or gw.base_url,
                           "--max-tokens", "4", "--temperature", "0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def listed(gw: RunningGateway, headers: dict[str, str]) -> list[str]:
    r = httpx.get(f"{gw.base_url}/api/sessions", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return [s["id"] for s in r.json()["sessions"]]


def messages(gw: RunningGateway, headers: dict[str, str], sid: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{gw.base_url}/api/sessions/{sid}", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return list(r.json()["messages"])


# ---- tokens -----------------------------------------------------------------------------


async def test_a_browser_chat_continues_from_the_client_and_the_api_with_a_token(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    sid = await browser_chat(gw, cookie, "Hello from the browser")
    tok = new_token(gw, cookie)
    token = tok["token"]
    assert token.startswith(TOKEN_PREFIX) and tok["hint"] == token[:10]

    # who am I: the same user either way
    me_cookie = httpx.get(f"{gw.base_url}/api/identity", headers=as_cookie(cookie)).json()
    me_token = httpx.get(f"{gw.base_url}/api/identity", headers={"X-Chat-Token": token}).json()
    assert me_cookie["user_id"] == me_token["user_id"] and me_cookie["auth"] == "cookie"
    assert me_token["auth"] == "token" and me_token["token"]["id"] == tok["id"]

    # the terminal client continues the browser's chat (token from the environment)
    done = run_client(gw, "--session", sid, "Hello from the terminal", env={"CHAT_TOKEN": token})
    assert done.returncode == 0, done.stderr
    assert f"[chat {sid}]" in done.stderr

    # without the token the client is another user: refused, with what to do about it
    other = run_client(gw, "--session", sid, "Hello without a token", env={"CHAT_TOKEN": ""})
    assert other.returncode == 1 and "no such chat" in other.stderr, other.stderr
    assert "--token" in other.stderr and "CHAT_TOKEN" in other.stderr

    # the OpenAI API continues it too, with the token as its bearer
    r = httpx.post(f"{gw.base_url}/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {token}", "X-Chat-Session": sid},
                   json={"messages": [{"role": "user", "content": "Hello from the API"}], **SHORT})
    assert r.status_code == 200, r.text
    users = [m["content"] for m in messages(gw, as_cookie(cookie), sid) if m["role"] == "user"]
    assert users == ["Hello from the browser", "Hello from the terminal", "Hello from the API"]

    # chats started by the client and by the API show in the browser's list
    fresh = run_client(gw, "--token", token, "A new chat from the terminal")
    assert fresh.returncode == 0, fresh.stderr
    client_sid = fresh.stderr.split("[chat ")[1].split("]")[0]
    r = httpx.post(f"{gw.base_url}/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {token}", "X-Chat-Session": "new"},
                   json={"messages": [{"role": "user", "content": "A new chat from the API"}], **SHORT})
    assert r.status_code == 200, r.text
    api_sid = r.headers["x-chat-session"]
    assert {sid, client_sid, api_sid} <= set(listed(gw, as_cookie(cookie)))
    # a token request sets no cookie of its own
    assert "set-cookie" not in httpx.get(f"{gw.base_url}/api/sessions", headers={"X-Chat-Token": token}).headers
    # Redis holds the hash only
    raw = gw.run(gw.state.redis.hgetall(f"{gw.config.key_prefix}chat:token:{token_hash(token)}"))
    assert raw["id"] == tok["id"] and token not in json.dumps(raw)


async def test_a_revoked_or_wrong_token_gets_401_everywhere(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    tok = new_token(gw, cookie)
    token = tok["token"]
    assert httpx.get(f"{gw.base_url}/api/sessions", headers={"X-Chat-Token": token}).status_code == 200
    listing = httpx.get(f"{gw.base_url}/api/tokens", headers=as_cookie(cookie)).json()["tokens"]
    assert [t["id"] for t in listing] == [tok["id"]] and "token" not in listing[0]

    r = httpx.delete(f"{gw.base_url}/api/tokens/{tok['id']}", headers=as_cookie(cookie))
    assert r.status_code == 204
    assert httpx.get(f"{gw.base_url}/api/tokens", headers=as_cookie(cookie)).json()["tokens"] == []
    wrong = TOKEN_PREFIX + "x" * 43
    for bad in (token, wrong, "not-a-token"):
        for headers in ({"X-Chat-Token": bad}, {"Authorization": f"Bearer {bad}"}):
            if not bad.startswith(TOKEN_PREFIX) and "Authorization" in headers:
                continue  # a non-token bearer belongs to the operator's API key, not to us
            for path in ("/api/sessions", "/api/identity"):
                r = httpx.get(f"{gw.base_url}{path}", headers=headers)
                assert r.status_code == 401, (bad, headers, path, r.text)
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert r.json()["error"]["code"] == "invalid_token"
            r = httpx.post(f"{gw.base_url}/v1/chat/completions", headers=headers,
                           json={"messages": [{"role": "user", "content": "hi"}], **SHORT})
            assert r.status_code == 401 and "www-authenticate" in r.headers
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # the socket refuses the handshake with the same 401
    with pytest.raises(websockets.InvalidStatus) as e:
        async with connect(gw.ws_url, additional_headers={"X-Chat-Token": token}):
            pass
    assert e.value.response.status_code == 401
    # the client says so
    out = run_client(gw, "--token", token, "hi")
    assert out.returncode == 1 and "access token was refused" in out.stderr
    # revoking someone else's token, or a missing one, is 404
    other = new_token(gw, gw.new_cookie())
    assert httpx.delete(f"{gw.base_url}/api/tokens/{other['id']}", headers=as_cookie(cookie)).status_code == 404
    assert httpx.get(f"{gw.base_url}/api/identity", headers={"X-Chat-Token": other["token"]}).status_code == 200


def test_with_an_api_key_the_key_admits_and_the_token_names_the_user(gateway_factory):
    key = "operator-key"
    gw = gateway_factory(api_key=key)
    cookie = gw.new_cookie()
    token = new_token(gw, cookie)["token"]
    body = {"messages": [{"role": "user", "content": "hi"}], **SHORT}
    # the token alone does not replace the operator's key
    r = httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 401
    r = httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {key}", "X-Chat-Token": token, "X-Chat-Session": "new"})
    assert r.status_code == 200, r.text
    assert r.headers["x-chat-session"] in listed(gw, as_cookie(cookie))


# ---- the terminal client ------------------------------------------------------------------


@pytest.mark.parametrize(("given", "expected"), [
    ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/ws"),
    ("http://127.0.0.1:8000/", "ws://127.0.0.1:8000/ws"),
    ("https://chat.example:8443", "wss://chat.example:8443/ws"),
    ("ws://127.0.0.1:8000", "ws://127.0.0.1:8000/ws"),
    ("ws://127.0.0.1:8000/ws", "ws://127.0.0.1:8000/ws"),
    ("wss://h/ws/", "wss://h/ws"),
    ("https://h/chat", "wss://h/chat/ws"),
    ("127.0.0.1:8000", "ws://127.0.0.1:8000/ws"),
])
def test_the_client_takes_http_and_ws_urls_with_or_without_ws(given, expected):
    assert socket_url(given) == expected
    assert http_base(expected).startswith("http")


def test_the_client_help_shows_its_defaults_but_never_the_token(monkeypatch):
    monkeypatch.setenv("CHAT_TOKEN", "cspat_secret")
    text = build_parser().format_help()
    monkeypatch.setenv("CHAT_URL", "http://chat.example.org")
    text = build_parser().format_help()
    assert "(default: $CHAT_URL, else http://127.0.0.1:8000)" in " ".join(text.split())
    assert "chat.example.org" not in text  # the help names the variable, never its value
    assert "$CHAT_TOKEN" in text and "cspat_secret" not in text and "(default: None)" not in text
    assert "130" in text


def test_the_client_finds_the_gateway_in_chat_url_unless_url_is_given(gateway_factory, tmp_path):
    assert gateway_url(None, {}) == gateway_url(None, {"CHAT_URL": "  "}) == DEFAULT_URL
    assert gateway_url(None, {"CHAT_URL": "https://h/chat"}) == "https://h/chat"
    assert gateway_url("http://a:1", {"CHAT_URL": "https://h/chat"}) == "http://a:1"  # --url wins
    gw = gateway_factory()

    def ask(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gateway.client", "--cookie-file", str(tmp_path / "cookie"),
                               "--max-tokens", "2", "--temperature", "0", *args, "Hello"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "CHAT_URL": gw.base_url})

    by_env = ask()
    assert by_env.returncode == 0, by_env.stderr
    by_flag = ask("--url", "ftp://nowhere")  # --url is used over CHAT_URL
    assert by_flag.returncode == 2 and "ftp://nowhere" in by_flag.stderr, by_flag.stderr


def test_refusals_say_whether_origin_cookie_path_or_token_was_wrong(gateway_factory, capfd):
    gw = gateway_factory(wait_for_engine=False, engine_urls=[])

    async def refused(url: str, **kw: Any) -> tuple[int, str]:
        with pytest.raises(websockets.InvalidStatus) as e:
            async with connect(url, **kw):
                pass
        resp = e.value.response
        return resp.status_code, refusal_text(resp.status_code, bytes(resp.body or b""), url)

    import asyncio

    cookie = gw.new_cookie()
    status, text = asyncio.run(refused(gw.ws_url, origin="http://evil.example", additional_headers=as_cookie(cookie)))
    assert status == 403 and text.startswith("the Origin was refused") and "evil.example" in text
    status, text = asyncio.run(refused(gw.ws_url, origin=gw.origin))
    assert status == 403 and text.startswith("the user cookie was missing")
    status, text = asyncio.run(refused(gw.base_url.replace("http", "ws") + "/socket", origin=gw.origin,
                                       additional_headers=as_cookie(cookie)))
    assert status == 404 and text.startswith("wrong path") and "/ws" in text
    # and the command says it too
    token = new_token(gw, cookie)["token"]
    out = run_client(gw, "--token", token, "hi", url=gw.base_url + "/nope/ws")
    assert out.returncode == 1 and "wrong path: no WebSocket at '/nope/ws'" in out.stderr, out.stderr
    out = run_client(gw, "hi", url=gw.base_url + "/nope")  # the cookie fetch says it first
    assert out.returncode == 1 and "wrong path?" in out.stderr, out.stderr
    # a refusal is an answer, not a server error (uvicorn logs on stderr)
    err = capfd.readouterr().err
    assert "ERROR" not in err and "without completing handshake" not in err, err


def test_ctrl_c_cancels_the_reply_and_exits_130(gateway_factory, engine_gate):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    token = new_token(gw, cookie)["token"]
    engine_gate.pause_on(text_delta())
    proc = subprocess.Popen([sys.executable, "-m", "gateway.client", "--url", gw.base_url, "--token", token,
                             "--max-tokens", "1900", "--temperature", "0", "Write a very long story."],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # "[chat <id>]" once the reply started
        assert line.startswith("[chat "), line
        sid = line.strip()[6:-1]
        engine_gate.wait_paused()
        proc.send_signal(signal.SIGINT)
        engine_gate.wait_sent(of_type("abort"))
        engine_gate.resume()
        assert proc.wait(timeout=60) == 130
        rest = proc.stderr.read()
        assert "[abort:" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    reply = messages(gw, as_cookie(cookie), sid)[-1]
    assert reply["role"] == "assistant" and reply["status"] == "partial"
    assert reply["usage"]["completion_tokens"] < 1900
