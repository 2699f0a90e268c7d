"""Attachments in a real Chromium (the fixtures of tests/web/conftest.py, helpers of tests/web/page.py):
files by the button, by drag-and-drop and by paste (a long paste becomes a chip), their
tokens counted by the context meter before sending, refusals said in words, and the
files shown with the message after a reload, and uploads that never answer. Screenshots go to artifacts/screenshots/."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from playwright.sync_api import Page

from tests.pdf_maker import make_pdf
from tests.web.page import PHONE, SHORT, WAIT_MS, create_chat, get_chat, open_chat, shot, wait_finished
from tests.web.test_accessibility import axe_violations

pytestmark = [pytest.mark.timeout(180)]

UPLOAD_TIMEOUT_MS = 120_000  # static/js/attachments.js

PDF = make_pdf(["Quarterly report (page one)\nRevenue grew.", "Page two\nCosts fell."])

# Drop or paste files the way the browser's own events carry them.
DISPATCH_JS = """([kind, name, text]) => {
    const dt = new DataTransfer();
    if (name) dt.items.add(new File([text], name, {type: 'text/plain'}));
    else dt.setData('text/plain', text);
    if (kind === 'paste') {
        const ev = new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true});
        document.querySelector('#input').dispatchEvent(ev);
    } else {
        const main = document.querySelector('#main');
        main.dispatchEvent(new DragEvent('dragenter', {dataTransfer: dt, bubbles: true, cancelable: true}));
        main.dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));
    }
}"""


def chips(page: Page) -> list[str]:
    return [t.strip() for t in page.locator("#attachment-chips .chip-name").all_text_contents()]


def wait_chips(page: Page, n: int) -> None:
    page.wait_for_function("(n) => document.querySelectorAll('#attachment-chips .attachment-chip:not(.reading)')"
                           ".length === n", arg=n, timeout=WAIT_MS)


def test_files_by_button_drop_and_paste_are_counted_sent_and_kept(new_page: Callable[..., Page]) -> None:
    page = new_page()
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    page.set_input_files("#file-input", [
        {"name": "report.pdf", "mimeType": "application/pdf", "buffer": PDF},
        {"name": "notes.md", "mimeType": "text/markdown", "buffer": b"# Notes\n\nShip on Friday."}])
    wait_chips(page, 2)
    assert chips(page) == ["report.pdf", "notes.md"]
    detail = page.locator("#attachment-chips .attachment-chip").first.locator(".chip-detail").text_content() or ""
    assert detail.startswith("PDF · 2 pages · ") and detail.endswith(" tokens")
    # the meter counts the files before anything is sent
    assert "with the attached files" in (page.text_content("#context-meter") or "")
    page.evaluate(DISPATCH_JS, ["drop", "data.csv", "a,b\n1,2\n"])
    wait_chips(page, 3)
    page.evaluate(DISPATCH_JS, ["paste", "", "long pasted line\n" * 300])
    wait_chips(page, 4)
    assert chips(page)[2:] == ["data.csv", "pasted-text-1.txt"]
    assert page.input_value("#input") == ""  # the long paste did not flood the box
    page.evaluate(DISPATCH_JS, ["paste", "", "a short paste"])
    assert page.input_value("#input") == ""  # (a synthetic paste inserts nothing itself)
    assert len(chips(page)) == 4
    page.click("#attachment-chips .attachment-chip:nth-child(3) .chip-remove")  # data.csv goes
    assert chips(page) == ["report.pdf", "notes.md", "pasted-text-1.txt"]
    shot(page, "attachments-desktop-chips")
    assert axe_violations(page) == []
    page.fill("#input", "Summarise these.")
    page.press("#input", "Enter")
    wait_finished(page)
    assert page.is_hidden("#attachment-chips")
    sent = [t.strip() for t in page.locator(".msg.user .chip-name").all_text_contents()]
    assert sent == ["report.pdf", "notes.md", "pasted-text-1.txt"]
    stored = get_chat(page, sid)["messages"][0]
    assert [a["name"] for a in stored["attachments"]] == sent
    assert "Revenue grew." in stored["attachments"][0]["text"] and stored["content"] == "Summarise these."
    page.reload()
    page.wait_for_selector(f"body[data-connection=open][data-chat='{sid}']", timeout=WAIT_MS)
    assert [t.strip() for t in page.locator(".msg.user .chip-name").all_text_contents()] == sent
    # what the model read of each file can be looked at
    page.click(".msg.user .attachment-chip:first-child .chip-view")
    assert "Revenue grew." in (page.text_content(".msg.user .attachment-preview") or "")
    shot(page, "attachments-desktop-sent")
    assert axe_violations(page) == []
    page.click(".msg.user .attachment-chip:nth-child(2) .chip-view")
    assert (page.text_content(".msg.user .attachment-preview") or "") == "# Notes\n\nShip on Friday."
    page.click(".msg.user .attachment-chip:nth-child(2) .chip-view")
    assert page.is_hidden(".msg.user .attachment-preview")


def test_files_that_cannot_be_sent_are_refused_with_a_reason(new_page: Callable[..., Page]) -> None:
    page = new_page(viewport=PHONE)
    open_chat(page)
    page.set_input_files("#file-input", [{"name": "photo.png", "mimeType": "image/png", "buffer": b"\x89PNG...."}])
    page.wait_for_selector("#notice:not([hidden])", timeout=WAIT_MS)
    assert "photo.png: this type of file cannot be attached" in (page.text_content("#notice-text") or "")
    max_len = int(page.evaluate("() => JSON.parse(document.getElementById('chat-config').textContent).max_model_len"))
    page.set_input_files("#file-input", [{"name": "huge.txt", "mimeType": "text/plain",
                                          "buffer": b"word " * (2 * max_len)}])
    page.wait_for_function("() => /context holds/.test(document.querySelector('#notice-text').textContent)",
                           timeout=WAIT_MS)
    assert chips(page) == []
    page.set_input_files("#file-input", [{"name": "ok.txt", "mimeType": "text/plain", "buffer": b"fine"}])
    wait_chips(page, 1)
    assert page.is_enabled("#send")  # a file alone can be sent
    shot(page, "attachments-phone-chip")
    assert axe_violations(page) == []


def test_an_upload_that_never_answers_can_be_stopped_and_is_given_up_with_a_reason(
        new_page: Callable[..., Page]) -> None:
    """The "Reading…" chip that stayed forever: an upload whose answer never came (a
    stalled connection, a gateway that hung) had no time limit and nothing to stop it, and
    Send waited for it. Now its chip has a stop button, and the page gives up after
    UPLOAD_TIMEOUT_MS (the fake clock jumps there) with a reason; a ready chip removed
    meanwhile leaves the reading one drawn."""
    page = new_page()
    page.clock.install()  # timers run as usual until the clock is moved on
    open_chat(page)
    page.set_input_files("#file-input", [{"name": "ok.txt", "mimeType": "text/plain", "buffer": b"fine"}])
    wait_chips(page, 1)
    held: list[object] = []
    page.route("**/api/attachments*", lambda route: held.append(route))  # never answered
    page.set_input_files("#file-input", [{"name": "stalled.txt", "mimeType": "text/plain", "buffer": b"slow"}])
    reading = page.locator("#attachment-chips .attachment-chip.reading")
    reading.wait_for(timeout=WAIT_MS)
    assert (reading.locator(".chip-detail").text_content() or "") == "Reading…"
    page.fill("#input", "Read this")
    assert page.is_disabled("#send")  # Send waits for the file
    page.click("#attachment-chips .attachment-chip:not(.reading) .chip-remove")  # ok.txt goes...
    assert chips(page) == ["stalled.txt"] and reading.count() == 1  # ...the one still reading stays drawn
    shot(page, "attachments-desktop-reading")
    assert axe_violations(page) == []
    reading.get_by_role("button", name="Stop reading stalled.txt").click()
    page.wait_for_function("() => !document.querySelector('#attachment-chips .attachment-chip')", timeout=WAIT_MS)
    assert page.is_hidden("#attachment-chips") and page.is_enabled("#send")

    # the same file again, unanswered until the time limit
    page.set_input_files("#file-input", [{"name": "stalled.txt", "mimeType": "text/plain", "buffer": b"slow"}])
    reading.wait_for(timeout=WAIT_MS)
    page.clock.fast_forward(UPLOAD_TIMEOUT_MS + 1000)
    page.wait_for_function("() => /stalled.txt was not read within 120 s/.test("
                           "document.querySelector('#notice-text').textContent)", timeout=WAIT_MS)
    assert chips(page) == [] and page.is_enabled("#send")
    assert len(held) == 2

    # an answer that is not an attachment (a proxy's page) is refused in words, not drawn
    page.unroute("**/api/attachments*")
    page.route("**/api/attachments*", lambda route: route.fulfill(status=200, content_type="text/html",
                                                                   body="<html>Welcome to the proxy</html>"))
    page.set_input_files("#file-input", [{"name": "odd.txt", "mimeType": "text/plain", "buffer": b"odd"}])
    page.wait_for_function("() => /odd.txt could not be attached/.test("
                           "document.querySelector('#notice-text').textContent)", timeout=WAIT_MS)
    assert chips(page) == [] and page.is_enabled("#send")
