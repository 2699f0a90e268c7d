"""The chat UI's identity, settings, export/search and small-fault flows in a real
Chromium (the fixtures of tests/web/conftest.py, helpers of tests/web/page.py): access tokens created
in the page continue its chats from the terminal client and the OpenAI API, the extra
sampling settings and per-user defaults, export links and sidebar search, and the small
faults of a first session (repeated advice, a blank pane, unexplained Enter, a notice
that outlives the outage, wrapped dialog buttons, an unexplained conflict).
Screenshots go to artifacts/screenshots/ux-*.png."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, WebSocketRoute

from tests.engine_gate import EngineGate, text_delta
from tests.web.page import (
    DESKTOP,
    LONG,
    PHONE,
    SHORT,
    WAIT_MS,
    PageWatch,
    create_chat,
    get_chat,
    miss_live_events,
    open_chat,
    send,
    shot,
    stop_and_resume,
    wait_finished,
    wait_streaming_text,
)

pytestmark = [pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]


def make_token(page: Page, name: str) -> str:
    """Create a token in the Access tokens dialog; returns the value shown once."""
    page.click("#open-tokens")
    page.wait_for_selector("#tokens-dialog[open]")
    page.fill("#token-name", name)
    page.click("#tokens-dialog .create-token")
    page.wait_for_selector("#token-new:not([hidden])")
    page.wait_for_selector(f"#token-list .token-item >> text={name}")
    return page.input_value("#token-value")


def test_a_token_from_the_page_continues_its_chat_in_the_client_and_the_api(
        new_page: Callable[..., Page], gateway: Any) -> None:
    page = new_page()
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    send(page, "Hello from the browser")
    wait_finished(page)

    token = make_token(page, "laptop")
    assert token.startswith("cspat_")
    assert "--token " + token in (page.text_content("#token-usage") or "")
    shot(page, "ux-desktop-light-tokens")
    page.click("#tokens-dialog .close-tokens")
    page.click("#open-tokens")  # shown once: opening again shows the list, not the token
    assert page.is_hidden("#token-new") and page.input_value("#token-value") == ""
    page.click("#tokens-dialog .close-tokens")

    out = subprocess.run([sys.executable, "-m", "gateway.client", "--url", gateway.base_url, "--session", sid,
                          "--max-tokens", "4", "--temperature", "0", "Hello from the terminal"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CHAT_TOKEN": token})
    assert out.returncode == 0, out.stderr
    r = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {token}", "X-Chat-Session": "new"},
                   json={"messages": [{"role": "user", "content": "Started from the API"}], **SHORT})
    assert r.status_code == 200, r.text
    api_sid = r.headers["x-chat-session"]

    page.reload()
    page.wait_for_selector(f"body[data-connection=open][data-chat='{sid}']", timeout=WAIT_MS)
    users = page.locator(".msg.user .msg-body").all_text_contents()
    assert users == ["Hello from the browser", "Hello from the terminal"]
    page.wait_for_selector(f".chat-item[data-id='{api_sid}']")  # the API's chat is in the sidebar

    # revoked in the page: refused at once
    page.click("#open-tokens")
    page.click("#token-list button.revoke")
    page.wait_for_selector("#token-list .token-empty")
    r = httpx.get(f"{gateway.base_url}/api/sessions", headers={"X-Chat-Token": token})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")


def test_more_sampling_settings_save_and_become_the_defaults_for_new_chats(
        new_page: Callable[..., Page]) -> None:
    page = new_page(viewport=PHONE, scheme="dark")
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    page.click("#open-settings")
    page.wait_for_selector("#settings-dialog[open]")
    page.click("#set-more summary")
    page.fill("#set-top-k", "5")
    page.fill("#set-min-p", "0.1")
    page.fill("#set-repetition-penalty", "1.15")
    page.fill("#set-seed", "42")
    page.fill("#set-stop", "THE END\nEND")
    page.check("#set-as-default")
    # at 390 px Reset, Cancel and Save share one row
    tops = [page.locator(f"#settings-dialog .dialog-actions .{c}").bounding_box()["y"]
            for c in ("reset-defaults", "cancel", "save")]
    assert max(tops) - min(tops) < 2, tops
    page.locator("#settings-dialog .dialog-form").evaluate("(f) => { f.scrollTop = f.scrollHeight; }")
    shot(page, "ux-phone-dark-settings")
    page.click("#settings-dialog .save")
    page.wait_for_function("() => !document.querySelector('#settings-dialog').open")
    want = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.15, "seed": 42, "stop": ["THE END", "END"]}
    params = get_chat(page, sid)["params"]
    assert {k: params[k] for k in want} == want
    defaults = page.request.get("/api/defaults").json()
    assert {k: defaults["params"][k] for k in want} == want

    # a new chat starts with them, and a reply runs with them
    page.goto("/")
    page.wait_for_selector("body[data-connection=open][data-chat='new']", timeout=WAIT_MS)
    page.click("#open-settings")
    assert page.input_value("#set-top-k") == "5" and page.input_value("#set-stop") == "THE END\nEND"
    assert page.evaluate("() => document.querySelector('#set-more').open")
    page.fill("#set-seed", "")  # unset: not sent
    page.click("#settings-dialog .save")
    send(page, "Hi")
    page.wait_for_function("() => location.hash.startsWith('#/c/')", timeout=WAIT_MS)
    wait_finished(page)
    new_sid = page.evaluate("() => location.hash.slice(4)")
    params = get_chat(page, new_sid)["params"]
    assert params["top_k"] == 5 and params["stop"] == ["THE END", "END"] and "seed" not in params

    # an out-of-range value is refused in the dialog, with the section opened to show it
    page.click("#open-settings")
    page.fill("#set-min-p", "3")
    page.evaluate("() => { document.querySelector('#set-more').open = false; }")
    page.click("#settings-dialog .save")
    assert page.evaluate("() => document.querySelector('#set-more').open")
    assert page.is_visible("#settings-dialog[open]")


def test_export_links_download_the_chat_and_search_finds_it_by_content(new_page: Callable[..., Page]) -> None:
    page = new_page()
    sid = create_chat(page, SHORT, title="Lighthouse notes")
    other = create_chat(page, SHORT, title="Shopping")
    open_chat(page, sid)
    send(page, "Tell me about the Fresnel lens")
    wait_finished(page)

    page.click("#open-settings")
    assert page.is_visible("#export-row")
    md_href = page.get_attribute("#export-md", "href")
    json_href = page.get_attribute("#export-json", "href")
    with page.expect_download() as dl:
        page.click("#export-md")
    assert dl.value.suggested_filename == "Lighthouse-notes.md"
    md = Path(dl.value.path()).read_text()
    assert md.startswith("# Lighthouse notes") and "## You\n\nTell me about the Fresnel lens" in md
    body = page.request.get(json_href or "").json()
    assert body["id"] == sid and [m["role"] for m in body["messages"]] == ["user", "assistant"]
    assert md_href and "format=md" in md_href
    page.click("#settings-dialog .cancel")

    page.fill("#chat-search", "fresnel")
    page.wait_for_selector(f"#search-results .search-hit[data-id='{sid}']")
    assert page.is_hidden("#chat-list")
    assert "Fresnel lens" in (page.text_content("#search-results .hit-snippet") or "")
    assert page.locator(f"#search-results .search-hit[data-id='{other}']").count() == 0
    shot(page, "ux-desktop-light-search")
    page.fill("#chat-search", "shopping")  # a title matches too
    page.wait_for_selector(f"#search-results .search-hit[data-id='{other}']")
    page.fill("#chat-search", "zebra crossing")
    page.wait_for_selector("#search-results >> text=No chats contain")
    page.press("#chat-search", "Escape")
    page.wait_for_selector("#chat-list:not([hidden])")
    assert page.is_hidden("#search-results")


def test_enter_while_streaming_or_offline_says_why_and_keeps_the_text(
        new_page: Callable[..., Page], engine_gate: EngineGate) -> None:
    page = new_page()
    sid = create_chat(page, LONG)
    open_chat(page, sid)
    engine_gate.pause_on(text_delta())
    send(page, "Write a very long story.")
    wait_streaming_text(page, 0)
    send(page, "And another thing")
    page.wait_for_selector("#notice:not([hidden]) >> text=still being written")
    assert page.input_value("#input") == "And another thing"
    stop_and_resume(page, engine_gate)
    page.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)

    page.context.set_offline(True)
    # the page drops its socket on the browser's "offline" event; its keep-alive alone would
    # notice only after a ping and a pong timeout (30 s), so a 10 s wait fails without it
    page.wait_for_selector("body[data-connection=closed], body[data-connection=connecting]", timeout=10_000)
    send(page, "Offline message")
    page.wait_for_selector("#notice:not([hidden]) >> text=Not connected to the server")
    assert page.input_value("#input") == "Offline message"
    shot(page, "ux-desktop-light-offline-enter")
    page.context.set_offline(False)  # the browser's "online" event reconnects at once
    page.wait_for_selector("body[data-connection=open]", timeout=WAIT_MS)
    page.wait_for_selector("#notice", state="hidden")  # the offline notice goes once connected


def test_a_background_list_refresh_that_cannot_reach_the_server_leaves_the_notice_alone(
        new_page: Callable[..., Page]) -> None:
    # Another tab's change reaches the page as a live event, and the list is re-read a
    # moment later. Had the browser gone offline in between, that failure used to replace
    # the notice saying why Enter sent nothing; the connection badge already says it.
    page = new_page()
    socket: dict[str, WebSocketRoute] = {}

    def through(ws: WebSocketRoute) -> None:
        socket["ws"] = ws
        ws.connect_to_server()

    page.route_web_socket(re.compile(r".*/ws$"), through)
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    page.wait_for_selector("body[data-connection=open]")
    page.route(re.compile(r".*/api/sessions$"), lambda route: route.abort("internetdisconnected"))
    with page.expect_event("requestfailed", lambda r: r.url.endswith("/api/sessions")):
        socket["ws"].send(json.dumps({"type": "event", "kind": "updated", "session_id": "elsewhere"}))
    # the failure's handler runs right after the failed fetch; a page round trip lets it finish
    page.evaluate("() => new Promise((done) => setTimeout(done, 50))")
    assert page.is_hidden("#notice"), page.text_content("#notice-text")


def test_a_refused_first_message_brings_back_the_empty_state_with_the_advice_once(
        new_page: Callable[..., Page]) -> None:
    page = new_page(viewport=PHONE)
    open_chat(page)
    huge = "lorem ipsum dolor sit amet " * 800  # ~4,000 tokens > the tiny model's 2,048
    send(page, huge)
    page.wait_for_selector("#notice:not([hidden]) >> text=too long", timeout=WAIT_MS)
    text = page.text_content("#notice-text") or ""
    assert text.lower().count("start a new chat") == 1, text
    page.wait_for_selector("#empty-state:not([hidden])")
    assert page.locator(".msg").count() == 0 and page.input_value("#input") == huge
    shot(page, "ux-phone-light-refused-first")


def test_engine_notice_clears_after_recovery(browser: Browser, gateway_factory: Callable[..., Any],
                                             watch: PageWatch) -> None:
    no_engine = gateway_factory(engine_urls=[])
    context = browser.new_context(base_url=no_engine.base_url, viewport=DESKTOP)
    try:
        page = watch.attach(context.new_page())
        ready = {"ok": False}
        # the engine's return is seen through /readyz (the gateway's own check is tested elsewhere)
        page.route("**/readyz", lambda route: route.fulfill(
            status=200 if ready["ok"] else 503, content_type="application/json",
            body=json.dumps({"status": "ready" if ready["ok"] else "unavailable"})))
        open_chat(page)
        send(page, "Is anyone there?")
        page.wait_for_selector("#notice:not([hidden]) >> text=model server is not reachable", timeout=WAIT_MS)
        page.wait_for_timeout(3500)  # one poll answered "still down": the notice stays
        assert page.is_visible("#notice")
        ready["ok"] = True
        page.wait_for_selector("#notice", state="hidden", timeout=WAIT_MS)
        assert page.text_content("#announcer") == "The model server is back."
    finally:
        context.close()
    assert watch.errors == []


def test_a_stale_tab_regenerating_gets_a_friendly_conflict_text(
        browser: Browser, gateway: Any, watch: PageWatch) -> None:
    context = browser.new_context(base_url=gateway.base_url, viewport=DESKTOP)
    try:
        a, b = watch.attach(context.new_page()), watch.attach(context.new_page())

        miss_live_events(b)  # the live events would refresh b (two tabs acting at once)
        sid = create_chat(a, SHORT)
        open_chat(a, sid)
        send(a, "Hello")
        wait_finished(a)
        open_chat(b, sid)
        a.locator(".msg.assistant .regenerate").click()
        a.wait_for_function("(n) => !document.querySelector('.msg.assistant.streaming')", arg=0, timeout=WAIT_MS)
        wait_finished(a)
        b.locator(".msg.assistant .regenerate").click()  # b still shows the replaced reply
        b.wait_for_selector("#notice:not([hidden]) >> text=changed in another tab", timeout=WAIT_MS)
        assert "conflict" not in (b.text_content("#notice-text") or "").lower()
    finally:
        context.close()
    assert watch.errors == []


def test_a_reply_cut_for_a_reason_shows_the_reason_not_partial(new_page: Callable[..., Page],
                                                               gateway: Any) -> None:
    page = new_page(scheme="dark")
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    send(page, "Hello")
    wait_finished(page)
    # a reply stored as cut by the gateway's restart (the shape a cut reason is stored in)
    page.route(f"**/api/sessions/{sid}", lambda route: route.fulfill(
        status=200, content_type="application/json", body=json.dumps(cut_body(get_chat(page, sid)))))
    page.reload()
    page.wait_for_selector(".msg.assistant .badge:not([hidden])", timeout=WAIT_MS)
    assert page.text_content(".msg.assistant .badge") == "interrupted"
    assert "server restarted" in (page.text_content(".msg.assistant .stats") or "")
    shot(page, "ux-desktop-dark-interrupted")


def cut_body(chat: dict[str, Any]) -> dict[str, Any]:
    """``chat`` with its last reply stored as cut by a gateway restart, as the gateway
    stores it (``cut_reason``, docs/protocol.md)."""
    last = chat["messages"][-1]
    last.update(status="partial", finish_reason="abort", cut_reason="gateway_shutdown")
    return chat


def test_tokens_search_and_settings_fit_a_390px_phone_in_dark_mode(new_page: Callable[..., Page]) -> None:
    page = new_page(viewport=PHONE, scheme="dark")
    sid = create_chat(page, SHORT, title="Sourdough starter")
    open_chat(page, sid)
    page.click("#sidebar-toggle")
    page.fill("#chat-search", "sourdough")
    page.wait_for_selector(f"#search-results .search-hit[data-id='{sid}']")
    shot(page, "ux-phone-dark-search")
    page.click(f"#search-results .search-hit[data-id='{sid}'] a")  # a result opens the chat, the drawer closes
    page.wait_for_function("() => !document.body.classList.contains('sidebar-open')")

    page.click("#sidebar-toggle")
    make_token(page, "phone")
    box = page.locator("#tokens-dialog").bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
    assert page.evaluate("() => document.documentElement.scrollWidth") <= PHONE["width"]
    shot(page, "ux-phone-dark-tokens")
    page.click("#tokens-dialog .close-tokens")

    page.keyboard.press("Escape")
    page.click("#open-settings")
    page.wait_for_selector("#settings-dialog[open]")
    page.click("#set-more summary")
    tops = [page.locator(f"#settings-dialog .dialog-actions .{c}").bounding_box()["y"]
            for c in ("reset-defaults", "cancel", "save")]
    assert max(tops) - min(tops) < 2, tops
