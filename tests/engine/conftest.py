"""Fixtures for engine tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.server import run_server
from tests.engine_helpers import make_engine


@pytest.fixture
def start_engine() -> Iterator[Callable[..., AsyncEngine]]:
    """``start_engine(model_dir, **overrides)``: an ``AsyncEngine`` built by
    ``make_engine`` (CPU, float32, small pool; ``overrides`` are ``EngineConfig``
    fields) with its step loop running. ``start_engine(engine)`` starts an engine the
    test built and adjusted itself. Every engine started here is shut down at teardown
    (shutting one down earlier in the test is fine)."""
    started: list[AsyncEngine] = []

    def start(model: Path | str | AsyncEngine, **overrides: Any) -> AsyncEngine:
        eng = model if isinstance(model, AsyncEngine) else make_engine(model, **overrides)
        started.append(eng)
        eng.start()
        return eng

    yield start
    for eng in started:
        eng.shutdown()


@pytest.fixture
async def server(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> AsyncIterator[tuple[str, AsyncEngine]]:
    """An engine server on the tiny model on a free port of this event loop: ``(ws url,
    the AsyncEngine)``; stopped at teardown."""
    eng = make_engine(tiny_model_dir, num_blocks=256)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_server(eng, "127.0.0.1", 0, ready=ready, stop=stop))
    await asyncio.wait_for(ready.wait(), 30)
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ENGINE READY")][-1]
    yield line.split()[-1], eng
    stop.set()
    await task
