"""A chat whose KV comes back from the engine's disk tier says so under the reply: after
an engine restart (an empty pool), regenerating the last reply restores the prompt's
pages from disk, and the reply's footer reads "N from cache (M from disk)" with the
counts the gateway stored. A real engine process with its own store directory, the real
gateway, a real Chromium (tests/web/conftest.py, tests/web/page.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page

from gateway.server.local import LocalEngine
from tests.fixtures_servers import ENGINE_ARGS, _running_engine
from tests.web.page import SHORT, WAIT_MS, create_chat, get_chat, open_chat, rate_shown, send, shot, wait_finished

pytestmark = [pytest.mark.timeout(300)]

# About 90 tokens of the tiny model's tokenizer: five whole pages of 16 to restore.
QUESTION = ("Tell me how a lighthouse keeper spent a winter night on a rocky island long ago, "
            "what the lamp needed every hour, and what the keeper wrote in the log before dawn.")


@pytest.fixture
def disk_engine(tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalEngine]:
    """The tiny engine with the disk KV tier on, in this test's own folder."""
    with _running_engine(tiny_model_dir, ENGINE_ARGS + ["--threads", "1", "--kv-disk-dir",
                                                        str(tmp_path / "kv")]) as engine:
        yield engine


@pytest.fixture
def gateway(gateway_factory: Callable[..., Any], disk_engine: LocalEngine) -> Any:
    """The real gateway on ``disk_engine`` (replaces the web tests' gated engine)."""
    assert disk_engine.url is not None
    return gateway_factory(engine_urls=[disk_engine.url])


def test_after_an_engine_restart_the_footer_says_how_much_came_from_disk(
        new_page: Callable[..., Page], gateway: Any, disk_engine: LocalEngine) -> None:
    page = new_page()
    sid = create_chat(page, SHORT)
    open_chat(page, sid)
    send(page, QUESTION)
    wait_finished(page, 1)
    first = page.text_content(".msg.assistant .stats-line") or ""
    assert "from disk" not in first, first  # a cold prompt: nothing restored

    disk_engine.stop()  # its pages are on disk (the engine writes them out as it stops)
    disk_engine.start(timeout_s=600)  # same port, same folder, an empty pool
    deadline = time.monotonic() + 60
    while not gateway.state.router.healthy and time.monotonic() < deadline:
        time.sleep(0.05)  # the gateway reconnects

    old_id = page.locator(".msg.assistant").get_attribute("data-message-id")
    page.locator(".msg.assistant .regenerate").click()  # the same prompt again, after the restart
    page.wait_for_function(
        "(old) => { const a = document.querySelectorAll('.msg.assistant');"
        " return a.length === 1 && a[0].dataset.status && a[0].dataset.messageId !== old; }",
        arg=old_id, timeout=WAIT_MS)
    reply = get_chat(page, sid)["messages"][-1]
    usage = reply["usage"]
    assert usage["cached_disk_tokens"] >= 16 and usage["cached_disk_tokens"] == usage["cached_tokens"]
    line = page.text_content(".msg.assistant .stats-line") or ""
    rate = r" · \d+(\.\d)? tok/s" if rate_shown(reply) else ""
    assert re.fullmatch(rf"[\d,]+ tokens{rate} · [\d,]+ from cache \([\d,]+ from disk\)", line), line
    assert line.endswith(f"· {usage['cached_tokens']:,} from cache ({usage['cached_disk_tokens']:,} from disk)")
    page.click(".msg.assistant .stats-line")  # the details say it too
    details = page.locator(".msg.assistant .stats-details").text_content() or ""
    assert f"{usage['cached_tokens']:,} from cache ({usage['cached_disk_tokens']:,} from disk)" in details, details
    shot(page, "transcript-desktop-light-from-disk")
