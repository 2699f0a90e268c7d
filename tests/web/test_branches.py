"""Editing and continuing in a real browser (Chromium, real gateway, Redis and tiny
engine): edit a user message and resend, switch between the versions with "< 1/2 >",
continue a reply cut at max tokens, copy a user message, timestamps on hover.
Screenshots go to artifacts/screenshots/ (ignored by git)."""

from __future__ import annotations

import re
from collections.abc import Callable

from playwright.sync_api import Page

from tests.web.page import (
    DESKTOP,
    PHONE,
    SHORT,
    WAIT_MS,
    create_chat,
    get_chat,
    open_chat,
    rate_shown,
    reload_chat,
    send,
    shot,
    wait_finished,
    wait_one_reply,
)


def user_texts(page: Page) -> list[str]:
    return [t or "" for t in page.locator(".msg.user .msg-body").all_text_contents()]


def wait_chat(page: Page, users: list[str], replies: int) -> None:
    """Wait until the page shows exactly these user messages and ``replies`` finished replies."""
    page.wait_for_function(
        """([users, n]) => {
            const u = [...document.querySelectorAll('.msg.user .msg-body')].map((e) => e.textContent);
            const a = document.querySelectorAll('.msg.assistant[data-status]');
            return JSON.stringify(u) === JSON.stringify(users) && a.length === n
                && !document.querySelector('.msg.assistant.streaming')
                && document.querySelectorAll('.msg.assistant').length === n;
        }""", arg=[users, replies], timeout=WAIT_MS)


def test_edit_resends_and_the_old_branch_comes_back_with_the_version_arrows(new_page: Callable[..., Page]) -> None:  # noqa: F811
    page = new_page()
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    send(page, "First question")
    wait_finished(page, 1)
    send(page, "Second question")
    wait_finished(page, 2)
    old = get_chat(page, sid)["messages"]

    first = page.locator(".msg.user").first
    assert first.locator(".versions").is_hidden()  # one version: no arrows
    first.hover()
    first.locator(".edit-user").click()
    editor = first.locator(".edit-input")
    assert editor.input_value() == "First question"
    shot(page, "desktop-light-edit-open")
    editor.fill("Edited question")
    editor.press("Enter")
    wait_chat(page, ["Edited question"], 1)
    assert page.locator(".msg.user .version-label").text_content() == "2/2"
    shot(page, "desktop-light-edit-versions")
    chat = get_chat(page, sid)
    assert [m["content"] for m in chat["messages"]][0] == "Edited question"
    assert chat["messages"][0]["versions"] == {"index": 1, "count": 2}

    page.locator(".msg.user .version-prev").click()
    wait_chat(page, ["First question", "Second question"], 2)
    assert page.locator(".msg.user .version-label").first.text_content() == "1/2"
    shown = [t or "" for t in page.locator(".msg.assistant .msg-body").all_text_contents()]
    assert len(shown) == 2 and all(shown)
    assert [m["id"] for m in get_chat(page, sid)["messages"]] == [m["id"] for m in old]  # nothing lost

    reload_chat(page, sid)
    wait_chat(page, ["First question", "Second question"], 2)  # the choice is stored
    page.locator(".msg.user .version-next").first.click()
    wait_chat(page, ["Edited question"], 1)
    # Escape cancels an edit and keeps the message
    page.locator(".msg.user").first.hover()
    page.locator(".msg.user .edit-user").click()
    page.locator(".edit-input").fill("never sent")
    page.locator(".edit-input").press("Escape")
    assert page.locator(".edit-form").count() == 0
    assert user_texts(page) == ["Edited question"]


def test_continue_extends_a_reply_cut_at_max_tokens(new_page: Callable[..., Page]) -> None:  # noqa: F811
    page = new_page()
    sid = create_chat(page, SHORT)  # max_tokens 12, ignore_eos: every reply is cut
    open_chat(page, sid)
    send(page, "Tell me a long story.")
    wait_finished(page, 1)
    reply = page.locator(".msg.assistant")
    assert reply.get_attribute("data-finish-reason") == "length"
    before = get_chat(page, sid)["messages"][1]
    button = reply.locator(".continue-reply")
    assert button.is_visible()
    shot(page, "desktop-light-continue")
    # measured before the click: read after it, the continuation may already be whole
    cut_length = len(reply.locator(".msg-body").text_content() or "")
    button.click()
    wait_one_reply(page, cut_length)
    after = get_chat(page, sid)["messages"]
    assert len(after) == 2 and after[1]["id"] == before["id"]
    assert after[1]["content"].startswith(before["content"]) and len(after[1]["content"]) > len(before["content"])
    assert after[1]["usage"]["cached_tokens"] > 0  # the continuation read the chat from the prefix cache
    assert reply.get_attribute("data-message-id") == before["id"]
    # the stats line counts the whole reply and says how much the Continue wrote, which the
    # rate and times are of; the stored reply (and so a reload) says the same
    u = after[1]["usage"]
    assert u["continued_tokens"] == before["usage"]["completion_tokens"]
    total = u["continued_tokens"] + u["completion_tokens"]
    rate = r" · \d+(\.\d)? tok/s" if rate_shown(after[1]) else ""
    line = reply.locator(".stats-line").text_content() or ""
    new, cached = u["completion_tokens"], u["cached_tokens"]
    assert re.fullmatch(rf"{total:,} tokens \({new:,} new\){rate} · {cached:,} from cache", line), line
    reply.locator(".stats-line").click()
    details = reply.locator(".stats-details").text_content() or ""
    assert details.startswith(f"Continued: {u['continued_tokens']:,} tokens written before, {new:,} by the last "
                              "Continue; the times and speed are of those"), details
    shot(page, "desktop-light-continued-stats")
    reload_chat(page, sid)
    assert page.locator(".msg.assistant .stats-line").text_content() == line


def test_copy_a_user_message_and_see_times_on_hover(new_page: Callable[..., Page], browser) -> None:  # noqa: F811
    page = new_page()
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    send(page, "Copy me, please.\nTwo lines.")
    wait_finished(page, 1)
    user = page.locator(".msg.user").first
    actions = user.locator(".on-hover")
    assert float(actions.evaluate("(e) => getComputedStyle(e).opacity")) == 0  # quiet until hovered
    user.hover()
    page.wait_for_function("() => getComputedStyle(document.querySelector('.msg.user .on-hover')).opacity === '1'",
                           timeout=WAIT_MS)
    time = user.locator(".msg-time")
    assert time.get_attribute("datetime") and (time.get_attribute("title") or "")
    assert page.locator(".msg.assistant .msg-time").get_attribute("datetime")
    shot(page, "desktop-light-user-hover")
    user.locator(".copy-user").click()
    page.wait_for_function("() => document.getElementById('announcer').textContent === 'Message copied.'",
                           timeout=WAIT_MS)
    assert page.evaluate("() => navigator.clipboard.readText()") == "Copy me, please.\nTwo lines."


def test_edit_and_versions_fit_a_390px_phone(new_page: Callable[..., Page]) -> None:  # noqa: F811
    page = new_page(viewport=PHONE, scheme="dark")
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    send(page, "Short question")
    wait_finished(page, 1)
    page.locator(".msg.user .edit-user").click()  # hover-less screens show the actions
    page.locator(".edit-input").fill("A different question")
    page.locator(".edit-send").click()
    wait_chat(page, ["A different question"], 1)
    width = page.evaluate("() => document.documentElement.scrollWidth")
    assert width <= PHONE["width"]
    shot(page, "phone-dark-versions")
    assert DESKTOP["width"] > PHONE["width"]
