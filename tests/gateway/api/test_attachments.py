"""Attachments (gateway/attachments.py, gateway/api/attachments_api.py): files read into
text by kind, refused with a clear message before anything reaches an engine, stored with
the user message, and rendered into the prompt in one form every turn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.api.auth import COOKIE_NAME, UserIds
from gateway.attachments import ATTACHMENT_LIMITS, AttachmentLimits, extract, parse_attachments, prompt_content
from gateway.errors import GatewayError
from tests.gateway_helpers import read_reply, send
from tests.pdf_maker import make_pdf


def test_each_text_kind_is_read_by_its_extension_and_others_are_refused():
    assert extract("notes.md", b"# Title\n\nbody", ATTACHMENT_LIMITS).kind == "markdown"
    assert extract("data.csv", b"a,b\r\n1,2\r\n", ATTACHMENT_LIMITS).text == "a,b\n1,2\n"
    assert extract("x.json", b'{"a": 1}', ATTACHMENT_LIMITS).kind == "json"
    assert extract("main.py", b"\xef\xbb\xbfprint('hi')", ATTACHMENT_LIMITS).text == "print('hi')"  # BOM dropped
    assert extract("Makefile", b"all:\n\ttrue\n", ATTACHMENT_LIMITS).kind == "code"
    assert extract("latin.txt", "café".encode("cp1252"), ATTACHMENT_LIMITS).text == "café"
    for name, data, words in [("photo.png", b"\x89PNG....", "cannot be attached"),
                              ("blob.txt", b"ab\x00cd", "binary"), ("empty.txt", b"  \n", "empty"),
                              ("broken.pdf", b"%PDF-1.4 not really", "not a readable PDF")]:
        with pytest.raises(GatewayError) as e:
            extract(name, data, ATTACHMENT_LIMITS)
        assert e.value.code == "invalid_request" and words in e.value.message, e.value.message
    with pytest.raises(GatewayError) as e:
        extract("big.txt", b"x" * 101, AttachmentLimits(max_upload_bytes=100))
    assert e.value.code == "frame_too_large"


def test_a_pdf_is_read_page_by_page_and_a_textless_pdf_is_refused():
    a = extract("report.pdf", make_pdf(["Page one (intro)\nsecond line", "Page two"]), ATTACHMENT_LIMITS)
    assert (a.kind, a.pages, a.text) == ("pdf", 2, "Page one (intro)\nsecond line\n\nPage two")
    with pytest.raises(GatewayError, match="no text"):
        extract("scan.pdf", make_pdf([""]), ATTACHMENT_LIMITS)


def test_the_prompt_form_is_fixed_and_names_are_cleaned():
    files = [{"name": "a.txt", "text": "alpha"}, {"name": "b.md", "text": "beta"}]
    assert prompt_content("Compare.", files) == (
        '<file name="a.txt">\nalpha\n</file>\n\n<file name="b.md">\nbeta\n</file>\n\nCompare.')
    assert prompt_content("", files[:1]) == '<file name="a.txt">\nalpha\n</file>'
    assert prompt_content("plain", None) == "plain"
    (att,) = parse_attachments([{"name": '../x/"evil"<b>.txt', "kind": "text", "text": "t"}], ATTACHMENT_LIMITS)
    assert att.name == "evilb.txt"
    for bad in ([{"name": "a", "kind": "exe", "text": "t"}], [{"name": "a", "kind": "text", "text": " "}],
                "nope", [{"name": "a", "kind": "text", "text": "t"}] * 9):
        with pytest.raises(GatewayError):
            parse_attachments(bad, ATTACHMENT_LIMITS)


def client(gw: Any, cookie: str) -> httpx.Client:
    return httpx.Client(base_url=gw.base_url, cookies={COOKIE_NAME: cookie}, timeout=60)


async def test_upload_answers_text_and_tokens_and_refuses_what_cannot_be_sent(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    with client(gw, cookie) as c:
        r = c.post("/api/attachments", params={"name": "notes.md"}, content=b"# Plan\n\nShip it.")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["name"] == "notes.md" and body["kind"] == "markdown" and body["text"] == "# Plan\n\nShip it."
        assert body["tokens_exact"] is True and 5 < body["tokens"] < 40
        r = c.post("/api/attachments", params={"name": "song.mp3"}, content=b"ID3....")
        assert r.status_code == 400 and "cannot be attached" in r.json()["error"]["message"]
        max_len = c.get("/api/config").json()["max_model_len"]
        r = c.post("/api/attachments", params={"name": "long.txt"}, content=b"word " * (2 * max_len))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "context holds" in r.json()["error"]["message"]
        assert c.get("/api/config").json()["limits"]["max_upload_bytes"] == ATTACHMENT_LIMITS.max_upload_bytes


async def test_a_message_with_attachments_is_stored_shown_and_prompted_with_their_text(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    with client(gw, cookie) as c:
        att = c.post("/api/attachments", params={"name": "facts.txt"}, content=b"The sky is green.").json()
    files = [{k: att[k] for k in ("name", "kind", "text", "size")}]
    async with gw.connect(cookie) as ws:
        await send(ws, {"type": "chat", "content": "", "attachments": files,
                        "params": {"max_tokens": 2, "temperature": 0}})
        one = await read_reply(ws)
        assert one.done is not None, one.error
        sid = one.start["session_id"]
        # a bad file is refused before the store or the engine sees it
        await send(ws, {"type": "chat", "session_id": sid, "content": "x",
                        "attachments": [{"name": "a.exe", "kind": "binary", "text": "MZ"}]})
        err = json.loads(await ws.recv())
        assert err["type"] == "error" and err["code"] == "invalid_request" and "a.exe" in err["message"]
    with client(gw, cookie) as c:
        s = c.get(f"/api/sessions/{sid}").json()
    assert s["title"] == "facts.txt"
    assert [m["role"] for m in s["messages"]] == ["user", "assistant"]
    assert s["messages"][0]["attachments"] == files and s["messages"][0]["content"] == ""
    uid = UserIds(gw.config.secret_key).verify(cookie)
    history = gw.run(gw.state.store.history(uid, sid, ""))
    assert history.messages[0]["content"] == '<file name="facts.txt">\nThe sky is green.\n</file>'
    # the prompt holds the file: more tokens than an empty message would take
    assert one.done["usage"]["prompt_tokens"] >= att["tokens"]


@pytest.mark.slow
async def test_a_20_page_pdf_in_the_first_turn_is_served_from_the_prefix_cache_in_the_second(
        gateway_factory, smollm2_engine_url):
    gw = gateway_factory(engine_urls=[smollm2_engine_url])
    cookie = gw.new_cookie()
    pages = [f"Page {i + 1} of the field report.\nSite {i + 1} measured {17 * (i + 1) % 97} litres of rain.\n"
             f"The crew at site {i + 1} logged wind from the {['north', 'east', 'south', 'west'][i % 4]}."
             for i in range(20)]
    with client(gw, cookie) as c:
        att = c.post("/api/attachments", params={"name": "field-report.pdf"}, content=make_pdf(pages)).json()
    assert att["pages"] == 20 and "Site 20 measured" in att["text"] and att["tokens_exact"]
    files = [{k: att[k] for k in ("name", "kind", "text", "size", "pages")}]
    async with gw.connect(cookie) as ws:
        await send(ws, {"type": "chat", "content": "Which site measured the most rain?", "attachments": files,
                        "params": {"max_tokens": 8, "temperature": 0}})
        one = await read_reply(ws, timeout=600)
        assert one.done is not None, one.error
        sid = one.start["session_id"]
        await send(ws, {"type": "chat", "session_id": sid, "content": "And the least?",
                        "params": {"max_tokens": 8, "temperature": 0}})
        two = await read_reply(ws, timeout=600)
        assert two.done is not None, two.error
    u1, u2 = one.done["usage"], two.done["usage"]
    assert u1["prompt_tokens"] > att["tokens"]
    # the second turn reads the whole first turn, the PDF's text included, from the prefix cache
    assert u2["cached_tokens"] >= att["tokens"]
    assert u2["cached_tokens"] >= u1["prompt_tokens"] + u1["completion_tokens"] - 16


def test_the_terminal_client_attaches_files_and_says_why_one_is_refused(gateway_factory, tmp_path):
    gw = gateway_factory()
    notes, photo, cookies = tmp_path / "notes.md", tmp_path / "photo.png", tmp_path / "cookie"
    notes.write_text("# Notes\n\nThe launch is on Friday.")
    photo.write_bytes(b"\x89PNG....")
    root = Path(__file__).resolve().parents[3]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gateway.client", "--url", gw.base_url, "--cookie-file",
                               str(cookies), "--max-tokens", "2", "--temperature", "0", *args],
                              cwd=root, capture_output=True, text=True, timeout=120)

    refused = run("--attach", str(photo), "What is this?")
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.startswith("error: photo.png: this type of file cannot be attached; attach text")
    assert refused.stderr.count("photo.png") == 1  # named once
    done = run("--attach", str(notes), "When is the launch?")
    assert done.returncode == 0, done.stderr
    with client(gw, cookies.read_text().strip()) as c:
        (chat,) = c.get("/api/sessions").json()["sessions"]  # the refused question left no chat
        first = c.get(f"/api/sessions/{chat['id']}").json()["messages"][0]
    assert first["content"] == "When is the launch?"
    assert [(a["name"], a["kind"]) for a in first["attachments"]] == [("notes.md", "markdown")]


def test_the_terminal_clients_attach_refusal_names_the_file_once():
    from gateway.client import attach_refusal

    reason = "pic.png: this type of file cannot be attached; attach text, Markdown, code, CSV, JSON or PDF files"
    assert attach_refusal("pic.png", reason) == reason
    assert attach_refusal("a.md", "a.md is empty") == "a.md is empty"
    assert attach_refusal("a.md", "HTTP 502") == "a.md cannot be attached: HTTP 502"  # a reason without the name
