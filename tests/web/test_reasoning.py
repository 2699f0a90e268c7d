"""A reply's reasoning in a real Chromium: shown apart from the answer as a block that
reads "Thinking…" (open) while the reasoning streams and "Thought for N s" (folded) once
it is done, opened by a click, on a desktop and a 390 px phone. The live reply comes from
a real engine on a tiny model whose chat template thinks; the stored one, with an answer
after its reasoning, is written to the chat store as the gateway stores replies.
Screenshots go to artifacts/screenshots/reasoning-*.png."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page

from gateway.api.auth import COOKIE_NAME, UserIds
from tests.engine_gate import EngineGate, text_delta
from tests.web.page import PHONE, WAIT_MS, create_chat, open_chat, send, shot, wait_finished
from tests.web.test_accessibility import axe_violations

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


@pytest.fixture
def gateway(gateway_factory: Callable[..., Any], thinker_gate: EngineGate) -> Iterator[Any]:
    """The gateway on the thinking tiny model (through ``thinker_gate``)."""
    yield gateway_factory(engine_urls=[thinker_gate.url])


def user_of(page: Page, gw: Any) -> str:
    cookie = next(c["value"] for c in page.context.cookies() if c["name"] == COOKIE_NAME)
    uid = UserIds(gw.config.secret_key).verify(cookie)
    assert uid is not None
    return uid


def test_reasoning_streams_in_a_thinking_block_that_folds_when_the_reply_ends(
        new_page: Callable[..., Page], thinker_gate: EngineGate) -> None:
    page = new_page()
    sid = create_chat(page, {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True})
    open_chat(page, sid)
    thinker_gate.pause_on(text_delta())
    send(page, "Why is the sky blue?")
    page.wait_for_selector(".msg.assistant.streaming .thinking:not([hidden])", timeout=WAIT_MS)
    block = page.locator(".msg.assistant .thinking")
    assert page.locator(".msg.assistant .thinking-line").text_content() == "Thinking…"
    assert block.get_attribute("open") is not None  # open while the reasoning streams
    assert "<think>" not in (page.locator(".msg.assistant").text_content() or "")
    shot(page, "reasoning-desktop-light-thinking")
    assert axe_violations(page) == []
    thinker_gate.resume()
    wait_finished(page)
    line = page.locator(".msg.assistant .thinking-line").text_content() or ""
    assert line.startswith("Thought for ") and line.endswith(" s") or line == "Thought for a moment"
    assert block.get_attribute("open") is None  # folded once the reply is done
    page.click(".msg.assistant .thinking-line")
    assert (page.locator(".msg.assistant .thinking-body").text_content() or "").strip()
    assert page.locator(".msg.assistant .msg-body").text_content() == ""  # all of it was reasoning


def stored_reply_with_reasoning(page: Page, gw: Any) -> str:
    """A chat of the page's user ("Rainbows") whose reply reasoned for 4.2 s, then answered
    "**Light bends** in raindrops.", written to the store as the gateway stores replies;
    returns its id."""
    page.goto("/")
    uid = user_of(page, gw)
    store = gw.state.store

    async def seed() -> str:
        chat = await store.create_session(uid, title="Rainbows")
        turn = await store.begin_turn(uid, chat.id, mode="chat", content="How does a rainbow form?")
        text = "<think>\nSunlight, droplets, refraction.\nKeep it short.\n</think>\n\n**Light bends** in raindrops."
        await store.finish_turn(uid, chat.id, turn, {
            "content": text, "status": "complete", "finish_reason": "stop", "reasoning_ms": 4200.0,
            "usage": {"prompt_tokens": 20, "cached_tokens": 0, "completion_tokens": 18},
            "timings": {"ttft_ms": 10.0, "tpot_ms": 5.0, "e2e_ms": 100.0}, "created_at": 0.0}, None, None)
        return chat.id

    sid: str = gw.run(seed())
    return sid


def test_a_stored_reply_shows_its_reasoning_folded_above_its_answer(new_page: Callable[..., Page], gateway) -> None:
    page = new_page()
    sid = stored_reply_with_reasoning(page, gateway)
    open_chat(page, sid)
    reply = page.locator(".msg.assistant")
    assert reply.locator(".thinking-line").text_content() == "Thought for 4.2 s"
    assert reply.locator(".thinking").get_attribute("open") is None
    assert reply.locator(".msg-body strong").text_content() == "Light bends"
    assert (reply.locator(".msg-body").text_content() or "").strip() == "Light bends in raindrops."
    shot(page, "reasoning-desktop-light-folded")
    reply.locator(".thinking-line").click()
    assert "Sunlight, droplets, refraction." in (reply.locator(".thinking-body").text_content() or "")
    shot(page, "reasoning-desktop-light-open")

    page.set_viewport_size(PHONE)
    page.emulate_media(color_scheme="dark")
    page.reload()
    page.wait_for_selector(f"body[data-connection=open][data-chat='{sid}']", timeout=WAIT_MS)
    line = page.locator(".msg.assistant .thinking-line")
    box = line.bounding_box()
    assert box is not None and box["height"] >= 28 and box["x"] + box["width"] <= PHONE["width"]
    line.click()
    shot(page, "reasoning-phone-dark-open")
    assert axe_violations(page) == []


def test_search_and_the_markdown_export_show_reasoning_apart_as_the_page_does(
        new_page: Callable[..., Page], gateway) -> None:
    page = new_page()
    sid = stored_reply_with_reasoning(page, gateway)
    open_chat(page, sid)
    hit = f"#search-results .search-hit[data-id='{sid}'] .hit-snippet"
    page.fill("#chat-search", "bends")
    page.wait_for_selector(hit)
    assert page.text_content(hit) == "**Light bends** in raindrops."  # the answer, not the reasoning before it
    page.fill("#chat-search", "refraction")
    page.wait_for_selector(f"{hit} >> text=Thoughts:")
    assert page.text_content(hit) == "Thoughts: Sunlight, droplets, refraction. Keep it short."
    shot(page, "reasoning-desktop-light-search")
    page.fill("#chat-search", "think>")  # the markers are not the reply's text
    page.wait_for_selector("#search-results >> text=No chats contain")
    page.press("#chat-search", "Escape")

    page.click("#open-settings")
    with page.expect_download() as dl:
        page.click("#export-md")
    md = Path(dl.value.path()).read_text()
    assert "<think>" not in md and "</think>" not in md
    assert ("## Assistant\n\n> *Thought for 4.2 s*\n>\n> Sunlight, droplets, refraction.\n> Keep it short.\n\n"
            "**Light bends** in raindrops.\n") in md


def test_a_shared_chat_shows_a_replys_reasoning_folded_above_its_answer(new_page: Callable[..., Page], gateway) -> None:
    page = new_page()
    sid = stored_reply_with_reasoning(page, gateway)
    r = page.request.post(f"/api/sessions/{sid}/shares", data={})
    assert r.status == 201, r.text()
    page.goto(r.json()["url"])
    reply = page.locator(".msg.assistant")
    reply.wait_for(timeout=WAIT_MS)
    assert reply.locator(".thinking-line").text_content() == "Thought for 4.2 s"
    assert reply.locator(".thinking").get_attribute("open") is None
    assert (reply.locator(".msg-body").text_content() or "").strip() == "Light bends in raindrops."
    assert "think>" not in (page.text_content("#messages") or "")
    reply.locator(".thinking-line").click()
    assert "Sunlight, droplets, refraction." in (reply.locator(".thinking-body").text_content() or "")
    shot(page, "reasoning-desktop-light-shared")
