"""Shared pytest set-up. Fixtures live in the modules named below, one concern each."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["tests.fixtures_models", "tests.fixtures_redis", "tests.fixtures_servers"]
