"""The transcript as a user reads it, in a real Chromium (the fixtures of
tests/web/conftest.py, the helpers of tests/web/page.py): a long paste collapsed with "Show more" / "Show less", a
notice about a busy chat that goes when the reply ends or the chat is deleted, focus
kept on something useful after a delete, and a chat named after its first message that
follows an edit of that message. Screenshots go to artifacts/screenshots/transcript-*.png."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
from playwright.sync_api import Page, Route

from tests.engine_gate import EngineGate, text_delta
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
    wait_streaming_text,
)

pytestmark = [pytest.mark.timeout(180)]

# A 10,000-character paste of 123 lines (a log or a table): about 370 tokens of the
# tiny model's tokenizer, so the chat fits its context.
PASTE = ("=" * 80 + "\n") * 123


def bubble_height(page: Page, index: int = 0) -> float:
    box = page.locator(".msg.user .msg-body").nth(index).bounding_box()
    assert box is not None
    return box["height"]


def test_a_long_paste_is_collapsed_with_show_more_and_show_less(new_page: Callable[..., Page]) -> None:
    page = new_page()
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    send(page, "A short question stays whole.")
    wait_finished(page, 1)
    send(page, PASTE)
    wait_finished(page, 2)

    assert page.locator(".msg.user").nth(0).locator(".show-more").count() == 0
    long_msg = page.locator(".msg.user").nth(1)
    more = long_msg.locator(".show-more")
    assert more.is_visible() and more.text_content() == "Show more"
    assert more.get_attribute("aria-expanded") == "false"
    assert bubble_height(page, 1) < 400
    shot(page, "transcript-desktop-light-collapsed")

    more.click()
    assert more.text_content() == "Show less" and more.get_attribute("aria-expanded") == "true"
    assert bubble_height(page, 1) > 2000  # all 123 lines
    assert (long_msg.locator(".msg-body").text_content() or "") == PASTE.rstrip("\n") or \
        (long_msg.locator(".msg-body").text_content() or "") == PASTE
    more.click()
    assert more.text_content() == "Show more" and bubble_height(page, 1) < 400

    # a stored chat comes back collapsed, on a phone too
    page.set_viewport_size(PHONE)
    page.emulate_media(color_scheme="dark")
    reload_chat(page, sid)
    page.wait_for_selector(".msg.user .show-more")
    assert bubble_height(page, 1) < 400
    page.locator(".msg.user .show-more").scroll_into_view_if_needed()
    shot(page, "transcript-phone-dark-collapsed")
    # editing shows the whole text
    page.locator(".msg.user").nth(1).locator(".edit-user").click()
    assert page.locator(".edit-input").input_value() == get_chat(page, sid)["messages"][2]["content"]
    assert page.locator(".msg.user .show-more").first.is_hidden()


def test_the_busy_notice_goes_when_the_reply_ends_or_its_chat_is_deleted(
        new_page: Callable[..., Page], engine_gate: EngineGate) -> None:
    page = new_page()
    other = create_chat(page, SHORT, title="Another chat")
    sid = create_chat(page, LONG)
    open_chat(page, sid)
    send_paused(page, engine_gate, "Write a very long story.")
    send(page, "And another thing")
    page.wait_for_selector("#notice:not([hidden]) >> text=still being written")
    stop_and_resume(page, engine_gate)
    page.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)
    page.wait_for_selector("#notice", state="hidden")  # the reply it spoke of has ended

    # again, and this time the chat is deleted while it writes
    page.fill("#input", "")
    send_paused(page, engine_gate, "Write another long story.")
    send(page, "And one more thing")
    page.wait_for_selector("#notice:not([hidden]) >> text=still being written")

    # The server's answer to the delete is held back, so that the reply's end, the chat's
    # "deleted" event and any re-read of the chat all reach the page before it: none of
    # them may leave a notice about a chat the user just deleted.
    def answer_late(route: Route) -> None:
        if route.request.method != "DELETE":
            route.continue_()
            return
        answer = route.fetch()
        time.sleep(1.0)  # the browser goes on meanwhile; only this answer waits
        route.fulfill(response=answer)

    page.route(f"**/api/sessions/{sid}", answer_late)
    page.click(f".chat-item[data-id='{sid}'] .delete")
    page.click("#confirm-dialog .btn.danger")
    page.wait_for_selector(f".chat-item[data-id='{sid}']", state="detached")
    page.wait_for_function("() => location.hash === '#/'")
    page.wait_for_selector("#notice", state="hidden")
    # focus is in the composer, not lost on the page's body
    page.wait_for_function("() => document.activeElement && document.activeElement.id === 'input'")
    engine_gate.resume()

    # deleting a chat that is not open puts focus on its neighbour in the list
    third = create_chat(page, SHORT, title="Third chat")
    page.reload()
    page.wait_for_selector(f".chat-item[data-id='{third}']")
    page.click(f".chat-item[data-id='{third}'] .delete")
    page.click("#confirm-dialog .btn.danger")
    page.wait_for_selector(f".chat-item[data-id='{third}']", state="detached")
    page.wait_for_function("(id) => document.activeElement && document.activeElement.closest"
                           "&& document.activeElement.closest('.chat-item')?.dataset.id === id", arg=other)


def test_a_title_taken_from_the_first_message_follows_its_edit(new_page: Callable[..., Page]) -> None:
    page = new_page()
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    send(page, "Plan a picnic in the park")
    wait_finished(page, 1)
    page.wait_for_function("() => document.getElementById('chat-heading').textContent === 'Plan a picnic in the park'")

    first = page.locator(".msg.user").first
    first.hover()
    first.locator(".edit-user").click()
    page.locator(".edit-input").fill("Plan a day at the beach")
    page.locator(".edit-input").press("Enter")
    page.wait_for_function("() => document.getElementById('chat-heading').textContent === 'Plan a day at the beach'",
                           timeout=WAIT_MS)
    page.wait_for_selector(f".chat-item[data-id='{sid}'] .chat-link >> text=Plan a day at the beach")
    page.wait_for_function(
        "async (id) => (await (await fetch('/api/sessions/' + id)).json()).title === 'Plan a day at the beach'",
        arg=sid)
    wait_finished(page, 1)

    # showing the first version again brings its title back
    page.locator(".msg.user .version-prev").click()
    page.wait_for_function("() => document.getElementById('chat-heading').textContent === 'Plan a picnic in the park'",
                           timeout=WAIT_MS)
    assert get_chat(page, sid)["title"] == "Plan a picnic in the park"

    # a title the user gave is theirs: an edit keeps it
    page.click(f".chat-item[data-id='{sid}'] .rename")
    page.fill(".rename-input", "Summer outings")
    page.press(".rename-input", "Enter")
    page.wait_for_function("() => document.getElementById('chat-heading').textContent === 'Summer outings'")
    first.hover()
    first.locator(".edit-user").click()
    page.locator(".edit-input").fill("Plan a hike")
    page.locator(".edit-input").press("Enter")
    page.wait_for_function("() => [...document.querySelectorAll('.msg.user .msg-body')].map((e) => e.textContent)"
                           ".join() === 'Plan a hike'", timeout=WAIT_MS)
    wait_finished(page, 1)
    assert page.text_content("#chat-heading") == "Summer outings"
    assert get_chat(page, sid)["title"] == "Summer outings"


def test_stats_read_in_words_with_a_live_rate_while_the_reply_streams(
        new_page: Callable[..., Page], engine_gate: EngineGate) -> None:
    page = new_page()
    open_chat(page)
    # the welcome screen talks to people, not about number formats; those who ask find it
    welcome = page.text_content("#empty-state") or ""
    config = page.request.get("/api/config").json()
    assert config["format"] and config["format"] not in welcome and "activations" not in welcome
    assert page.get_attribute("#empty-state strong", "title") == f"Served as {config['format']}"
    shot(page, "transcript-desktop-light-welcome")

    sid = create_chat(page, LONG)
    open_chat(page, sid)
    engine_gate.pause_on(text_delta())
    send(page, "Write a very long story.")
    engine_gate.wait_paused()
    wait_streaming_text(page, 0)
    page.wait_for_timeout(400)  # some time passes between the first text and the next
    engine_gate.resume(pause_on=text_delta())
    engine_gate.wait_paused()
    live = page.locator(".msg.assistant.streaming .live-rate")
    live.wait_for(state="visible", timeout=WAIT_MS)
    assert re.fullmatch(r"≈ \d+(\.\d)? tok/s", live.text_content() or ""), live.text_content()
    shot(page, "transcript-desktop-light-live-rate")
    stop_and_resume(page, engine_gate)
    page.wait_for_selector(".msg.assistant .badge-partial", timeout=WAIT_MS)
    assert page.locator(".msg.assistant .live-rate").is_hidden()

    page.fill("#input", "")
    old_id = page.locator(".msg.assistant").get_attribute("data-message-id")
    page.locator(".msg.assistant .regenerate").click()  # the same prompt again: read from the cache
    page.wait_for_function(
        "(old) => { const a = document.querySelectorAll('.msg.assistant');"
        " return a.length === 1 && a[0].dataset.status && a[0].dataset.messageId !== old; }",
        arg=old_id, timeout=WAIT_MS)
    line = page.text_content(".msg.assistant .stats-line") or ""
    assert re.fullmatch(r"[\d,]+ tokens · \d+(\.\d)? tok/s · [\d,]+ from cache", line), line
    reply = get_chat(page, sid)["messages"][-1]
    assert line.startswith(f"{reply['usage']['completion_tokens']:,} tokens")
    assert line.endswith(f"· {reply['usage']['cached_tokens']:,} from cache")
    assert page.locator(".msg.assistant .stats-details").is_hidden()
    page.click(".msg.assistant .stats-line")  # TTFT and the rest, a click (or Enter) away
    details = page.locator(".msg.assistant .stats-details")
    assert details.is_visible()
    assert re.match(r"First token after [\d,]+ ms \(TTFT\) · prompt [\d,]+ tokens, [\d,]+ from cache",
                    details.text_content() or ""), details.text_content()
    shot(page, "transcript-desktop-light-stats")

    page.click("#open-settings")
    assert page.text_content("#model-format") == config["format"]


# The rule (static/js/format.js), on numbers no engine run gives on demand: [formatStats, noRate]
RATE_RULE_JS = """async () => {
    const app = document.querySelector('script[type=module][src$="app.js"]').src;
    const f = await import(new URL('js/format.js', app).href);
    const s = (completion, ttft, e2e, continued) => {
        const r = f.replyStats({completion_tokens: completion, continued_tokens: continued},
                               {ttft_ms: ttft, tpot_ms: 1, e2e_ms: e2e});
        return [f.formatStats(r), r.noRate];
    };
    return [s(2, 10, 10.4), s(9, 10, 40), s(9, 10, 410), s(61, 100, 1100, 60)];
}"""


def test_a_reply_too_short_for_a_meaningful_speed_shows_no_rate(new_page: Callable[..., Page]) -> None:
    page = new_page()
    sid = create_chat(page, {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    open_chat(page, sid)
    send(page, "Hi")
    wait_finished(page)
    line = page.text_content(".msg.assistant .stats-line") or ""
    assert re.fullmatch(r"2 tokens( · [\d,]+ from cache)?", line), line  # no "1,843 tok/s" from one interval
    page.click(".msg.assistant .stats-line")
    details = page.text_content(".msg.assistant .stats-details") or ""
    assert "too short for a speed (under 8 tokens after the first)" in details, details
    assert "ms per token" not in details
    assert page.evaluate(RATE_RULE_JS) == [
        ["2 tokens", "too short for a speed (under 8 tokens after the first)"],
        ["9 tokens", "too quick for a speed (under 50 ms after the first token)"],  # a burst: 8 tokens in 30 ms
        ["9 tokens · 20 tok/s", ""],  # 8 tokens after the first in 400 ms
        ["121 tokens (61 new) · 60 tok/s", ""],  # continued: the rate is of the 61 new tokens
    ]
