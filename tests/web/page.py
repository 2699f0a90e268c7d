"""What the browser tests share besides their fixtures (those are in tests/web/conftest.py):
the browser's set-up, viewports and reply settings, a watch on page errors and dialogs, and
the steps a user takes on the chat page (open a chat, send, wait for a reply, screenshot).

Chromium comes from ``apt-get install chromium``; Playwright's own browser download
does not work on these machines.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, WebSocketRoute

from tests.engine_gate import EngineGate, of_type, text_delta

CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", "--disable-sync"]
SHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}

# Short replies for flows that wait for the end; long ones (stopped by the test) for flows
# that act mid-stream, which pause the engine, so a reply cannot end while the page acts.
# ignore_eos keeps a random model from ending a reply before the test looks at it.
SHORT = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_tokens": 1900, "temperature": 0.0, "ignore_eos": True}
WAIT_MS = 60_000

# Model output that would run script if it were ever inserted as HTML.
HOSTILE = ('Look: <script>window.__pwned = "script"; alert("script")</script> and '
           '<img src=x onerror="window.__pwned = \'img\'; alert(\'img\')"> and '
           '<svg onload="window.__pwned = \'svg\'"></svg> <iframe src="javascript:alert(1)"></iframe> '
           '[click me](javascript:window.__pwned=\'link\') **still markdown**')


def stop_and_resume(page: Page, gate: EngineGate) -> None:
    """Press Stop while the engine is paused; resume it once the abort reached it."""
    page.click("#stop")
    gate.wait_sent(of_type("abort"))
    gate.resume()


class PageWatch:
    """What a page did that it must not: uncaught errors and dialogs (alert, confirm)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.dialogs: list[str] = []

    def attach(self, page: Page) -> Page:
        page.on("pageerror", lambda e: self.errors.append(str(e)))

        def on_dialog(d: Any) -> None:
            self.dialogs.append(d.message)
            d.dismiss()

        page.on("dialog", on_dialog)
        return page


def open_chat(page: Page, sid: str | None = None) -> None:
    """Load the app (on chat ``sid`` if given); wait until its socket is open and the
    chat's history is shown."""
    page.goto(f"/#/c/{sid}" if sid else "/")
    page.wait_for_selector(f"body[data-connection=open][data-chat='{sid or 'new'}']", timeout=WAIT_MS)


def reload_chat(page: Page, sid: str) -> None:
    """Reload the page (on chat ``sid``); wait until its socket is open and the chat's
    history is shown again."""
    page.reload()
    page.wait_for_selector(f"body[data-connection=open][data-chat='{sid}']", timeout=WAIT_MS)


def create_chat(page: Page, params: dict[str, Any], **fields: Any) -> str:
    """Create a chat through the HTTP API as the page's user; returns its id."""
    if not page.url.startswith("http"):
        page.goto("/")  # sets the user cookie
    r = page.request.post("/api/sessions", data={"params": params, **fields})
    assert r.status == 201, r.text()
    return r.json()["id"]


# static/js/format.js: a reply's decode rate is shown only over this many tokens after the
# first, written over this long (ms) after the first token (docs/ui.md, "Stats per reply")
MIN_RATE_TOKENS, MIN_RATE_MS = 8, 50


def rate_shown(message: dict[str, Any]) -> bool:
    """Whether the page shows a decode rate ("41 tok/s") under this stored reply: its
    ``completion_tokens`` (those its ``timings`` cover) and timings decide."""
    u, t = message["usage"], message["timings"]
    return (u["completion_tokens"] - 1 >= MIN_RATE_TOKENS and t["e2e_ms"] > 0
            and t["e2e_ms"] - t["ttft_ms"] >= MIN_RATE_MS)


def get_chat(page: Page, sid: str) -> dict[str, Any]:
    """GET /api/sessions/{sid} as the page's user."""
    r = page.request.get(f"/api/sessions/{sid}")
    assert r.ok, r.text()
    return r.json()


def send(page: Page, text: str) -> None:
    """Type a message and press Enter."""
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_finished(page: Page, count: int = 1) -> None:
    """Wait until ``count`` assistant messages are finished (they carry data-status)."""
    page.wait_for_function(
        "(n) => document.querySelectorAll('.msg.assistant[data-status]').length >= n "
        "&& !document.querySelector('.msg.assistant.streaming')", arg=count, timeout=WAIT_MS)


def wait_one_reply(page: Page, longer_than: int = -1) -> None:
    """Wait until the page shows exactly one reply, finished (it carries data-status), with
    more than ``longer_than`` characters (a continued reply is longer than the cut one)."""
    page.wait_for_function(
        "(n) => { const a = document.querySelectorAll('.msg.assistant');"
        " return a.length === 1 && a[0].dataset.status && !a[0].classList.contains('streaming')"
        " && a[0].querySelector('.msg-body').textContent.length > n; }",
        arg=longer_than, timeout=WAIT_MS)


def send_paused(page: Page, gate: EngineGate, text: str) -> int:
    """Send ``text`` with the engine paused at its reply's first text (``gate``); returns,
    once the page shows that text, its length. Resume ``gate`` (or Stop) to go on."""
    gate.pause_on(text_delta())
    send(page, text)
    return wait_streaming_text(page, 0)


def wait_streaming_text(page: Page, more_than: int = 0) -> int:
    """Wait until the streaming reply shows more than ``more_than`` characters; returns its length."""
    handle = page.wait_for_function(
        "(n) => { const b = document.querySelector('.msg.assistant.streaming .msg-body');"
        " const l = b ? b.textContent.length : 0; return l > n ? l : false; }", arg=more_than, timeout=WAIT_MS)
    return int(handle.json_value())


def rendered_text(page: Page, markdown: str) -> str:
    """The text the page's own renderer makes of ``markdown`` (what a message shows)."""
    return page.evaluate(
        """async (md) => {
            const m = await import('/static/js/markdown.js');
            const box = document.createElement('div');
            box.append(m.createMarkdownRenderer(window).toFragment(md));
            return box.textContent;
        }""", markdown)


def last_reply_text(page: Page) -> str:
    """The text the last assistant message shows."""
    return page.locator(".msg.assistant .msg-body").last.text_content() or ""


def shot(page: Page, name: str) -> None:
    """Save a screenshot as artifacts/screenshots/{name}.png."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def assert_nothing_ran(page: Page, watch: PageWatch) -> None:
    """No injected script ran, no dialog opened, no active element was inserted."""
    assert page.evaluate("() => window.__pwned === undefined"), page.evaluate("() => window.__pwned")
    assert watch.dialogs == []
    bad = page.evaluate(
        """() => [...document.querySelectorAll('#messages script, #messages img, #messages svg:not(.icon),'
                 + ' #messages iframe, #messages [onerror], #messages [onload], #messages [style],'
                 + ' #messages a[href^="javascript"]')].map((e) => e.outerHTML)""")
    assert bad == []


def miss_live_events(page: Page) -> None:
    """Drop the live ``event`` frames the gateway sends ``page``'s socket (every other
    frame passes), as a tab that has not heard of another tab's change yet: live events
    are hints that can come late."""
    def without_events(ws: WebSocketRoute) -> None:
        server = ws.connect_to_server()
        server.on_message(lambda m: None if json.loads(m).get("type") == "event" else ws.send(m))

    page.route_web_socket(re.compile(r".*/ws$"), without_events)
