"""Nothing is lost by a click, in a real Chromium (real gateway, Redis and tiny engine):
Regenerate keeps the old reply as a version ("< 1/2 >" under the reply, switchable and
stored), and a reply stopped by the user can be continued like one cut at max tokens.
Screenshots go to artifacts/screenshots/ (ignored by git)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from playwright.sync_api import Page

from tests.engine_gate import EngineGate
from tests.web.page import (
    LONG,
    PHONE,
    SHORT,
    WAIT_MS,
    create_chat,
    get_chat,
    open_chat,
    reload_chat,
    send,
    send_paused,
    shot,
    stop_and_resume,
    wait_finished,
    wait_one_reply,
)

pytestmark = [pytest.mark.timeout(180)]


def reply_state(page: Page) -> tuple[str, str, str]:
    """The one reply's (message id, text, version label), once it is finished."""
    wait_one_reply(page)
    reply = page.locator(".msg.assistant")
    label = reply.locator(".version-label")
    return (reply.get_attribute("data-message-id") or "", reply.locator(".msg-body").text_content() or "",
            label.text_content() or "" if label.count() else "")


def regenerate_and_wait(page: Page, old_id: str) -> None:
    page.click(".msg.assistant .regenerate")
    page.wait_for_function(
        "(old) => { const a = document.querySelectorAll('.msg.assistant');"
        " return a.length === 1 && a[0].dataset.status && a[0].dataset.messageId !== old; }",
        arg=old_id, timeout=WAIT_MS)


def test_regenerate_keeps_the_old_reply_as_a_version_shown_with_arrows(new_page: Callable[..., Page]) -> None:
    page = new_page()
    sid = create_chat(page, {**SHORT, "temperature": 1.0})
    open_chat(page, sid)
    send(page, "Name a colour.")
    wait_finished(page)
    first_id, first_text, label = reply_state(page)
    assert label == "" and page.locator(".msg.assistant .versions").is_hidden()  # one version: no arrows

    regenerate_and_wait(page, first_id)
    second_id, second_text, label = reply_state(page)
    assert label == "2/2"
    assert page.locator(".msg.assistant .version-next").is_disabled()
    shot(page, "desktop-light-regenerated-versions")

    # the arrows bring the first reply back, as it was, and the choice is stored
    page.click(".msg.assistant .version-prev")
    page.wait_for_function("(id) => document.querySelector('.msg.assistant')?.dataset.messageId === id",
                           arg=first_id, timeout=WAIT_MS)
    _, shown, label = reply_state(page)
    assert (shown, label) == (first_text, "1/2")
    stored = get_chat(page, sid)["messages"]
    assert [m["id"] for m in stored][1] == first_id
    assert stored[1]["versions"] == {"index": 0, "count": 2}

    # a third reply from the first version's place: three versions, nothing dropped
    regenerate_and_wait(page, first_id)
    third_id, _, label = reply_state(page)
    assert label == "3/3"
    reload_chat(page, sid)
    assert reply_state(page)[2] == "3/3"
    for label, want in (("2/3", second_id), ("1/3", first_id)):
        page.click(".msg.assistant .version-prev")
        page.wait_for_function("(id) => document.querySelector('.msg.assistant')?.dataset.messageId === id",
                               arg=want, timeout=WAIT_MS)
        assert reply_state(page)[2] == label

    page.set_viewport_size(PHONE)
    page.emulate_media(color_scheme="dark")
    reload_chat(page, sid)
    assert reply_state(page)[2] == "1/3"
    arrow = page.locator(".msg.assistant .version-next").bounding_box()
    assert arrow is not None and arrow["x"] + arrow["width"] <= PHONE["width"] and arrow["height"] >= 24
    shot(page, "phone-dark-regenerated-versions")


def test_a_reply_stopped_by_the_user_can_be_continued(new_page: Callable[..., Page], engine_gate: EngineGate) -> None:
    page = new_page()
    sid = create_chat(page, LONG)
    open_chat(page, sid)
    send_paused(page, engine_gate, "Write a very long story about a canal.")
    stop_and_resume(page, engine_gate)
    page.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)
    reply = page.locator(".msg.assistant")
    button = reply.locator(".continue-reply")
    assert button.is_visible() and reply.get_attribute("data-finish-reason") == "abort"
    before = get_chat(page, sid)["messages"][1]
    assert before["status"] == "partial"
    shot(page, "desktop-light-stopped-continue")
    # a short continuation (the chat's max tokens lowered), so the test stays fast
    page.evaluate("([id, params]) => fetch('/api/sessions/' + id, {method: 'PATCH', headers: {'content-type': "
                  "'application/json'}, body: JSON.stringify({params})})", [sid, {**LONG, "max_tokens": 12}])
    cut_length = len(reply.locator(".msg-body").text_content() or "")
    button.click()
    wait_one_reply(page, cut_length)
    after = get_chat(page, sid)["messages"]
    assert len(after) == 2 and after[1]["id"] == before["id"]
    assert after[1]["content"].startswith(before["content"]) and len(after[1]["content"]) > len(before["content"])
    assert after[1]["status"] == "complete" and page.locator(".badge-partial").count() == 0
    # exact: the reply's token ids are the stopped ones and then the new ones
    assert after[1]["usage"]["prompt_tokens"] == (before["usage"]["prompt_tokens"]
                                                   + before["usage"]["completion_tokens"])
    assert after[1]["usage"]["cached_tokens"] > 0
    page.set_viewport_size(PHONE)
    reload_chat(page, sid)
    page.wait_for_selector(".msg.assistant[data-status]")
    shot(page, "phone-light-continued-after-stop")
