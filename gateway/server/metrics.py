"""Prometheus metrics of one gateway (``GET /metrics``), in its own ``CollectorRegistry``
(never the process-global one: several gateways may share a process, as in tests).

Three feeds (metric names in docs/protocol.md section 4):

* ``MetricsMiddleware`` (pure ASGI): HTTP requests by route template, method and status.
* ``MetricsEvents`` (a ``GenerationEvents``): per reply, TTFT / TPOT / end-to-end
  histograms from the engine's ``timings``, prompt / cached / completion token counters
  from its ``usage``, replies by finish reason, failures by code.
* ``StateCollector``: read at scrape time. Each scrape first asks every connected engine
  for a ``stats`` frame (in parallel, ``stats_timeout_s`` each; the engine answers at
  once from the snapshot it took at the end of its last step, and concurrent scrapes
  share one round trip), then reports KV blocks, running / waiting requests,
  preemptions and token totals labelled ``engine=<url>``, the age of that snapshot,
  plus the gateway's open WebSockets (``GatewayState.ws_stats``). ``engine_up`` is the
  link's state (open and greeted), not whether the last stats answer came in time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from engine.protocol import Timings
from gateway.api.socket import WsStats
from gateway.api.state import GatewayState, gateway_state
from gateway.errors import GatewayError
from gateway.replies.hooks import GenerationEvents
from gateway.replies.reply_end import ReplyEnd
from gateway.server.disconnects import ClientDisconnects
from gateway.server.http_limits import ConnectionStats

# seconds; TTFT spans a cached short prompt (ms) to a long CPU prefill (tens of s)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})

# engine stats key -> (metric name, help); gauges then counters ("_total" is added on output)
ENGINE_GAUGES = {
    "num_blocks": ("engine_kv_blocks_total", "KV blocks in the engine's pool."),
    "blocks_used": ("engine_kv_blocks_used", "KV blocks not free (held by requests or cached)."),
    "blocks_free": ("engine_kv_blocks_free", "KV blocks free."),
    "blocks_cached": ("engine_kv_blocks_cached", "KV blocks in the prefix cache."),
    "blocks_evictable": ("engine_kv_blocks_evictable", "Cached KV blocks no request uses (evictable)."),
    "blocks_held_by_requests": ("engine_kv_blocks_held_by_requests", "KV blocks held by running requests."),
    "running": ("engine_requests_running", "Requests being generated."),
    "waiting": ("engine_requests_waiting", "Requests queued for admission."),
    "restoring": ("engine_requests_restoring", "Requests waiting for KV pages from the disk tier."),
    "kv_disk_pages": ("engine_kv_disk_pages", "KV pages the disk tier holds."),
    "kv_disk_bytes": ("engine_kv_disk_bytes", "Bytes of KV pages the disk tier holds."),
    "kv_host_pages": ("engine_kv_host_pages", "KV pages the host-memory tier holds."),
    "kv_host_bytes": ("engine_kv_host_bytes", "Bytes of KV pages the host-memory tier holds."),
}
ENGINE_COUNTERS = {
    "preemptions_total": ("engine_preemptions", "Requests preempted (blocks freed, recomputed later)."),
    "requests_total": ("engine_requests", "Requests the engine admitted."),
    "aborted_total": ("engine_requests_aborted", "Requests aborted (client gone or Stop)."),
    "prompt_tokens_total": ("engine_prompt_tokens", "Prompt tokens of finished requests."),
    "cached_tokens_total": ("engine_cached_tokens", "Prompt tokens served from the prefix cache."),
    "cached_disk_tokens_total": ("engine_cached_disk_tokens", "Of those, tokens restored from the disk KV tier."),
    "kv_disk_pages_written_total": ("engine_kv_disk_pages_written", "KV pages written to the disk tier."),
    "kv_disk_bytes_written_total": ("engine_kv_disk_bytes_written", "Bytes of KV pages written to the disk tier."),
    "kv_disk_pages_read_total": ("engine_kv_disk_pages_read", "KV pages read back from the disk tier and checked."),
    "kv_disk_bytes_read_total": ("engine_kv_disk_bytes_read", "Bytes of KV pages read back from the disk tier."),
    "kv_disk_hits_total": ("engine_kv_disk_hits", "Restores that brought pages back from the disk tier."),
    "kv_disk_misses_total": ("engine_kv_disk_misses", "Prompts past the pool's match the disk tier held nothing of."),
    "kv_disk_pages_dropped_total": ("engine_kv_disk_pages_dropped", "KV pages not written (queue full, tier off)."),
    "kv_disk_pages_corrupt_total": ("engine_kv_disk_pages_corrupt", "KV pages refused on read and recomputed."),
    "kv_disk_restore_ms_total": ("engine_kv_disk_restore_ms", "Milliseconds spent restoring pages from the disk tier."),
    "cached_host_tokens_total": ("engine_cached_host_tokens", "Of those, tokens restored from the host KV tier."),
    "kv_host_pages_written_total": ("engine_kv_host_pages_written", "KV pages copied into the host-memory tier."),
    "kv_host_pages_read_total": ("engine_kv_host_pages_read", "KV pages copied back from the host-memory tier."),
    "kv_host_hits_total": ("engine_kv_host_hits", "Restores that brought pages back from the host-memory tier."),
    "kv_host_misses_total": ("engine_kv_host_misses", "Prompts past the pool's match the tiers held nothing of."),
    "kv_host_pages_dropped_total": ("engine_kv_host_pages_dropped", "KV pages the host-memory tier had no slot for."),
    "kv_host_pages_evicted_total": ("engine_kv_host_pages_evicted", "KV pages the host-memory tier evicted."),
    "completion_tokens_total": ("engine_completion_tokens", "Completion tokens generated."),
    "steps_total": ("engine_steps", "Scheduler steps run."),
    "spec_drafted_total": ("engine_spec_draft_tokens", "Speculative draft tokens verified."),
    "spec_accepted_total": ("engine_spec_accepted_tokens", "Speculative draft tokens accepted (kept)."),
    "spec_steps_total": ("engine_spec_steps", "Request-steps that verified speculative drafts."),
    "invariant_failures_total": ("engine_invariant_failures", "Internal consistency checks that failed (a bug)."),
}


@dataclass
class EngineSnapshot:
    """One engine as last seen: its URL, whether its link is up, its model, its latest
    ``stats`` and that snapshot's age (seconds; None when it never answered)."""

    url: str
    up: bool
    model: str = ""
    stats: dict[str, Any] | None = None
    stats_age_s: float | None = None


class StateCollector(Collector):
    """Engine and socket gauges from the last ``refresh`` (a collector's ``collect`` is
    synchronous, so the ``/metrics`` handler refreshes just before rendering)."""

    def __init__(self) -> None:
        self.engines: list[EngineSnapshot] = []
        # zero counters until the first refresh takes the running gateway's
        self.ws_stats = WsStats()
        self.disconnects = ClientDisconnects()
        self.connections = ConnectionStats()
        self.in_progress: set[str] = set()

    async def refresh(self, state: GatewayState, timeout_s: float) -> None:
        """Ask every connected engine of ``state.router`` for ``stats`` (``timeout_s``
        seconds each, in parallel) and take ``state.ws_stats``."""
        clients = list(state.router.clients)

        async def one(c: Any) -> EngineSnapshot:
            model = c.info.model if c.info is not None else ""
            if not c.healthy:
                return EngineSnapshot(c.url, False, model)
            try:
                await c.stats(timeout=timeout_s)
            except (GatewayError, asyncio.TimeoutError):
                pass  # the link is what engine_up reports; the stats age shows a late answer
            age = None if c.stats_taken_at is None else max(0.0, time.monotonic() - c.stats_taken_at)
            return EngineSnapshot(c.url, c.healthy, model, c.last_stats, age)

        self.engines = list(await asyncio.gather(*(one(c) for c in clients)))
        self.ws_stats = state.ws_stats
        self.disconnects = state.disconnects
        self.connections = state.connections

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("engine_up", "1 while the link to the engine is open and its hello arrived.",
                               labels=["engine"])
        age = GaugeMetricFamily("engine_stats_age_seconds", "Age of the engine's latest stats snapshot (taken "
                                "at the end of an engine step).", labels=["engine"])
        info = GaugeMetricFamily("engine_info", "The model each engine serves (value 1).", labels=["engine", "model"])
        gauges = {k: GaugeMetricFamily(n, h, labels=["engine"]) for k, (n, h) in ENGINE_GAUGES.items()}
        counters = {k: CounterMetricFamily(n, h, labels=["engine"]) for k, (n, h) in ENGINE_COUNTERS.items()}
        for e in self.engines:
            up.add_metric([e.url], 1.0 if e.up else 0.0)
            if e.stats_age_s is not None:
                age.add_metric([e.url], e.stats_age_s)
            if e.model:
                info.add_metric([e.url, e.model], 1.0)
            families: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [*gauges.items(),
                                                                                   *counters.items()]
            for key, fam in families:
                if e.stats is not None and isinstance(e.stats.get(key), (int, float)):
                    fam.add_metric([e.url], float(e.stats[key]))
        yield up
        yield age
        yield info
        yield from gauges.values()
        yield from counters.values()
        yield GaugeMetricFamily("gateway_replies_in_progress", "Replies being generated by this gateway.",
                                value=len(self.in_progress))
        ws = self.ws_stats
        yield GaugeMetricFamily("gateway_websockets_open", "Browser WebSockets open now.",
                                value=ws.sockets_open)
        for attr, name, doc in (
                ("frames_sent_total", "gateway_websocket_frames_sent", "Frames sent to browser sockets."),
                ("stalled_closed_total", "gateway_websockets_stalled_closed", "Sockets closed as stalled readers."),
                ("bad_frames_total", "gateway_websocket_bad_frames", "Malformed frames received."),
                ("frames_too_large_total", "gateway_websocket_frames_too_large", "Frames refused as too large.")):
            extra = self.connections.ws_frames_too_large_total if attr == "frames_too_large_total" else 0
            yield CounterMetricFamily(name, doc, value=getattr(ws, attr) + extra)
        gone = CounterMetricFamily("gateway_client_disconnects", "HTTP requests whose client left before the "
                                   "answer was complete (not errors), by route and stage (body, body_timeout, "
                                   "response).", labels=["route", "stage"])
        for (route, stage), n in sorted(self.disconnects.counts.items()):
            gone.add_metric([route, stage], n)
        yield gone
        conns = self.connections
        refused = CounterMetricFamily("gateway_connections_refused", "Connections refused at once by the caps "
                                      "(per_address: 429, total: 503).", labels=["reason"])
        for reason, n in sorted(conns.refused_total.items()):
            refused.add_metric([reason], n)
        yield refused
        yield CounterMetricFamily("gateway_http_body_timeouts", "Requests whose body did not arrive in time (408).",
                                  value=conns.body_timeouts_total)
        yield CounterMetricFamily("gateway_websockets_stalled_aborted", "WebSocket connections aborted because the "
                                  "client stopped reading (writes paused too long).",
                                  value=conns.ws_stalled_aborted_total)
        yield GaugeMetricFamily("gateway_websocket_max_outbox_bytes",
                                "Most bytes ever queued for one socket (bounded by the outbox).",
                                value=ws.max_outbox_bytes)


class GatewayMetrics:
    """Every metric of one gateway, registered in ``registry`` (a new one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.http_requests = Counter("gateway_http_requests", "HTTP requests by route template, method and status.",
                                     ["route", "method", "status"], registry=r)
        self.ttft = Histogram("gateway_ttft_seconds", "Time to first token of each reply (engine arrival to "
                              "first token).", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("gateway_tpot_seconds", "Mean time per output token after the first, per reply.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("gateway_e2e_seconds", "Engine arrival to last token, per reply.",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("gateway_prompt_tokens", "Prompt tokens of finished replies.", registry=r)
        self.cached_tokens = Counter("gateway_cached_tokens", "Prompt tokens served from the prefix cache.",
                                     registry=r)
        self.completion_tokens = Counter("gateway_completion_tokens", "Completion tokens of finished replies.",
                                         registry=r)
        self.replies = Counter("gateway_replies", "Finished replies by finish reason.", ["finish_reason"],
                               registry=r)
        self.reply_errors = Counter("gateway_reply_errors", "Failed replies by error code.", ["code"], registry=r)
        self.state = StateCollector()
        r.register(self.state)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


class MetricsEvents(GenerationEvents):
    """Feeds ``GatewayMetrics`` from every reply (browser and API)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.m = metrics

    def on_start(self, request_id: str, session_id: str, t: float) -> None:
        self.m.state.in_progress.add(request_id)

    def on_finish(self, request_id: str, end: ReplyEnd, t: float) -> None:
        self.m.state.in_progress.discard(request_id)
        self.m.replies.labels(end.finish_reason).inc()
        completion = end.completion_tokens
        self.m.prompt_tokens.inc(end.prompt_tokens)
        self.m.cached_tokens.inc(end.cached_tokens)
        self.m.completion_tokens.inc(completion)
        t_ = end.timings if end.timings is not None else Timings()  # none from the engine: zeros
        if completion > 0 and t_.ttft_ms > 0:  # an abort before any token has no TTFT
            self.m.ttft.observe(t_.ttft_ms / 1000)
            self.m.e2e.observe(t_.e2e_ms / 1000)
        if completion > 1:  # TPOT needs a second token
            self.m.tpot.observe(t_.tpot_ms / 1000)

    def on_error(self, request_id: str, code: str, t: float) -> None:
        self.m.state.in_progress.discard(request_id)
        self.m.reply_errors.labels(code).inc()


class MetricsMiddleware:
    """Pure ASGI middleware counting HTTP requests by route template (``/api/sessions/{sid:str}``,
    never the raw path, so ids do not explode the label set), method and status.

    Wire it with ``app.add_middleware(MetricsMiddleware, metrics=metrics)`` before the
    app starts. A request that raises counts as 500; one whose client left before an
    answer counts with the status the app chose (499 for the OpenAI API).
    """

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"  # set by Starlette's router
            method = scope.get("method", "")
            self.metrics.http_requests.labels(route, method if method in METHODS else "other", str(status)).inc()


def metrics_routes(metrics: GatewayMetrics, stats_timeout_s: float = 1.0) -> list[Route]:
    """``GET /metrics`` (Prometheus text format), refreshing engine stats first."""

    async def scrape(request: Request) -> Response:
        await metrics.state.refresh(gateway_state(request), stats_timeout_s)
        return Response(metrics.render(), headers={"content-type": CONTENT_TYPE_LATEST})

    return [Route("/metrics", scrape, methods=["GET"])]
