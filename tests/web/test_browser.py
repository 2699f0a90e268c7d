"""The chat UI in a real browser: Playwright driving Debian's Chromium against the
real gateway (real Redis, real engine on the tiny random model).

What a user does and sees: a streamed reply that grows on screen, history back after
a reload, Stop (partial badge), a reply that keeps streaming after a reload or a
dropped socket (resumed from the last seq, nothing lost or doubled), Regenerate,
rename and delete, the 390 px layout, clear messages when a chat is busy, the engine
is down or Redis is unreachable, and model output holding markup shown as text
(nothing runs). Screenshots go to artifacts/screenshots/ (ignored by git).

The gateway reaches the engine through an ``EngineGate`` (tests/engine_gate.py): flows
that act mid-reply pause the engine at its first text and resume it once the page did
what it tests, so the reply is still streaming when the page acts, however fast the
engine writes.

Chromium comes from ``apt-get install chromium``; Playwright's own browser download
does not work on these machines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import redis
from playwright.sync_api import Browser, Page, WebSocketRoute

from tests.engine_gate import EngineGate, text_delta
from tests.web.page import (
    DESKTOP,
    HOSTILE,
    LONG,
    PHONE,
    SHORT,
    WAIT_MS,
    PageWatch,
    assert_nothing_ran,
    create_chat,
    get_chat,
    last_reply_text,
    miss_live_events,
    open_chat,
    rate_shown,
    rendered_text,
    send,
    send_paused,
    shot,
    stop_and_resume,
    wait_finished,
    wait_streaming_text,
)

pytestmark = [pytest.mark.timeout(120)]


def test_reply_streams_in_and_history_returns_after_reload(new_page: Callable[..., Page],
                                                          engine_gate: EngineGate) -> None:
    page = new_page()
    open_chat(page)
    # settings of a chat not sent yet travel with its creation
    page.click("#open-settings")
    page.fill("#set-max-tokens", "96")  # long enough to be seen growing
    page.fill("#set-temperature", "0")
    page.click("#settings-dialog .save")
    page.wait_for_selector("#settings-dialog", state="hidden")
    # What the page showed at each change while the reply streamed: its length and
    # whether Stop was offered. Recorded by the page itself; the engine pauses twice
    # mid-reply, so the page shows it at two lengths at least however fast it writes.
    page.evaluate("""() => {
        window.__frames = [];
        const stop = document.getElementById('stop');
        new MutationObserver(() => {
            const b = document.querySelector('.msg.assistant.streaming .msg-body');
            const send = document.getElementById('send');
            if (b) window.__frames.push({length: b.textContent.length, stop: !stop.hidden, send: !send.hidden});
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")

    engine_gate.pause_on(text_delta())
    send(page, "Tell me about lighthouses")
    assert page.input_value("#input") == ""
    page.wait_for_selector(".msg.user >> text=Tell me about lighthouses")
    engine_gate.wait_paused()
    shown = wait_streaming_text(page, 0)
    engine_gate.resume(pause_on=text_delta())
    engine_gate.wait_paused()
    wait_streaming_text(page, shown)
    engine_gate.resume()
    wait_finished(page)

    final = last_reply_text(page)
    frames = page.evaluate("() => window.__frames")
    assert frames, "the page never showed a streaming reply"
    assert all(f["stop"] and not f["send"] for f in frames), f"Stop not offered while streaming: {frames}"
    seen = [f["length"] for f in frames if f["length"] > 0]
    assert len(set(seen)) >= 2 and min(seen) < len(final), f"the reply did not grow on screen: {seen}"
    assert page.is_hidden("#stop") and page.is_visible("#send")
    stats = page.locator(".msg.assistant .stats-line").text_content() or ""
    # the prefix cache may hold the chat template's opening from other chats
    assert re.fullmatch(r"\d+ tokens( · \d+(\.\d)? tok/s)?( · [\d,]+ from cache)?", stats), stats

    m = re.search(r"#/c/([A-Za-z0-9_-]+)$", page.url)
    assert m, page.url
    chat = get_chat(page, m.group(1))
    assert chat["params"]["max_tokens"] == 96 and chat["params"]["temperature"] == 0
    assert [x["role"] for x in chat["messages"]] == ["user", "assistant"]
    assert ("tok/s" in stats) == rate_shown(chat["messages"][1])  # a rate only where it means something
    assert rendered_text(page, chat["messages"][1]["content"]) == final
    shot(page, "desktop-light-reply")

    page.reload()
    page.wait_for_selector(".msg.assistant[data-status]")
    assert last_reply_text(page) == final
    assert page.locator(".msg.user .msg-body").text_content() == "Tell me about lighthouses"
    assert page.locator(".chat-link[aria-current=page]").text_content() == chat["title"]
    assert page.locator("#chat-heading").text_content() == chat["title"]

    light_bg = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    page.emulate_media(color_scheme="dark")
    dark_bg = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    assert light_bg == "rgb(255, 255, 255)"
    assert dark_bg != light_bg and sum(int(v) for v in re.findall(r"\d+", dark_bg)[:3]) < 3 * 80
    shot(page, "desktop-dark-reply")


def test_stop_keeps_the_partial_reply_with_a_badge(new_page: Callable[..., Page], engine_gate: EngineGate) -> None:
    page = new_page()
    sid = create_chat(page, LONG)
    open_chat(page, sid)
    send_paused(page, engine_gate, "Write a very long story about a canal.")
    assert page.is_visible("#stop") and page.is_hidden("#send")

    stop_and_resume(page, engine_gate)
    page.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)
    assert page.locator(".badge-partial").text_content() == "partial"
    assert page.is_hidden("#stop") and page.is_visible("#send")
    assert page.is_visible(".msg.assistant .regenerate")
    shown = last_reply_text(page)

    reply = get_chat(page, sid)["messages"][-1]
    assert reply["status"] == "partial"
    assert 0 < reply["usage"]["completion_tokens"] < LONG["max_tokens"]
    assert rendered_text(page, reply["content"]) == shown

    page.reload()
    page.wait_for_selector(".msg.assistant .badge-partial")
    assert last_reply_text(page) == shown
    shot(page, "desktop-light-stopped")


def test_reply_in_progress_continues_after_reload(new_page: Callable[..., Page], engine_gate: EngineGate) -> None:
    page = new_page()
    sid = create_chat(page, LONG)
    open_chat(page, sid)
    send_paused(page, engine_gate, "Count slowly to a thousand.")

    page.reload()
    page.wait_for_selector("body[data-connection=open]")
    first = wait_streaming_text(page, 0)  # re-attached: resumed from seq 0
    engine_gate.resume(pause_on=text_delta())
    engine_gate.wait_paused()
    wait_streaming_text(page, first)  # and it keeps growing
    assert page.is_visible("#stop")
    assert page.locator(".msg.user").count() == 1 and page.locator(".msg.assistant").count() == 1

    stop_and_resume(page, engine_gate)
    page.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)
    stored = get_chat(page, sid)["messages"][-1]["content"]
    assert rendered_text(page, stored) == last_reply_text(page)  # every delta exactly once


def test_dropped_socket_reconnects_and_resumes_from_last_seq(new_page: Callable[..., Page],
                                                            engine_gate: EngineGate) -> None:
    page = new_page()
    sockets: list[WebSocketRoute] = []
    servers: list[Any] = []
    sent: list[dict[str, Any]] = []

    def through(ws: WebSocketRoute) -> None:
        server = ws.connect_to_server()
        sockets.append(ws)
        servers.append(server)

        def page_to_server(message: str | bytes) -> None:
            sent.append(json.loads(message))
            server.send(message)

        ws.on_message(page_to_server)

    page.route_web_socket(re.compile(r".*/ws$"), through)
    sid = create_chat(page, LONG)
    open_chat(page, sid)
    page.evaluate("""() => {
        const banner = document.getElementById('conn-banner');
        window.__bannerSeen = false;
        const caret = () => getComputedStyle(
            document.querySelector('.msg.streaming .msg-body > :last-child'), '::after').animationName;
        new MutationObserver(() => {
            if (banner.hidden || window.__bannerSeen) return;
            window.__bannerSeen = true;
            window.__caretWhileDown = caret();  // the reply does not pulse while nothing can arrive
        }).observe(banner, {attributes: true});
        window.__caret = caret;
    }""")
    before = send_paused(page, engine_gate, "Tell me everything about rivers.")

    sockets[0].close(code=4000, reason="test drop")
    servers[0].close()
    page.wait_for_function("() => window.__bannerSeen", timeout=WAIT_MS)
    page.wait_for_function("() => document.body.dataset.connection === 'open'", timeout=WAIT_MS)
    assert len(sockets) >= 2
    page.wait_for_selector("#conn-banner", state="hidden")
    engine_gate.resume(pause_on=text_delta())
    engine_gate.wait_paused()
    wait_streaming_text(page, before)  # the same reply goes on after the reconnect
    assert page.evaluate("() => [window.__caretWhileDown, window.__caret()]") == ["none", "pulse"]

    resumes = [f for f in sent if f["type"] == "resume"]
    assert resumes and all(f["last_seq"] > 0 for f in resumes), sent  # from where it was, not from 0
    stop_and_resume(page, engine_gate)
    page.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)
    stored = get_chat(page, sid)["messages"][-1]["content"]
    assert rendered_text(page, stored) == last_reply_text(page)  # nothing lost, nothing doubled


def test_shift_enter_adds_a_line_and_regenerate_replaces_the_reply(new_page: Callable[..., Page]) -> None:
    page = new_page()
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    page.click("#input")
    page.keyboard.type("Name a colour.")
    page.keyboard.press("Shift+Enter")  # a newline, not a send
    page.keyboard.type("Just one.")
    assert page.input_value("#input") == "Name a colour.\nJust one."
    assert page.locator(".msg.user").count() == 0
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.user")
    assert page.locator(".msg.user .msg-body").text_content() == "Name a colour.\nJust one."
    wait_finished(page)
    old_id = page.locator(".msg.assistant").get_attribute("data-message-id")
    assert old_id

    page.click(".msg.assistant .regenerate")
    page.wait_for_function(
        "(old) => { const a = document.querySelectorAll('.msg.assistant');"
        " return a.length === 1 && a[0].dataset.status && a[0].dataset.messageId !== old; }",
        arg=old_id, timeout=WAIT_MS)
    new_id = page.locator(".msg.assistant").get_attribute("data-message-id")
    chat = get_chat(page, sid)
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
    assert chat["messages"][1]["id"] == new_id != old_id
    assert rendered_text(page, chat["messages"][1]["content"]) == last_reply_text(page)


def test_rename_and_delete_chats_from_the_sidebar(new_page: Callable[..., Page]) -> None:
    page = new_page()
    alpha = create_chat(page, SHORT, title="Alpha notes")
    beta = create_chat(page, SHORT, title="Beta plans")
    open_chat(page)
    page.wait_for_selector(".chat-link >> text=Beta plans")
    assert page.locator(".chat-link").all_text_contents() == ["Beta plans", "Alpha notes"]  # newest first

    page.click(f".chat-item[data-id='{alpha}'] .rename")
    page.fill(".rename-input", "Gamma ideas")
    page.press(".rename-input", "Enter")
    page.wait_for_selector(f".chat-item[data-id='{alpha}'] .chat-link >> text=Gamma ideas")
    page.wait_for_function(
        "async (id) => (await (await fetch('/api/sessions/' + id)).json()).title === 'Gamma ideas'", arg=alpha)

    page.click(f".chat-item[data-id='{beta}'] .chat-link")
    page.wait_for_function("(id) => location.hash === '#/c/' + id", arg=beta)
    page.click(f".chat-item[data-id='{beta}'] .delete")
    page.wait_for_selector("#confirm-dialog[open]")
    page.click("#confirm-dialog .btn.ghost")  # Cancel keeps it
    page.wait_for_selector("#confirm-dialog", state="hidden")
    assert page.locator(f".chat-item[data-id='{beta}']").count() == 1

    page.click(f".chat-item[data-id='{beta}'] .delete")
    page.click("#confirm-dialog .btn.danger")
    page.wait_for_selector(f".chat-item[data-id='{beta}']", state="detached")
    page.wait_for_function("() => location.hash === '#/'")
    assert page.request.get(f"/api/sessions/{beta}").status == 404
    assert page.locator(".chat-link").all_text_contents() == ["Gamma ideas"]


def test_layout_fits_a_390px_phone_with_a_sidebar_toggle(new_page: Callable[..., Page]) -> None:
    for scheme in ("light", "dark"):
        page = new_page(viewport=PHONE, scheme=scheme)
        sid = create_chat(page, SHORT, title="Phone chat")
        open_chat(page, sid)
        send(page, "A question typed on a phone, long enough to wrap onto a second line.")
        wait_finished(page)

        assert page.evaluate("() => document.documentElement.scrollWidth") <= PHONE["width"]
        assert page.evaluate("() => { const c = document.getElementById('conversation');"
                             " return c.scrollWidth <= c.clientWidth; }")
        box = page.locator("#composer").bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
        sidebar = page.locator("#sidebar").bounding_box()
        assert sidebar and sidebar["x"] + sidebar["width"] <= 0  # collapsed off screen
        assert page.is_visible("#sidebar-toggle")
        shot(page, f"phone-{scheme}-chat")

        page.click("#sidebar-toggle")
        page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().left >= 0")
        assert page.get_attribute("#sidebar-toggle", "aria-expanded") == "true"
        shot(page, f"phone-{scheme}-sidebar")
        page.click(f".chat-item[data-id='{sid}'] .chat-link")
        page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().right <= 0")
        assert page.is_hidden("#scrim")


def test_markup_in_a_streamed_reply_shows_as_text_and_runs_nothing(
        new_page: Callable[..., Page], watch: PageWatch) -> None:
    page = new_page()

    def inject(ws: WebSocketRoute) -> None:
        # The tiny model never writes markup, so the first delta of each reply is
        # replaced on its way to the page: the real stream path renders it.
        server = ws.connect_to_server()

        def server_to_page(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame.get("type") == "delta" and frame.get("seq") == 1:
                frame["text"] = HOSTILE + "\n\n"
            ws.send(json.dumps(frame))

        server.on_message(server_to_page)

    page.route_web_socket(re.compile(r".*/ws$"), inject)
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    send(page, "Say something.")
    wait_finished(page)

    body = page.locator(".msg.assistant .msg-body")
    text = body.text_content() or ""
    assert '<script>window.__pwned = "script"' in text and "<img src=x onerror=" in text
    assert body.locator("strong").text_content() == "still markdown"
    assert_nothing_ran(page, watch)
    shot(page, "desktop-light-hostile-stream")


def test_markup_in_a_stored_reply_shows_as_text_after_reload(
        new_page: Callable[..., Page], watch: PageWatch, redis_url: str, key_prefix: str) -> None:
    page = new_page()
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    send(page, "Say something.")
    wait_finished(page)

    # Store hostile text as the reply itself (the gateway's layout: one JSON per
    # message in chat:session:{sid}:messages).
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        key = f"{key_prefix}chat:session:{sid}:messages"
        stored = [json.loads(x) for x in r.lrange(key, 0, -1)]
        i = next(i for i, m in enumerate(stored) if m["role"] == "assistant")
        stored[i]["content"] = HOSTILE + "\n\nSee [the docs](https://example.org/docs)."
        r.lset(key, i, json.dumps(stored[i], separators=(",", ":"), ensure_ascii=False))
    finally:
        r.close()

    page.reload()
    page.wait_for_selector(".msg.assistant[data-status]")
    body = page.locator(".msg.assistant .msg-body")
    assert "<svg onload=" in (body.text_content() or "")
    link = body.locator("a[href='https://example.org/docs']")
    assert link.get_attribute("rel") == "noopener noreferrer nofollow" and link.get_attribute("target") == "_blank"
    assert body.locator("a").count() == 1  # the javascript: link stayed text
    assert_nothing_ran(page, watch)

    # the renderer itself, on raw HTML and dangerous URLs: what elements and attributes come out
    samples = ["<b onmouseover=alert(1)>x</b>", "[a](javascript:alert(1))", "![pic](https://example.org/x.png)",
               "<a href='javascript:alert(1)'>a</a>", "| a |\n|--:|\n| 1 |", "```html\n<script>alert(1)</script>\n```"]
    out = page.evaluate(
        """async (samples) => {
            const m = await import('/static/js/markdown.js');
            const r = m.createMarkdownRenderer(window);
            return samples.map((s) => {
                const d = document.createElement('div');
                d.append(r.toFragment(s));
                return {text: d.textContent, elements: [...d.querySelectorAll('*')].map(
                    (e) => [e.tagName.toLowerCase(),
                            ...[...e.attributes].map((a) => a.name + '=' + a.value)].join(' '))};
            });
        }""", samples)
    for sample, got in zip(samples, out):
        for element in got["elements"]:
            tag, *attrs = element.split(" ")
            assert tag not in ("script", "img", "iframe", "svg", "b", "style"), (sample, element)
            assert not any(a.startswith(("on", "style=", "href=javascript")) for a in attrs), (sample, element)
    assert out[0]["text"].strip() == "<b onmouseover=alert(1)>x</b>"  # raw HTML stays text
    assert out[1]["text"].strip() == "[a](javascript:alert(1))"
    assert "a href=https://example.org/x.png target=_blank rel=noopener noreferrer nofollow" in out[2]["elements"]
    assert out[2]["text"].strip() == "pic"
    assert any(e.startswith("td class=align-right") for e in out[4]["elements"])
    assert "<script>alert(1)</script>" in out[5]["text"] and any("copy-code" in e for e in out[5]["elements"])
    assert_nothing_ran(page, watch)


def test_second_tab_sending_to_a_busy_chat_gets_a_clear_message(
        browser: Browser, gateway: Any, watch: PageWatch, engine_gate: EngineGate) -> None:
    context = browser.new_context(base_url=gateway.base_url, viewport=DESKTOP)
    try:
        a, b = watch.attach(context.new_page()), watch.attach(context.new_page())

        miss_live_events(b)  # b learns of a's turn from the gateway's answer to its own message
        sid = create_chat(a, LONG)
        open_chat(a, sid)
        open_chat(b, sid)
        engine_gate.pause_on(text_delta())  # the chat stays busy while tab b tries
        send(a, "Write a long poem.")
        wait_streaming_text(a, 0)

        send(b, "Hello from the other tab")
        b.wait_for_selector("#notice:not([hidden])", timeout=WAIT_MS)
        assert "still writing a reply" in (b.text_content("#notice-text") or "")
        assert b.input_value("#input") == "Hello from the other tab"  # nothing typed is lost
        # The busy tab re-reads the chat and follows the other tab's running turn ...
        b.locator(".msg.user").first.wait_for(timeout=WAIT_MS)
        assert b.locator(".msg.user").count() == 1
        # ... and never shows its own refused message as sent.
        assert b.locator(".msg.user", has_text="Hello from the other tab").count() == 0
        shot(b, "desktop-light-busy")

        stop_and_resume(a, engine_gate)
        a.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)
        assert watch.errors == []
    finally:
        context.close()


def test_too_large_engine_down_and_redis_down_show_clear_messages(
        browser: Browser, gateway_factory: Callable[..., Any], watch: PageWatch) -> None:
    no_engine = gateway_factory(engine_urls=[], limits={"max_frame_bytes": 4096})
    context = browser.new_context(base_url=no_engine.base_url, viewport=DESKTOP)
    try:
        page = watch.attach(context.new_page())
        open_chat(page)
        send(page, "x" * 5000)  # over the page's documented frame limit: refused before sending
        page.wait_for_selector("#notice:not([hidden])")
        assert "too large to send (the limit is 4 KiB)" in (page.text_content("#notice-text") or "")
        assert page.input_value("#input") == "x" * 5000
        assert page.locator(".msg.user").count() == 0

        send(page, "Is anyone there?")
        page.wait_for_selector("#notice:not([hidden]) >> text=model server is not reachable", timeout=WAIT_MS)
        assert page.input_value("#input") == "Is anyone there?"
        assert page.locator(".msg.user").count() == 0
    finally:
        context.close()

    no_redis = gateway_factory(redis_url="redis://127.0.0.1:1/0")
    context = browser.new_context(base_url=no_redis.base_url, viewport=DESKTOP)
    try:
        page = watch.attach(context.new_page())
        page.goto("/")
        page.wait_for_selector("#notice:not([hidden])", timeout=WAIT_MS)
        assert "Redis" in (page.text_content("#notice-text") or "")
        shot(page, "desktop-light-redis-down")
    finally:
        context.close()
    assert watch.errors == []
