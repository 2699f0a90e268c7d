"""Accessibility of the chat page in a real Chromium (the fixtures of
tests/web/conftest.py, the helpers of tests/web/page.py): axe-core (vendored in tests/web/vendor/axe-core) finds no
serious or critical violation in the main states (desktop and phone, light and dark,
each dialog open, a reply streaming, a code block); the transcript is a quiet log while
a status region says when a reply starts and reads it when it ends, and an assertive one
says errors and reconnects; the keyboard shortcuts do what their list says; every
button has a name and every icon button a tooltip; the empty page offers starting
prompts; on a touch phone the return key writes a new line and the small buttons are
44 px targets. Screenshots go to artifacts/screenshots/a11y-*.png."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page

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
    open_chat,
    send,
    shot,
    stop_and_resume,
    wait_finished,
    wait_streaming_text,
)

pytestmark = [pytest.mark.timeout(240)]

AXE = Path(__file__).resolve().parent / "vendor" / "axe-core" / "axe.min.js"
BLOCKING = ("serious", "critical")

# A reply with the markdown a model writes, code in several highlight colours included, and a
# code line and a table row wider than any screen (regions that scroll sideways must be
# reachable by keyboard).
RICH_REPLY = """Here is a **plan** with `inline code`, a [link](https://example.org) and a table.

| step | what |
|---|--:|
| 1 | read |
| 2 | PLACEHOLDER_CELL |

```python
# a comment, a keyword, a string, a number
def greet(name: str = "world") -> int:
    print(f"hello {name}")  # call
    return 42 if name else None
PLACEHOLDER_LINE
```

> A quote, and a list:

1. first
2. second
""".replace("PLACEHOLDER_CELL", "wide_" * 60).replace("PLACEHOLDER_LINE", "x = " + " + ".join(["width"] * 60))


def axe_violations(page: Page) -> list[str]:
    """axe-core's serious and critical violations on the page now, as 'rule: targets'."""
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.evaluate(AXE.read_text())  # through the DevTools protocol: the page's CSP allows it
    # the settled page, not a frame of a fade: a timestamp fading in on hover measured
    # #818181 on white mid-transition (3.89:1) where it ends at the muted colour (5.3:1)
    page.evaluate("async () => { const ending = document.getAnimations().filter((a) =>"
                  " Number.isFinite(a.effect?.getComputedTiming().endTime ?? Infinity));"
                  " await Promise.race([Promise.all(ending.map((a) => a.finished.catch(() => null))),"
                  " new Promise((r) => setTimeout(r, 2000))]); }")
    result = page.evaluate("async () => (await axe.run(document, {resultTypes: ['violations']})).violations"
                           ".map((v) => ({id: v.id, impact: v.impact, help: v.help,"
                           " nodes: v.nodes.map((n) => n.target.join(' ') + ' ' + (n.failureSummary || '')"
                           ".replace(/\\s+/g, ' ').slice(0, 160))}))")
    return [f"{v['id']} ({v['impact']}): {v['help']}: {v['nodes'][:4]}" for v in result if v["impact"] in BLOCKING]


def with_rich_reply(page: Page, sid: str) -> None:
    """Serve chat ``sid`` with its last reply replaced by ``RICH_REPLY`` (as the gateway
    stores a reply), so the page shows markdown, a table and highlighted code."""
    def fulfil(route: Any) -> None:
        chat = get_chat(page, sid)
        chat["messages"][-1]["content"] = RICH_REPLY
        route.fulfill(status=200, content_type="application/json", body=json.dumps(chat))

    page.route(f"**/api/sessions/{sid}", fulfil)


@pytest.fixture
def touch_page(browser: Browser, gateway: Any, watch: PageWatch) -> Iterator[Callable[[str], Page]]:
    """``touch_page(scheme)``: a page on a 390x844 touch phone (coarse pointer, no hover)."""
    contexts: list[Any] = []

    def make(scheme: str = "light") -> Page:
        context = browser.new_context(base_url=gateway.base_url, viewport=PHONE, color_scheme=scheme,
                                      has_touch=True, is_mobile=True)
        contexts.append(context)
        return watch.attach(context.new_page())

    yield make
    for c in contexts:
        c.close()
    assert watch.errors == [], f"uncaught errors in the page: {watch.errors}"


def test_axe_finds_no_serious_or_critical_violation_in_the_main_states(
        new_page: Callable[..., Page], engine_gate: EngineGate) -> None:
    found: dict[str, list[str]] = {}
    states: list[str] = []

    def check(page: Page, state: str) -> None:
        states.append(state)
        bad = axe_violations(page)
        if bad:
            found[state] = bad
        shot(page, f"a11y-{state}")

    for scheme in ("light", "dark"):
        page = new_page(scheme=scheme)
        open_chat(page)
        check(page, f"desktop-{scheme}-welcome")
        sid = create_chat(page, SHORT, title="Accessible chat")
        open_chat(page, sid)
        send(page, "Show me some code.")
        wait_finished(page)
        with_rich_reply(page, sid)
        page.reload()
        page.wait_for_selector(".code-block .hljs-keyword", timeout=WAIT_MS)
        check(page, f"desktop-{scheme}-code")
        page.click("#open-settings")
        page.click("#set-more summary")
        check(page, f"desktop-{scheme}-settings")
        page.keyboard.press("Escape")
        page.click("#open-tokens")
        check(page, f"desktop-{scheme}-tokens")
        page.keyboard.press("Escape")
        page.keyboard.press("Control+/")
        page.wait_for_selector("#shortcuts-dialog[open]")
        check(page, f"desktop-{scheme}-shortcuts")
        page.keyboard.press("Escape")
        page.click(f".chat-item[data-id='{sid}'] .delete")
        check(page, f"desktop-{scheme}-confirm")
        page.keyboard.press("Escape")

    # a reply streaming, a notice, search results
    page = new_page()
    sid = create_chat(page, LONG, title="Streaming chat")
    open_chat(page, sid)
    engine_gate.pause_on(text_delta())
    send(page, "Write a very long story.")
    wait_streaming_text(page, 0)
    send(page, "And another thing")  # the notice: a reply is still being written
    page.wait_for_selector("#notice:not([hidden])")
    check(page, "desktop-light-streaming-notice")
    stop_and_resume(page, engine_gate)
    page.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)
    page.fill("#chat-search", "streaming")
    page.wait_for_selector("#search-results .search-hit")
    check(page, "desktop-light-search")

    for scheme in ("light", "dark"):
        page = new_page(viewport=PHONE, scheme=scheme)
        sid = create_chat(page, SHORT, title="Phone chat")
        open_chat(page, sid)
        send(page, "Hello from a phone")
        wait_finished(page)
        with_rich_reply(page, sid)
        page.reload()
        page.wait_for_selector(".code-block .hljs-keyword", timeout=WAIT_MS)
        check(page, f"phone-{scheme}-code")
        page.click("#sidebar-toggle")
        page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().left >= 0")
        check(page, f"phone-{scheme}-drawer")
        page.keyboard.press("Escape")
        page.click("#open-settings")
        check(page, f"phone-{scheme}-settings")

    assert len(states) >= 12
    assert found == {}, "\n".join(f"{s}: {v}" for s, vs in found.items() for v in vs)


def record_live_regions(page: Page) -> None:
    """Keep every text the status (#announcer) and alert (#alerts) regions are given,
    in ``window.__said`` as [region id, text]."""
    page.evaluate("""() => {
        window.__said = [];
        for (const id of ['announcer', 'alerts']) {
            const el = document.getElementById(id);
            new MutationObserver(() => { if (el.textContent) window.__said.push([id, el.textContent]); })
                .observe(el, {childList: true, characterData: true, subtree: true});
        }
    }""")


def said(page: Page, region: str) -> list[str]:
    return [t for r, t in page.evaluate("() => window.__said") if r == region]


def test_the_transcript_is_a_quiet_log_and_replies_are_announced_when_they_start_and_end(
        new_page: Callable[..., Page], engine_gate: EngineGate) -> None:
    page = new_page()
    sid = create_chat(page, LONG)
    open_chat(page, sid)
    log = page.locator("#conversation")
    assert log.get_attribute("role") == "log" and log.get_attribute("aria-live") == "off"
    assert page.get_attribute("#announcer", "aria-live") == "polite"
    assert page.get_attribute("#alerts", "aria-live") == "assertive"
    record_live_regions(page)

    engine_gate.pause_on(text_delta())
    send(page, "Write a very long story.")
    wait_streaming_text(page, 0)
    # nothing inside the transcript is a live region of its own: the stream is not read token by token
    assert page.evaluate("() => document.querySelectorAll('#conversation [aria-live]').length") == 0
    assert said(page, "announcer") == ["The assistant is replying."]
    send(page, "And another thing")  # an error: said at once, in the assertive region
    page.wait_for_function("() => window.__said.some(([r, t]) => r === 'alerts' && t.includes('still being written'))")
    stop_and_resume(page, engine_gate)
    page.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)
    shown = " ".join((page.text_content(".msg.assistant .msg-body") or "").split())
    end = said(page, "announcer")[-1]
    assert end.startswith("Reply stopped. ") and shown[:200] in end  # the reply itself is read out

    # a dropped connection and its return are said once each, assertively
    page.context.set_offline(True)
    page.wait_for_selector("#conn-banner:not([hidden])", timeout=WAIT_MS)
    page.wait_for_timeout(1500)  # the banner's countdown ticks: not read out each second
    page.context.set_offline(False)
    page.wait_for_selector("body[data-connection=open]", timeout=WAIT_MS)
    page.wait_for_selector("#conn-banner", state="hidden")
    alerts = said(page, "alerts")
    drops = [t for t in alerts if "lost" in t or "offline" in t]
    assert len(drops) == 1 and "Connected to the server again." in alerts, alerts
    assert page.get_attribute("#conn-banner", "role") is None


def test_keyboard_shortcuts_do_what_their_list_says(new_page: Callable[..., Page]) -> None:
    page = new_page()
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    sid = create_chat(page, SHORT, title="Shortcut chat")
    open_chat(page, sid)
    send(page, "Hello")
    wait_finished(page)

    page.keyboard.press("Control+/")  # also from inside the message box
    page.wait_for_selector("#shortcuts-dialog[open]")
    rows = page.locator("#shortcut-rows tr").all_text_contents()
    for keys, does in [("Alt+Shift+N", "New chat"), ("Alt+Shift+K", "Search chats"),
                       ("Alt+Shift+S", "chat list"), ("Alt+Shift+R", "Regenerate"),
                       ("Alt+Shift+C", "Copy the last reply"), ("Alt+Shift+M", "message box"), ("Esc", "Stop")]:
        assert any(r.startswith(keys) and does in r for r in rows), (keys, rows)
    page.keyboard.press("Escape")
    page.wait_for_selector("#shortcuts-dialog", state="hidden")
    page.locator(".msg.assistant .msg-body").click()  # focus out of any text field: ? opens the list
    page.keyboard.press("Shift+?")
    page.wait_for_selector("#shortcuts-dialog[open]")
    page.keyboard.press("Escape")
    page.fill("#input", "a question?")  # in the message box, ? is just a character
    assert page.is_hidden("#shortcuts-dialog")

    page.keyboard.press("Alt+Shift+C")
    page.wait_for_function("() => document.getElementById('announcer').textContent === 'Reply copied.'")
    assert page.evaluate("() => navigator.clipboard.readText()") == get_chat(page, sid)["messages"][-1]["content"]

    old = page.get_attribute(".msg.assistant", "data-message-id")
    page.keyboard.press("Alt+Shift+R")
    page.wait_for_function(
        "(old) => { const a = document.querySelectorAll('.msg.assistant');"
        " return a.length === 1 && a[0].dataset.status && a[0].dataset.messageId !== old; }", arg=old, timeout=WAIT_MS)

    page.keyboard.press("Alt+Shift+K")
    assert page.evaluate("() => document.activeElement.id") == "chat-search"
    page.keyboard.press("Alt+Shift+M")
    assert page.evaluate("() => document.activeElement.id") == "input"
    page.keyboard.press("Alt+Shift+S")
    page.wait_for_selector("#sidebar", state="hidden")
    assert page.get_attribute("#sidebar-toggle", "aria-expanded") == "false"
    shot(page, "a11y-desktop-light-sidebar-hidden")
    page.keyboard.press("Alt+Shift+S")
    page.wait_for_selector("#sidebar", state="visible")
    page.keyboard.press("Alt+Shift+N")
    page.wait_for_function("() => location.hash === '#/' && document.body.dataset.chat === 'new'")
    assert page.evaluate("() => document.activeElement.id") == "input"
    assert page.input_value("#input") == "a question?"  # what was typed stays


def test_every_button_has_a_name_and_icon_buttons_a_tooltip_and_the_empty_page_offers_prompts(
        new_page: Callable[..., Page]) -> None:
    page = new_page()
    open_chat(page)
    starters = page.locator("#empty-state .starter")
    assert starters.count() >= 3 and all(t.strip() for t in starters.all_text_contents())
    starters.first.click()
    prompt = page.input_value("#input")
    assert prompt and prompt == starters.first.get_attribute("data-prompt")
    assert page.evaluate("() => document.activeElement.id") == "input" and page.is_enabled("#send")

    sid = create_chat(page, SHORT, title="Labelled chat")
    open_chat(page, sid)
    send(page, "Hello")
    wait_finished(page)
    unnamed = page.evaluate("""() => [...document.querySelectorAll('button')].filter((b) => {
        const name = (b.getAttribute('aria-label') || b.textContent || '').trim();
        return !name;
    }).map((b) => b.outerHTML.slice(0, 120))""")
    assert unnamed == []
    untitled = page.evaluate("""() => [...document.querySelectorAll('button.icon-btn')]
        .filter((b) => !(b.getAttribute('title') || '').trim()).map((b) => b.id || b.className)""")
    assert untitled == []


def test_on_a_touch_phone_return_adds_a_line_and_small_buttons_are_44px_targets(
        touch_page: Callable[[str], Page]) -> None:
    for scheme in ("light", "dark"):
        page = touch_page(scheme)
        sid = create_chat(page, SHORT, title="Touch chat")
        open_chat(page, sid)
        page.locator("#input").tap()
        page.keyboard.type("First line")
        page.keyboard.press("Enter")
        page.keyboard.type("Second line")
        assert page.input_value("#input") == "First line\nSecond line"
        assert page.locator(".msg.user").count() == 0  # return did not send
        assert page.get_attribute("#input", "enterkeyhint") == "enter"
        page.locator("#send").tap()
        wait_finished(page)
        assert page.text_content(".msg.user .msg-body") == "First line\nSecond line"
        # an edit gives the message versions: arrows to tap
        page.locator(".msg.user .edit-user").tap()
        page.locator(".edit-input").fill("Another first line")
        page.locator(".edit-send").tap()
        page.wait_for_selector(".msg.user .version-prev", timeout=WAIT_MS)
        wait_finished(page)
        small = [".msg.user .copy-user", ".msg.user .edit-user", ".msg.user .version-prev",
                 ".msg.user .version-next", ".msg.assistant .copy-msg", ".msg.assistant .regenerate"]
        page.locator("#sidebar-toggle").tap()
        page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().left >= 0")
        small += [f".chat-item[data-id='{sid}'] .rename", f".chat-item[data-id='{sid}'] .delete"]
        for sel in small:
            box = page.locator(sel).first.bounding_box()
            assert box and box["width"] >= 44 and box["height"] >= 44, (sel, box)
        shot(page, f"a11y-phone-{scheme}-touch-drawer")
        page.locator("#sidebar-close").tap()
        page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().right <= 0")
        shot(page, f"a11y-phone-{scheme}-touch")
        assert page.evaluate("() => document.documentElement.scrollWidth") <= PHONE["width"]
    assert DESKTOP["width"] > PHONE["width"]
