"""Live tabs in a real browser: two tabs of one user, each on its own gateway replica
(same Redis, same cookie secret), and what one tab does shows in the other without a
reload: a new chat, a new message with its reply streaming, a rename, a regenerate, an
edit, a delete; the other tab's Regenerate then works on the reply it now shows.
Screenshots go to artifacts/screenshots/ (ignored by git)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from playwright.sync_api import Browser, Page

from tests.engine_gate import EngineGate, text_delta
from tests.web.page import (
    DESKTOP,
    LONG,
    SHORT,
    WAIT_MS,
    PageWatch,
    miss_live_events,
    send,
    shot,
    wait_finished,
)


def open_at(page: Page, base: str, sid: str | None = None) -> None:
    page.goto(f"{base}/#/c/{sid}" if sid else f"{base}/")
    page.wait_for_selector(f"body[data-connection=open][data-chat='{sid or 'new'}']", timeout=WAIT_MS)


def wait_listening(gw: Any, page: Page) -> None:
    """Wait until the page's gateway is subscribed to its user's events."""
    page.wait_for_function("() => document.body.dataset.connection === 'open'", timeout=WAIT_MS)
    deadline_ms = WAIT_MS
    while not gw.state.live.subscribed and deadline_ms > 0:
        page.wait_for_timeout(50)
        deadline_ms -= 50
    assert gw.state.live.subscribed


def test_what_one_tab_does_shows_in_the_other_tab_on_another_replica(
        browser: Browser, gateway: Any, gateway_factory: Callable[..., Any], engine_gate: EngineGate,  # noqa: F811
        watch: PageWatch) -> None:  # noqa: F811
    other = gateway_factory(engine_urls=[engine_gate.url], secret_key=gateway.config.secret_key)
    context = browser.new_context(viewport=DESKTOP)  # cookies are per host, not per port: one user
    try:
        a, b = watch.attach(context.new_page()), watch.attach(context.new_page())
        open_at(a, gateway.base_url)
        r = a.request.post(f"{gateway.base_url}/api/sessions", data={"params": SHORT})
        assert r.status == 201
        sid = r.json()["id"]
        open_at(a, gateway.base_url, sid)
        open_at(b, other.base_url)
        wait_listening(gateway, a)
        wait_listening(other, b)

        # a new message in tab A: the chat appears in B's list, B opens it, sees the reply
        send(a, "Hello from tab A")
        wait_finished(a, 1)
        b.locator(".chat-link", has_text="Hello from tab A").wait_for(timeout=WAIT_MS)
        b.locator(".chat-link", has_text="Hello from tab A").click()
        b.wait_for_selector(f"body[data-chat='{sid}']", timeout=WAIT_MS)
        wait_finished(b, 1)

        # a second message while B looks at the chat: B shows it and follows the reply live
        a.request.patch(f"{gateway.base_url}/api/sessions/{sid}", data={"params": LONG})
        engine_gate.pause_on(text_delta())
        send(a, "Second message")
        b.locator(".msg.user", has_text="Second message").wait_for(timeout=WAIT_MS)
        b.wait_for_selector(".msg.assistant.streaming", timeout=WAIT_MS)
        shot(b, "desktop-light-live-other-tab-streaming")
        a.click("#stop")
        engine_gate.resume()
        a.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)
        b.wait_for_selector(".msg.assistant:nth-of-type(4) .badge-partial", timeout=WAIT_MS)
        a.request.patch(f"{gateway.base_url}/api/sessions/{sid}", data={"params": SHORT})

        # a rename in A: B's list and header follow
        a.request.patch(f"{gateway.base_url}/api/sessions/{sid}", data={"title": "Renamed in A"})
        b.wait_for_function("() => document.getElementById('chat-heading').textContent === 'Renamed in A'",
                            timeout=WAIT_MS)
        b.locator(".chat-link", has_text="Renamed in A").wait_for(timeout=WAIT_MS)

        # a regenerate in A: B shows the new reply
        old = a.locator(".msg.assistant").last.get_attribute("data-message-id")
        a.locator(".msg.assistant").last.locator(".regenerate").click()
        a.wait_for_function(
            "(old) => { const a = [...document.querySelectorAll('.msg.assistant')].pop();"
            " return a && a.dataset.status && a.dataset.messageId !== old; }", arg=old, timeout=WAIT_MS)
        new = a.locator(".msg.assistant").last.get_attribute("data-message-id")
        b.wait_for_function(
            "(id) => { const a = [...document.querySelectorAll('.msg.assistant')].pop();"
            " return a && a.dataset.messageId === id && a.dataset.status; }", arg=new, timeout=WAIT_MS)

        # B's Regenerate works on what it now shows (it is not stale)
        b.locator(".msg.assistant").last.locator(".regenerate").click()
        b.wait_for_function(
            "(id) => { const a = [...document.querySelectorAll('.msg.assistant')].pop();"
            " return a && a.dataset.messageId !== id && a.dataset.status; }", arg=new, timeout=WAIT_MS)
        assert b.locator("#notice").is_hidden()
        by_b = b.locator(".msg.assistant").last.get_attribute("data-message-id")
        a.wait_for_function(
            "(id) => { const a = [...document.querySelectorAll('.msg.assistant')].pop();"
            " return a && a.dataset.messageId === id && a.dataset.status; }", arg=by_b, timeout=WAIT_MS)

        # an edit in A: B shows the new branch with its versions
        first = a.locator(".msg.user").first
        first.hover()
        first.locator(".edit-user").click()
        a.locator(".edit-input").fill("Edited in A")
        a.locator(".edit-input").press("Enter")
        wait_finished(a, 1)
        b.wait_for_function(
            "() => { const u = document.querySelectorAll('.msg.user');"
            " return u.length === 1 && u[0].querySelector('.msg-body').textContent === 'Edited in A'"
            " && u[0].querySelector('.version-label')?.textContent === '2/2'; }", timeout=WAIT_MS)
        wait_finished(b, 1)
        shot(b, "desktop-light-live-other-tab-edited")
        stored = b.request.get(f"{other.base_url}/api/sessions/{sid}").json()
        assert stored["messages"][0]["content"] == "Edited in A"

        # a delete in A: B leaves the chat and says why
        a.request.delete(f"{gateway.base_url}/api/sessions/{sid}")
        b.wait_for_selector("body[data-chat='new']", timeout=WAIT_MS)
        assert "deleted in another tab" in (b.text_content("#notice-text") or "")
        assert b.locator(".chat-link").count() == 0
        assert watch.errors == []
    finally:
        context.close()


def test_a_stale_tabs_regenerate_rereads_the_chat_and_then_works(
        browser: Browser, gateway: Any, watch: PageWatch) -> None:  # noqa: F811
    context = browser.new_context(base_url=gateway.base_url, viewport=DESKTOP)
    try:
        a, b = watch.attach(context.new_page()), watch.attach(context.new_page())

        miss_live_events(b)  # the race live events cannot close: two tabs at once
        open_at(a, gateway.base_url)
        sid = a.request.post("/api/sessions", data={"params": SHORT}).json()["id"]
        open_at(a, gateway.base_url, sid)
        send(a, "Name a colour.")
        wait_finished(a, 1)
        open_at(b, gateway.base_url, sid)
        wait_finished(b, 1)
        seen_by_b = b.locator(".msg.assistant").get_attribute("data-message-id")
        a.locator(".msg.assistant").locator(".regenerate").click()
        a.wait_for_function("(old) => { const m = document.querySelector('.msg.assistant');"
                            " return m && m.dataset.status && m.dataset.messageId !== old; }",
                            arg=seen_by_b, timeout=WAIT_MS)
        now = a.locator(".msg.assistant").get_attribute("data-message-id")

        b.locator(".msg.assistant").locator(".regenerate").click()  # b still shows the old reply
        b.wait_for_selector("#notice:not([hidden])", timeout=WAIT_MS)
        assert "another tab" in (b.text_content("#notice-text") or "")
        assert "reload" not in (b.text_content("#notice-text") or "")
        b.wait_for_function("(id) => document.querySelector('.msg.assistant')?.dataset.messageId === id",
                            arg=now, timeout=WAIT_MS)  # re-read: b shows a's reply
        b.locator(".msg.assistant").locator(".regenerate").click()  # and now it works
        b.wait_for_function("(id) => { const m = document.querySelector('.msg.assistant');"
                            " return m && m.dataset.status && m.dataset.messageId !== id; }",
                            arg=now, timeout=WAIT_MS)
        assert b.locator(".msg.assistant").count() == 1
    finally:
        context.close()
