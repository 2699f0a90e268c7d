"""Shared pytest set-up. Fixtures live in the modules named below, one concern each.

Tests live by area (``tests/engine``, ``tests/gateway``, ``tests/web``, ``tests/bench``);
the fixture and helper modules here are shared by all of them.

Every test that needs a model (it uses a model folder, an engine or a gateway, whose
default engine runs the tiny model) is marked ``model`` here, from its fixtures, and every
test that drives Chromium (it uses the ``browser`` fixture of tests/web/conftest.py) is
marked ``browser``, so ``make test-fast`` (``-m "not model and not browser and not triton"``)
selects the unit tests that need no model without anyone having to remember a marker.
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# engines started as processes keep no disk KV tier unless a test gives them one: pages
# left by one test (or an earlier run) would turn another's cold prompt into a hit
os.environ.setdefault("KV_DISK", "off")

pytest_plugins = ["tests.fixtures_models", "tests.fixtures_redis", "tests.fixtures_servers"]

# Fixtures that load a model, or start a process that does (gateway_factory and
# api_gateway start or reach the tiny-model engine).
MODEL_FIXTURES = frozenset({"smollm2_dir", "tiny_model_dir", "tiny_qwen2_dir", "tiny_bytes_model_dir",
                            "tiny_engine", "engine_url", "engine_gate", "spare_engine", "chunked_engine",
                            "chunked_gate", "smollm2_engine_url", "gateway_factory", "api_gateway"})
# Fixtures that start a headless Chromium.
BROWSER_FIXTURES = frozenset({"browser"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test whose fixtures include a model fixture with ``model``, and one whose
    fixtures include a browser fixture with ``browser``."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if MODEL_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.model)
        if BROWSER_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.browser)
