"""The model picker in a real Chromium, on a gateway with two engines serving different
tiny models (the plain one and one whose template thinks): each chat keeps the model
chosen for it, a new chat starts with the last model chosen, replies come from the chosen
model, and a chat whose model is no longer served says so clearly. Desktop and a 390 px
phone. Screenshots go to artifacts/screenshots/models-*.png."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from playwright.sync_api import Page

from tests.engine_gate import EngineGate
from tests.gateway.engines.test_models import both_up
from tests.web.page import PHONE, WAIT_MS, get_chat, open_chat, send, shot, wait_finished
from tests.web.test_accessibility import axe_violations
from tests.web.test_reasoning import user_of

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


@pytest.fixture
def gateway(gateway_factory: Callable[..., Any], engine_gate: EngineGate, thinker_gate: EngineGate) -> Iterator[Any]:
    """One gateway on two engines: the tiny model first (the default), the thinker second."""
    yield both_up(gateway_factory(engine_urls=[engine_gate.url, thinker_gate.url]))


def names(gw: Any) -> tuple[str, str]:
    clients = gw.state.router.clients
    return clients[0].info.model, clients[1].info.model


def chat_id(page: Page) -> str:
    page.wait_for_function("() => /^#\\/c\\//.test(location.hash)", timeout=WAIT_MS)
    return page.evaluate("() => location.hash.slice(4)")


def test_each_chat_keeps_its_model_and_new_chats_start_with_the_last_chosen(
        new_page: Callable[..., Page], gateway: Any) -> None:
    plain, thinker = names(gateway)
    page = new_page()
    open_chat(page)
    picker = page.locator("#model-picker")
    assert picker.is_visible() and picker.input_value() == plain
    assert [o.strip() for o in picker.locator("option").all_text_contents()] == [plain, thinker]
    assert page.get_attribute("#input", "placeholder") == f"Message {plain}"
    send(page, "Hello")
    wait_finished(page)
    first = chat_id(page)
    assert page.locator(".msg.assistant .thinking").is_hidden()  # the plain model does not reason
    assert get_chat(page, first)["messages"][1]["model"] == plain

    # the chat's next replies come from the model chosen for it
    picker.select_option(thinker)
    page.wait_for_function("([id, m]) => fetch('/api/sessions/' + id).then((r) => r.json())"
                           ".then((s) => s.model === m)", arg=[first, thinker], timeout=WAIT_MS)
    assert page.get_attribute("#input", "placeholder") == f"Message {thinker}"
    send(page, "Think it over")
    wait_finished(page, 2)
    assert page.locator(".msg.assistant").nth(1).locator(".thinking").is_visible()
    assert get_chat(page, first)["messages"][3]["model"] == thinker
    shot(page, "models-desktop-light-picker")
    assert axe_violations(page) == []

    # a new chat starts with the last model chosen; the first chat still shows its own
    page.click("#new-chat-top")
    page.wait_for_selector("body[data-chat='new']")
    assert picker.input_value() == thinker
    send(page, "A new chat")
    wait_finished(page)
    second = chat_id(page)
    assert second != first and get_chat(page, second)["model"] == thinker
    page.click("#new-chat-top")
    page.wait_for_selector("body[data-chat='new']")
    picker.select_option(plain)  # for the next new chat
    open_chat(page, first)
    assert picker.input_value() == thinker
    page.reload()
    page.wait_for_selector(f"body[data-connection=open][data-chat='{first}']", timeout=WAIT_MS)
    assert picker.input_value() == thinker  # kept with the chat
    page.click("#new-chat-top")
    page.wait_for_selector("body[data-chat='new']")
    assert picker.input_value() == plain  # remembered in this browser

    page.set_viewport_size(PHONE)
    page.emulate_media(color_scheme="dark")
    open_chat(page, first)
    page.reload()
    page.wait_for_selector(f"body[data-connection=open][data-chat='{first}']", timeout=WAIT_MS)
    assert page.text_content(".model-name") == thinker
    box = picker.bounding_box()
    assert box is not None and box["x"] + box["width"] <= PHONE["width"] and box["height"] >= 32
    shot(page, "models-phone-dark-picker")
    assert axe_violations(page) == []


def test_a_chat_whose_model_is_gone_says_so_and_keeps_the_message(new_page: Callable[..., Page], gateway: Any) -> None:
    page = new_page()
    page.goto("/")
    uid = user_of(page, gateway)
    store = gateway.state.store

    async def seed() -> str:
        chat = await store.create_session(uid, title="Old model", model="retired-model")
        return chat.id

    sid = gateway.run(seed())
    open_chat(page, sid)
    assert page.locator("#model-picker").input_value() == "retired-model"
    send(page, "Are you there?")
    page.wait_for_selector("#notice:not([hidden]) >> text=not served here", timeout=WAIT_MS)
    assert "model menu" in (page.text_content("#notice-text") or "")
    assert page.text_content(".model-name") == "retired-model"
    assert page.input_value("#input") == "Are you there?"  # the message is put back, not lost
    assert get_chat(page, sid)["messages"] == []
    shot(page, "models-desktop-light-gone")
