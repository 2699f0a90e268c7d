"""Import, export and share in a real Chromium (the fixtures of tests/web/conftest.py,
helpers of tests/web/page.py): ChatGPT's export imported from the sidebar with its branches
and never twice, every chat exported from there, and a chat shared as a read-only page
that shows nothing else, runs no markup, and stops when revoked. Screenshots go to
artifacts/screenshots/."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from playwright.sync_api import Page

from tests.gateway.api.test_import_export import chatgpt_conversation
from tests.web.page import DESKTOP, HOSTILE, PHONE, WAIT_MS, PageWatch, open_chat, shot
from tests.web.test_accessibility import axe_violations

pytestmark = [pytest.mark.timeout(180)]


def import_files(page: Page, files: list[dict[str, Any]]) -> str:
    """Import through the sidebar's dialog; returns what it says."""
    if not page.is_visible("#transfer-dialog"):
        page.click("#open-transfer")
        page.wait_for_selector("#transfer-dialog[open]")
    page.evaluate("() => { document.querySelector('#import-result').textContent = ''; }")
    page.set_input_files("#import-files", files)
    page.wait_for_function("() => /^Imported/.test(document.querySelector('#import-result').textContent)",
                           timeout=WAIT_MS)
    text = page.text_content("#import-result") or ""
    return text


def test_a_chatgpt_export_is_imported_once_with_its_branches_and_exported_whole(
        new_page: Callable[..., Page]) -> None:
    page = new_page()
    open_chat(page)
    data = json.dumps([chatgpt_conversation()]).encode()
    said = import_files(page, [{"name": "conversations-000.json", "mimeType": "application/json", "buffer": data}])
    assert said == "Imported 1 chat."
    shot(page, "import-desktop-dialog")
    assert axe_violations(page) == []
    said = import_files(page, [{"name": "conversations-000.json", "mimeType": "application/json", "buffer": data}])
    assert said == "Imported 0 chats; 1 chat already here, not added again."
    page.click("#transfer-dialog .close-transfer")
    page.click("#chat-list .chat-link >> text=Jokes and poems")
    page.wait_for_function("() => document.querySelectorAll('.msg.user').length === 3", timeout=WAIT_MS)
    bodies = page.locator("#messages .msg .msg-body").all_text_contents()
    assert [b.strip() for b in bodies][:3] == ["Hi", "Hello!", "Tell me a poem"]
    assert "2/2" in (page.locator(".msg.user").nth(1).text_content() or "")  # the edit's other branch is there
    shot(page, "import-desktop-chat")
    # every chat, every version, from the sidebar's dialog
    page.click("#open-transfer")
    href = page.get_attribute("#export-all-json", "href")
    doc = page.request.get(href or "").json()
    ids = set()
    for chat in doc["chats"]:
        ids |= {m["id"] for m in chat["messages"]}
        for entries in chat.get("versions", {}).values():
            for e in entries:
                ids |= {m["id"] for m in e.get("messages", [])}
    assert ids == {"u1", "a1", "u2a", "a2a", "u2b", "a2b1", "a2b2", "u3", "a3"}
    page.set_viewport_size(PHONE)
    shot(page, "import-phone-dialog")
    assert axe_violations(page) == []


def hostile_export() -> bytes:
    chat = {"id": "hostile1", "title": "Markup <img src=x onerror=alert(1)>", "system_prompt": "PRIVATE PROMPT",
            "params": {}, "created_at": 1700000000.0, "updated_at": 1700000000.0,
            "messages": [{"id": "m1", "role": "user", "content": "Show me <script>window.__pwned='user'</script>",
                          "status": "complete", "created_at": 1700000000.0},
                         {"id": "m2", "role": "assistant", "content": HOSTILE, "status": "complete",
                          "created_at": 1700000001.0}]}
    return json.dumps({"format": "chatserve-export", "version": 1, "chats": [chat]}).encode()


def test_a_shared_chat_is_a_read_only_page_that_runs_nothing_and_ends_when_revoked(
        new_page: Callable[..., Page], browser: Any, gateway: Any) -> None:
    page = new_page()
    open_chat(page)
    said = import_files(page, [{"name": "export.json", "mimeType": "application/json", "buffer": hostile_export()}])
    assert said == "Imported 1 chat."
    page.click("#transfer-dialog .close-transfer")
    page.click("#chat-list .chat-link")
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant[data-status]').length === 1",
                           timeout=WAIT_MS)
    page.click("#open-share")
    page.wait_for_selector("#share-dialog[open]")
    page.select_option("#share-expiry", "604800")
    page.click("#share-dialog .create-share")
    page.wait_for_selector("#share-list .share-item")
    assert "expires" in (page.text_content("#share-list .share-item") or "")
    url = page.get_attribute("#share-list .share-url", "href") or ""
    assert url.startswith("/s/")
    shot(page, "share-desktop-dialog")
    assert axe_violations(page) == []
    for viewport, name in ((DESKTOP, "share-desktop-page"), (PHONE, "share-phone-page")):
        # someone else, with no cookie of the sharer
        ctx = browser.new_context(base_url=gateway.base_url, viewport=viewport)
        try:
            seen = PageWatch()
            viewer = seen.attach(ctx.new_page())
            viewer.goto(url)
            viewer.wait_for_selector("#messages .msg.assistant .msg-body strong", timeout=WAIT_MS)
            assert (viewer.text_content("#share-title") or "") == "Markup <img src=x onerror=alert(1)>"
            assert "<script>" in (viewer.text_content("#messages .msg.user .msg-body") or "")  # text, not markup
            assert viewer.text_content("#messages .msg.assistant .msg-body strong") == "still markdown"
            assert viewer.evaluate("() => window.__pwned === undefined")
            assert seen.dialogs == [] and seen.errors == []
            bad = viewer.evaluate("() => [...document.querySelectorAll('#messages script, #messages img, "
                                  "#messages iframe, #messages [onerror], #messages a[href^=\"javascript\"]')].length")
            assert bad == 0
            html = viewer.content()
            assert "PRIVATE PROMPT" not in html and "chat-list" not in html
            shot(viewer, name)
            assert axe_violations(viewer) == []
        finally:
            ctx.close()
    page.set_viewport_size(PHONE)
    shot(page, "share-phone-dialog")
    assert axe_violations(page) == []
    page.click("#share-list .revoke")
    page.wait_for_function("() => !document.querySelector('#share-list .share-item')", timeout=WAIT_MS)
    gone = page.context.new_page()
    r = gone.goto(url)
    assert r is not None and r.status == 404
    assert (gone.text_content("#share-title") or "") == "This link does not work"
    gone.close()
