"""The browser tests' fixtures: one headless Chromium per module, the gateway on the
tiny engine behind ``engine_gate``, a watch on page errors and dialogs, and fresh pages.
A test that uses ``browser`` (directly or through ``new_page``) is marked ``browser`` by
tests/conftest.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.engine_gate import EngineGate
from tests.web.page import CHROMIUM, DESKTOP, LAUNCH_ARGS, PageWatch


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium for the module (each test gets its own context)."""
    if not CHROMIUM.exists():
        pytest.fail("Chromium is not installed: apt-get install -y chromium", pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=LAUNCH_ARGS)
        yield b
        b.close()


@pytest.fixture
def gateway(gateway_factory: Callable[..., Any], engine_gate: EngineGate) -> Any:
    """The real gateway on the tiny engine (through ``engine_gate``) and this test's
    Redis key prefix."""
    return gateway_factory(engine_urls=[engine_gate.url])


@pytest.fixture
def watch() -> PageWatch:
    """Collects the test's page errors and dialogs."""
    return PageWatch()


@pytest.fixture
def new_page(browser: Browser, gateway: Any, watch: PageWatch) -> Iterator[Callable[..., Page]]:
    """``new_page(viewport=DESKTOP, scheme="light", context=None)``: a page on the
    gateway, in a fresh browser context (a fresh user) unless one is given. Fails
    the test on any uncaught page error."""
    contexts: list[Any] = []

    def make(viewport: dict[str, int] = DESKTOP, scheme: str = "light", context: Any = None) -> Page:
        if context is None:
            context = browser.new_context(base_url=gateway.base_url, viewport=viewport, color_scheme=scheme)
            contexts.append(context)
        return watch.attach(context.new_page())

    yield make
    for c in contexts:
        c.close()
    assert watch.errors == [], f"uncaught errors in the page: {watch.errors}"
