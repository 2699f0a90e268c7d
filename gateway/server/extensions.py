"""The OpenAI API and the Prometheus metrics, put together for ``create_app``.

One call wires them in::

    app = create_app_with_extras(config)          # python -m gateway, test fixtures

or, step by step::

    routes, events, middleware = default_extras(config)
    app = create_app(config, extra_routes=routes, events=events)
    for m in middleware:
        app.add_middleware(m.cls, *m.args, **m.kwargs)

The API key is ``api_key`` when given, else ``config.api_key`` (the ``API_KEY``
environment variable of ``GatewayConfig``); None or "" leaves the API open.
"""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.routing import BaseRoute

from gateway.api.openai_api import openai_routes
from gateway.config import GatewayConfig
from gateway.replies.hooks import GenerationEvents
from gateway.server.app import GatewayApp, create_app
from gateway.server.metrics import GatewayMetrics, MetricsEvents, MetricsMiddleware, metrics_routes


def default_extras(config: GatewayConfig, api_key: str | None = None,
                   metrics: GatewayMetrics | None = None
                   ) -> tuple[list[BaseRoute], list[GenerationEvents], list[Middleware]]:
    """The routes (``/v1/chat/completions``, ``/v1/models``, ``/metrics``), event hooks
    and middleware to add to one app. Each call makes a fresh metrics registry unless
    ``metrics`` is given."""
    key = api_key if api_key is not None else config.api_key
    m = metrics if metrics is not None else GatewayMetrics()
    routes: list[BaseRoute] = [*openai_routes(key), *metrics_routes(m)]
    return routes, [MetricsEvents(m)], [Middleware(MetricsMiddleware, metrics=m)]


def create_app_with_extras(config: GatewayConfig, api_key: str | None = None,
                           metrics: GatewayMetrics | None = None) -> GatewayApp:
    """``create_app`` with ``default_extras`` wired in (see module doc)."""
    routes, events, middleware = default_extras(config, api_key, metrics)
    app = create_app(config, extra_routes=routes, events=events)
    for mw in middleware:
        app.add_middleware(mw.cls, *mw.args, **mw.kwargs)
    return app
