"""Fixtures for engine tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
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
