"""Prompt progress and the context meter in a real Chromium (the fixtures of
tests/web/conftest.py, the helpers of tests/web/page.py), on the tiny model served with a 64-token step budget
(``chunked_gate``), so a prompt of a few hundred tokens is read in several steps. The
engine is paused at its first ``progress`` item, so the page is looked at while the
prompt is being read: the typing dots give way to "Reading N / M tokens" and a thin bar;
once the reply streams they are gone, and the meter under the composer shows how full
the chat's context is, warning near the limit. Screenshots go to
artifacts/screenshots/progress-*.png."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from playwright.sync_api import Page

from tests.engine_gate import EngineGate, of_type
from tests.fixtures_servers import CHUNK_TOKENS, CHUNKED_MAX_MODEL_LEN
from tests.web.page import (
    DESKTOP,
    PHONE,
    WAIT_MS,
    create_chat,
    get_chat,
    open_chat,
    send,
    shot,
    wait_finished,
)

pytestmark = [pytest.mark.timeout(180)]

PARAMS = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def gateway(gateway_factory: Callable[..., Any], chunked_gate: EngineGate) -> Iterator[Any]:
    """The real gateway on the chunked-prefill tiny engine (through ``chunked_gate``)."""
    yield gateway_factory(engine_urls=[chunked_gate.url])


FIRST_WORDS = 240  # the first turn's prompt, in words (about 40% of the context)


def words(seed: str, n: int) -> str:
    """``n`` words of made-up text; a fresh ``seed`` per test keeps the prefix cache
    (shared by the tests on one engine) from reading most of the prompt at once."""
    rng = random.Random(seed)
    return " ".join(rng.choice(["canal", "lock", "barge", "towpath", "heron", "willow", "keeper"])
                    + str(rng.randrange(100)) for _ in range(n))


def used_tokens(chat: dict[str, Any]) -> int:
    usage = [m["usage"] for m in chat["messages"] if m["role"] == "assistant"][-1]
    return int(usage["prompt_tokens"] + usage["completion_tokens"])


def meter_text(page: Page) -> str:
    page.wait_for_selector("#context-meter:not([hidden])", timeout=WAIT_MS)
    return page.text_content("#context-meter .context-label") or ""


@pytest.mark.parametrize("viewport, scheme", [(DESKTOP, "light"), (DESKTOP, "dark"), (PHONE, "light"),
                                              (PHONE, "dark")], ids=["desktop-light", "desktop-dark",
                                                                     "phone-light", "phone-dark"])
def test_a_long_prompt_shows_reading_progress_then_the_context_meter_warns_near_the_limit(
        new_page: Callable[..., Page], chunked_gate: EngineGate, viewport: dict[str, int], scheme: str) -> None:
    tag = f"{'desktop' if viewport is DESKTOP else 'phone'}-{scheme}"
    page = new_page(viewport=viewport, scheme=scheme)
    sid = create_chat(page, PARAMS)
    open_chat(page, sid)
    assert page.is_hidden("#context-meter")  # an empty chat uses none of the context
    chunked_gate.pause_on(of_type("progress"))
    # long enough (about a dozen chunks) that the engine, stopped a step or two after its
    # first progress frame, is still reading the prompt, however fast its kernels are
    send(page, words(f"{tag}-1", FIRST_WORDS))
    chunked_gate.wait_paused()
    label = page.locator(".msg.assistant.streaming .prompt-progress-label")
    # polled on a timer, not on animation frames (which the stopped engine's first page
    # did not always get to run while the test waited)
    page.wait_for_function("() => !!document.querySelector('.msg.assistant.streaming .prompt-progress-label')",
                           polling=100, timeout=WAIT_MS)
    m = re.fullmatch(r"Reading ([\d,]+) / ([\d,]+) tokens", label.text_content() or "")
    assert m, label.text_content()
    done, total = (int(g.replace(",", "")) for g in m.groups())
    assert CHUNK_TOKENS <= done < total  # a chunk read (after any prefix cache hit), not all
    assert page.is_hidden(".msg.assistant.streaming .typing")  # the bar replaces the dots
    bar = page.locator(".msg.assistant.streaming .prompt-progress-track")
    assert bar.get_attribute("aria-valuenow") == str(done) and bar.get_attribute("aria-valuemax") == str(total)
    shot(page, f"progress-{tag}-reading")

    chunked_gate.resume(pause_on=of_type("progress"))  # one more chunk: the numbers move on
    chunked_gate.wait_paused()
    page.wait_for_function("(t) => { const l = document.querySelector('.prompt-progress-label');"
                           " return l && l.textContent !== t; }", arg=f"Reading {done:,} / {total:,} tokens",
                           timeout=WAIT_MS)
    assert (page.text_content(".prompt-progress-label") or "").endswith(f" / {total:,} tokens")
    chunked_gate.resume()
    wait_finished(page)
    assert page.locator(".prompt-progress").count() == 0  # gone once the reply came

    chat = get_chat(page, sid)
    assert [m["usage"]["prompt_tokens"] for m in chat["messages"] if m["role"] == "assistant"] == [total]
    pct = round(100 * used_tokens(chat) / CHUNKED_MAX_MODEL_LEN)
    assert meter_text(page) == f"{pct}% of context"
    assert page.get_attribute("#context-meter", "data-level") == "ok"
    page.reload()  # the meter comes from the stored chat as well
    page.wait_for_selector(f"body[data-connection=open][data-chat='{sid}']", timeout=WAIT_MS)
    assert meter_text(page) == f"{pct}% of context"
    shot(page, f"progress-{tag}-meter")

    # a second turn that brings the chat to about 88% of the context: the meter warns
    per_word = (total - 30) / FIRST_WORDS  # about; the chat template adds a few dozen tokens
    more = int((0.88 * CHUNKED_MAX_MODEL_LEN - used_tokens(chat) - 20) / per_word)
    send(page, words(f"{tag}-2", more))
    wait_finished(page, 2)
    chat = get_chat(page, sid)
    pct = round(100 * used_tokens(chat) / CHUNKED_MAX_MODEL_LEN)
    assert 80 <= pct < 95, pct
    assert meter_text(page) == f"{pct}% of context: nearing the limit"
    assert page.get_attribute("#context-meter", "data-level") == "warn"
    shot(page, f"progress-{tag}-meter-warn")

