"""The chat installs as an app, in a real Chromium (the fixtures of
tests/web/conftest.py): a web app manifest with its icons, and a service worker that
keeps the app shell for starting without the server, whose cached shell is replaced as
soon as the server serves a new version, and that never caches the API. The gateway here
serves a copy of web/ and static/ that the test changes, as an upgrade would.
Screenshots go to artifacts/screenshots/install-*.png."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page

from tests.web.page import DESKTOP, WAIT_MS, PageWatch, shot

pytestmark = [pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]


def shell_cache(page: Page) -> list[str]:
    """The paths the service worker's caches hold."""
    return page.evaluate("""async () => {
        const out = [];
        for (const name of await caches.keys()) {
            for (const req of await (await caches.open(name)).keys()) out.push(new URL(req.url).pathname);
        }
        return out.sort();
    }""")


def test_an_upgrade_reaches_the_page_and_the_last_version_starts_without_the_server(
        browser: Browser, gateway_factory: Callable[..., Any], engine_url: str, watch: PageWatch,
        tmp_path: Path) -> None:
    web, static = tmp_path / "web", tmp_path / "static"
    shutil.copytree(ROOT / "web", web)
    shutil.copytree(ROOT / "static", static)
    gw = gateway_factory(engine_urls=[engine_url], web_dir=web, static_dir=static)
    context = browser.new_context(base_url=gw.base_url, viewport=DESKTOP)
    try:
        page = watch.attach(context.new_page())
        page.goto("/")
        page.wait_for_selector("body[data-connection=open][data-chat='new']", timeout=WAIT_MS)
        assert page.text_content(".empty-title") == "How can I help?"  # version A

        # installable: the manifest and its icons
        manifest = page.request.get(page.evaluate("() => document.querySelector('link[rel=manifest]').href"))
        assert manifest.ok and manifest.headers["content-type"].startswith("application/manifest+json")
        m = manifest.json()
        assert m["start_url"] == "/" and m["display"] == "standalone" and m["name"]
        sizes = {i["sizes"]: i for i in m["icons"] if i["type"] == "image/png"}
        assert {"192x192", "512x512"} <= set(sizes) and any(i.get("purpose") == "maskable" for i in m["icons"])
        for icon in m["icons"]:
            loaded = page.evaluate(
                """(src) => new Promise((ok) => { const im = new Image();
                    im.onload = () => ok([im.naturalWidth, im.naturalHeight]);
                    im.onerror = () => ok(null); im.src = src; })""", icon["src"])
            assert loaded, icon
            if icon["sizes"] != "any":
                assert f"{loaded[0]}x{loaded[1]}" == icon["sizes"], (icon, loaded)
        sw = page.request.get("/sw.js")
        assert sw.ok and "javascript" in sw.headers["content-type"]

        # the service worker is active once the shell is cached
        assert page.evaluate("async () => !!(await navigator.serviceWorker.ready).active")
        page.reload()
        page.wait_for_selector("body[data-connection=open][data-chat='new']", timeout=WAIT_MS)
        page.request.get("/api/sessions")
        page.evaluate("() => fetch('/api/sessions').then((r) => r.json())")  # through the page: not cached
        cached = shell_cache(page)
        assert "/" in cached and "/static/app.js" in cached and "/static/js/controller.js" in cached
        assert not [p for p in cached if p.startswith(("/api", "/v1", "/ws", "/readyz"))], cached

        # version B is served: the next load shows it, page and modules alike
        html = (web / "index.html").read_text()
        (web / "index.html").write_text(html.replace("How can I help?", "What shall we write today?"))
        js = (static / "js" / "shortcuts.js").read_text()
        (static / "js" / "shortcuts.js").write_text(js.replace('does: "New chat"', 'does: "Start a new chat"'))
        page.reload()
        page.wait_for_selector("body[data-connection=open][data-chat='new']", timeout=WAIT_MS)
        assert page.text_content(".empty-title") == "What shall we write today?"
        assert "Start a new chat" in (page.text_content("#shortcut-rows") or "")
        shot(page, "install-desktop-light-version-b")

        # the server goes away: the app still starts, from the cached shell, as version B
        gw.stop()
        page.reload()
        page.wait_for_selector("body[data-connection]", timeout=WAIT_MS)
        assert page.text_content(".empty-title") == "What shall we write today?"
        assert "Start a new chat" in (page.text_content("#shortcut-rows") or "")
        page.wait_for_selector("#conn-banner:not([hidden])", timeout=WAIT_MS)
        shot(page, "install-desktop-light-offline-start")
    finally:
        context.close()
    assert watch.errors == []
