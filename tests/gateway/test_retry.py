"""gateway.retry: the one backoff policy."""

from __future__ import annotations

import pytest

from gateway.errors import GatewayError
from gateway.retry import Backoff, is_store_unavailable, retry


def test_backoff_doubles_to_its_cap_and_resets():
    b = Backoff(0.1, 0.5)
    assert [round(b.next_delay(), 3) for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    b.reset()
    assert b.peek() == 0.1


def test_jitter_stays_within_its_band():
    b = Backoff(1.0, 1.0, jitter=0.5)
    assert all(0.5 <= b.next_delay() <= 1.5 for _ in range(200))


async def test_retry_retries_store_outages_then_succeeds_and_gives_up_on_other_errors():
    calls = 0
    seen: list[BaseException] = []

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise GatewayError("store_unavailable", "down")
        return "ok"

    assert await retry(flaky, budget_s=5, retryable=is_store_unavailable, backoff=Backoff(0.001, 0.002),
                       on_retry=seen.append) == "ok"
    assert calls == 3 and len(seen) == 2

    async def refused() -> None:
        raise GatewayError("not_found", "gone")

    with pytest.raises(GatewayError, match="gone"):
        await retry(refused, budget_s=5, retryable=is_store_unavailable)


async def test_retry_gives_up_when_the_budget_is_spent():
    async def down() -> None:
        raise GatewayError("store_unavailable", "down")

    with pytest.raises(GatewayError, match="down"):
        await retry(down, budget_s=0.05, retryable=is_store_unavailable, backoff=Backoff(0.01, 0.02))


async def test_a_link_reconnects_after_each_failure_and_logs_an_outage_once_and_its_end_once(caplog):
    import asyncio
    import logging

    from gateway.retry import Outage, keep_connected

    log = logging.getLogger("gateway.test_link")
    caplog.set_level(logging.INFO, logger="gateway.test_link")
    tries: list[int] = []
    served = asyncio.Event()

    async def session(connected):
        tries.append(len(tries))
        if len(tries) <= 3:
            raise ConnectionError("refused")  # down three times in a row
        connected()
        served.set()
        await asyncio.Event().wait()  # up until cancelled

    backoff = Backoff(0.001, 0.002)
    task = asyncio.create_task(keep_connected(session, outage=Outage("test link", log), backoff=backoff))
    await asyncio.wait_for(served.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    messages = [r.getMessage() for r in caplog.records]
    assert len(tries) == 4
    assert messages[0] == "test link: refused; reconnecting in the background"
    assert len(messages) == 2 and messages[1].startswith("test link: back after")  # not once per retry
    assert backoff.peek() == 0.001  # reset once connected
