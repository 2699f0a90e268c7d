"""Server fixtures: real engines as subprocesses, and real gateways in a thread.

* ``tiny_engine`` (session): ``python -m engine serve`` on the tiny random model
  (``--num-blocks 512 --block-size 16``), HF_HUB_OFFLINE=1, as a ``LocalEngine``;
  ``engine_url`` (session) is its ``ws://`` URL.
* ``engine_gate`` (function): an ``EngineGate`` (tests/engine_gate.py) in front of
  ``tiny_engine``: point a gateway at ``engine_gate.url`` to pause and resume the engine
  mid-reply. The engine is resumed when the test ends.
* ``spare_engine`` (function): a second engine process on the tiny model, this test's
  own (it may kill or pause it), stopped at teardown.
* ``chunked_gate`` (function): an ``EngineGate`` in front of ``chunked_engine`` (session),
  the tiny model served with a step budget of ``CHUNK_TOKENS`` tokens
  (``--max-num-batched-tokens``) and a 2,048-token context, so a prompt of a few hundred
  tokens is read in several chunked-prefill steps (prompt progress).
* ``smollm2_engine_url`` (session): the same on the bundled SmolLM2 (no ``--model``).
* ``gateway_factory`` (function): ``gateway_factory(engine_urls=None, **overrides)``
  starts the real gateway app (as ``python -m gateway`` builds it: with the OpenAI API
  and metrics) under uvicorn on a free port (a background thread with
  its own event loop), on the test's Redis key prefix, and returns a
  ``RunningGateway`` once an engine is connected (``wait_for_engine=False`` skips
  that); ``engine_urls`` defaults to ``[engine_url]``; ``api_key`` protects the
  OpenAI API; ``overrides`` are ``GatewayConfig`` fields (``limits`` as a dict of
  changes). All are stopped at teardown.
* ``api_gateway`` (function): the same factory, named for the OpenAI API tests.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from websockets.asyncio.client import connect

from gateway.api.auth import COOKIE_NAME
from gateway.api.state import GatewayState
from gateway.config import GatewayConfig
from gateway.server.app import new_secret
from gateway.server.extensions import create_app_with_extras
from gateway.server.local import LocalEngine
from gateway.server.serving import ThreadedServer
from tests.engine_gate import EngineGate

ENGINE_ARGS = ["--num-blocks", "512", "--block-size", "16"]
CHUNK_TOKENS = 64  # chunked_engine's step budget (tokens)
CHUNKED_MAX_MODEL_LEN = 2048  # chunked_engine's context (tokens)
C = TypeVar("C")


@contextlib.contextmanager
def _running_engine(model: Path | None, extra: list[str]) -> Iterator[LocalEngine]:
    engine = LocalEngine(model=str(model) if model else None, extra_args=extra, env={"HF_HUB_OFFLINE": "1"})
    engine.start(timeout_s=600)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Iterator[LocalEngine]:
    """A real engine process on the tiny random Llama (512 blocks of 16 tokens)."""
    with _running_engine(tiny_model_dir, ENGINE_ARGS + ["--threads", "1"]) as engine:
        yield engine


@pytest.fixture(scope="session")
def engine_url(tiny_engine: LocalEngine) -> str:
    """The ``ws://`` URL of ``tiny_engine``."""
    assert tiny_engine.url is not None
    return tiny_engine.url


def gate_in_front_of(engine: LocalEngine) -> EngineGate:
    """A started ``EngineGate`` relaying to ``engine`` (whichever process it runs now);
    ``close()`` it when done."""
    assert engine.url is not None
    gate = EngineGate(engine.url, lambda: engine.process.pid if engine.process is not None else None)
    gate.start()
    return gate


@contextlib.contextmanager
def _gate(engine: LocalEngine) -> Iterator[EngineGate]:
    gate = gate_in_front_of(engine)
    try:
        yield gate
    finally:
        gate.close()  # resumes the engine first: later tests share it


@pytest.fixture
def engine_gate(tiny_engine: LocalEngine) -> Iterator[EngineGate]:
    """An ``EngineGate`` in front of the shared tiny engine (see the module doc)."""
    with _gate(tiny_engine) as gate:
        yield gate


@pytest.fixture
def spare_engine(tiny_model_dir: Path) -> Iterator[LocalEngine]:
    """A second tiny-model engine process, owned by one test (see the module doc)."""
    with _running_engine(tiny_model_dir, ENGINE_ARGS + ["--threads", "1"]) as engine:
        yield engine


@pytest.fixture(scope="session")
def thinker_engine(tiny_thinker_dir: Path) -> Iterator[LocalEngine]:
    """A real engine process on ``tiny_thinker_dir``: a second model, whose replies are
    reasoning (its template opens it)."""
    with _running_engine(tiny_thinker_dir, ENGINE_ARGS + ["--threads", "1"]) as engine:
        yield engine


@pytest.fixture
def thinker_gate(thinker_engine: LocalEngine) -> Iterator[EngineGate]:
    """An ``EngineGate`` in front of ``thinker_engine``."""
    with _gate(thinker_engine) as gate:
        yield gate


@pytest.fixture(scope="session")
def chunked_engine(tiny_model_dir: Path) -> Iterator[LocalEngine]:
    """The tiny model with a small step budget: long prompts take several steps."""
    args = ENGINE_ARGS + ["--threads", "1", "--max-num-batched-tokens", str(CHUNK_TOKENS),
                          "--max-model-len", str(CHUNKED_MAX_MODEL_LEN)]
    with _running_engine(tiny_model_dir, args) as engine:
        yield engine


@pytest.fixture
def chunked_gate(chunked_engine: LocalEngine) -> Iterator[EngineGate]:
    """An ``EngineGate`` in front of ``chunked_engine``."""
    with _gate(chunked_engine) as gate:
        yield gate


@pytest.fixture(scope="session")
def smollm2_engine_url() -> Iterator[str]:
    """A real engine on the bundled SmolLM2-135M-Instruct."""
    with _running_engine(None, ENGINE_ARGS + ["--threads", "2"]) as engine:
        assert engine.url is not None
        yield engine.url


@dataclass
class RunningGateway:
    """A gateway serving on ``base_url`` (HTTP) and ``ws_url`` (WebSocket).

    ``state`` holds its running parts (a ``GatewayState``: ``store``, ``streams``,
    ``router``, ``generations``, ``ws_stats``, ...); ``run(coro)`` runs a coroutine on the
    gateway's own event loop.
    """

    config: GatewayConfig
    server: ThreadedServer
    base_url: str
    ws_url: str
    clients: list[Any] = field(default_factory=list)  # closed by stop(): see close_on_stop

    def close_on_stop(self, client: C) -> C:
        """``client`` (anything with ``close()``: an SDK client made for this gateway),
        closed when the gateway stops. An SDK client left to the garbage collector may
        have its pooled socket collected before the client closes it: an unclosed-socket
        ResourceWarning in whichever later test the collector runs."""
        self.clients.append(client)
        return client

    @property
    def app(self) -> Any:
        """The Starlette app."""
        return self.server.app

    @property
    def state(self) -> GatewayState:
        """The gateway's running parts (its lifespan state)."""
        return self.server.gateway

    @property
    def origin(self) -> str:
        """The Origin a page served by this gateway sends."""
        return self.base_url

    def new_cookie(self) -> str:
        """A fresh anonymous user: the signed cookie value set by ``GET /api/config``."""
        r = httpx.get(f"{self.base_url}/api/config", timeout=10)
        r.raise_for_status()
        return r.cookies[COOKIE_NAME]

    def cookie_header(self, cookie: str) -> dict[str, str]:
        """The ``Cookie`` header for a user cookie value."""
        return {"Cookie": f"{COOKIE_NAME}={cookie}"}

    def connect(self, cookie: str | None, origin: str | None = "", **kwargs: Any) -> Any:
        """``websockets`` connect to ``/ws`` as that user; ``origin=""`` sends the
        gateway's own origin, None sends none."""
        headers = self.cookie_header(cookie) if cookie else {}
        kwargs.setdefault("max_size", None)
        kwargs.setdefault("open_timeout", 10)
        return connect(self.ws_url, origin=(self.origin if origin == "" else origin),
                       additional_headers=headers, **kwargs)

    def http(self, cookie: str | None) -> httpx.AsyncClient:
        """An async HTTP client for the API as that user."""
        return httpx.AsyncClient(base_url=self.base_url, cookies={COOKIE_NAME: cookie} if cookie else None,
                                 timeout=30)

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run ``coro`` on the gateway's loop (for reading its Redis-backed state)."""
        return self.server.run_coro(coro, timeout)

    def stop(self) -> None:
        """Close the clients made for it, then shut the gateway down (its replies are
        stopped and stored)."""
        while self.clients:
            self.clients.pop().close()
        self.server.stop()


@pytest.fixture
def gateway_factory(request: pytest.FixtureRequest, redis_url: str, key_prefix: str,
                    tmp_path: Path) -> Iterator[Callable[..., RunningGateway]]:
    """Start real gateways for this test (see module doc); stopped at teardown."""
    running: list[RunningGateway] = []

    def make(engine_urls: list[str] | None = None, wait_for_engine: bool = True, api_key: str | None = None,
             **overrides: Any) -> RunningGateway:
        """Start one gateway (see the module doc)."""
        urls = engine_urls if engine_urls is not None else [request.getfixturevalue("engine_url")]
        fields: dict[str, Any] = dict(host="127.0.0.1", port=0, redis_url=redis_url, key_prefix=key_prefix,
                                      engine_urls=tuple(urls), secret_key=new_secret(), data_dir=tmp_path / "data")
        if api_key is not None:
            fields["api_key"] = api_key  # the config carries it too (operator-only views check it)
        fields.update(overrides)
        config = GatewayConfig().with_overrides(**fields)
        server = ThreadedServer(create_app_with_extras(config, api_key=api_key), config)
        port = server.start()
        gw = RunningGateway(config, server, f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/ws")
        running.append(gw)
        deadline = time.monotonic() + 60
        while wait_for_engine and urls and not gw.state.router.healthy and time.monotonic() < deadline:
            time.sleep(0.05)  # wait for the engine connection so a first chat is not refused
        return gw

    yield make
    for gw in running:
        gw.stop()


@pytest.fixture
def api_gateway(gateway_factory: Callable[..., RunningGateway]) -> Callable[..., RunningGateway]:
    """``api_gateway(api_key=None, engine_urls=None, wait_for_engine=True, **config)``:
    ``gateway_factory`` under the name the OpenAI API tests use."""
    return gateway_factory
