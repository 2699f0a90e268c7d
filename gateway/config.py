"""Typed settings of the gateway, from defaults, environment variables and the command line.

Every option has an environment variable (named in ``ENV_VARS``); the command line
(``gateway/__main__.py``) overrides the environment, which overrides the defaults.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from engine.errors import ConfigError as ConfigError  # re-exported: one error for every bad setting
from engine.sampling_params import param_error
from gateway.reasoning import ThinkMarkers

MIB = 1 << 20

PROJECT_ROOT = Path(__file__).resolve().parent.parent


# Host names a local gateway answers to by default (its own bound address is added).
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


# JSON longer than this (characters of a frame, bytes of a request body) is encoded or decoded
# in a worker thread, so one huge frame does not hold up every other socket on the event loop.
BIG_FRAME_CHARS = 256 * 1024


POLICIES = ("cache_aware", "sticky", "hash", "round_robin", "random")


@dataclass(frozen=True)
class RoutingPolicy:
    """Which rule routes, and its weights (``gateway/engines/routing.py`` applies it).

    Attributes:
        policy: one of ``POLICIES``: ``cache_aware`` (the default), ``sticky`` (home
            unless overloaded), ``hash`` (rendezvous hashing of the chat id alone),
            ``round_robin`` or ``random`` (baselines for the routing benchmark).
        load_tokens: in ``cache_aware``, what one request of load (running or waiting)
            weighs against prompt tokens still to compute (tokens). 0 ignores load (the
            longest match wins, a new chat goes to its rendezvous home); with 16 a
            chat's turn leaves an engine holding 160 more of its tokens only when that
            engine carries 10 more requests (the shed test usually acts first). Chosen
            with bench/routing_sim.py (64 engines, 10,000 users, loads 0.6-1.2: 16 and 64
            within a point of each other, both ahead of hashing) and bench/routing.py
            (two 1-thread CPU engines: 64 moved a busy user's later turns off their
            history, hit ratio 0.42 against 0.65 at 16; docs/benchmarks.md).
        max_index_pages: the most KV page hashes the gateway's prefix index keeps.
        tokenizer: a folder with the engines' tokenizer and chat template, read by the
            gateway to compute prompt ids for ``cache_aware`` (``gateway/engines/prompt_ids.py``);
            None uses the folder the engines name in their hello when it is readable
            here, else prompts are matched only by the chat's stored ids.
        abs_threshold: requests (running + waiting) the chosen engine must carry beyond
            the least-loaded engine before a request sheds. SGLang's router defaults are
            sized for GPUs that batch hundreds of requests; 8 and 2.0 were chosen with
            bench/routing_sim.py on CPU engines (4 and 1.5 shed so eagerly at 90% load
            that moved chats re-read their histories and TTFT p99 doubled).
        rel_threshold: and the home's load must exceed ``rel_threshold`` times the
            least-loaded engine's.
        max_stats_age_s: a stats snapshot older than this (seconds) is not trusted.
        stats_interval_s: how often the gateway asks each engine for its stats while
            it has more than one (seconds; 0 turns the refresh off).
        local_prefill_tokens: with prefill and decode engines (docs/scaling.md), a turn
            whose decode engine holds all but at most this many of its prompt tokens is
            prefilled there instead of on a prefill engine (tokens; a short next message
            of a chat costs less to compute than to move).
    """

    abs_threshold: int = 8
    rel_threshold: float = 2.0
    max_stats_age_s: float = 10.0
    stats_interval_s: float = 1.0
    policy: str = "cache_aware"
    load_tokens: float = 16.0
    max_index_pages: int = 2_000_000
    tokenizer: str | None = None
    local_prefill_tokens: int = 32

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.load_tokens < 0:
            raise ValueError(f"routing load_tokens must be >= 0, got {self.load_tokens}")
        if self.max_index_pages < 1:
            raise ValueError(f"max_index_pages must be >= 1, got {self.max_index_pages}")


# limits that may be None (no cap, or a derived default)
OPTIONAL_LIMITS = frozenset({"ws_socket_sndbuf_bytes", "http_max_connections_per_address", "http_max_connections"})


@dataclass(frozen=True)
class Limits:
    """Documented limits (docs/protocol.md). Sizes in bytes, times in seconds.

    Attributes:
        max_frame_bytes: largest browser frame (and ``/v1`` body); a bigger frame is
            refused by the WebSocket layer as soon as its header gives its length, before
            its payload is read: a ``frame_too_large`` error frame, then close 1009 with a
            reason (``gateway/server/ws_protocol.py``).
        max_http_body_bytes: largest ``/api`` request body (HTTP 413 above).
        max_sessions_per_user: chats one user may keep (``too_many_sessions``).
        max_generations_per_user: replies one user may have in progress at once.
        max_messages_per_minute: ``chat``/``regenerate`` frames per user per clock minute.
        max_title_chars, max_system_prompt_chars: text field caps (characters).
        ws_send_timeout_s: a socket whose outbound frame cannot be written for this
            long is closed as stalled (its generations go on and are stored).
        ws_max_pending_frames: frames queued for one socket at most; producers wait
            when it is full (so a slow reader slows only its own tail of Redis).
        ws_max_inflight: frames of one socket processed concurrently at most.
        ws_max_subscriptions: replies one socket may watch at once.
        ws_socket_sndbuf_bytes: kernel send buffer of each accepted connection
            (``SO_SNDBUF`` on the listening socket); None keeps the kernel's autotuning
            (which can reach several MiB per connection).
        http_max_header_bytes: largest request head (request line and headers); a
            bigger one gets HTTP 431 and the connection is closed (gateway/server/http_limits.py).
        http_max_headers: most header fields in one request (431 above).
        http_header_timeout_s: a request whose head is not complete this long after the
            connection opened (or after its first byte) gets HTTP 408 and is closed.
        ws_max_sockets_per_user: browser sockets one user may hold open at once.
        ws_max_sockets_per_address: browser sockets one client address may hold open.
        http_body_timeout_s: a request body not complete this long after its head gets
            ``408 Request Timeout`` and the connection is closed (gateway/server/http_limits.py).
        http_max_connections_per_address: HTTP connections (not yet upgraded to a
            WebSocket) one client address may hold open; the next gets ``429`` at once and
            is closed (256, as ``ws_max_sockets_per_address``: a burst of socket handshakes
            from one address is HTTP until it upgrades). None: no cap (behind a proxy, which
            shows one address for all).
        http_max_connections: connections of every kind the server holds at once; the next
            gets ``503`` at once and is closed. None: three quarters of the process's open
            file limit (``ulimit -n``), so sockets never run out before the cap answers.
    """

    max_frame_bytes: int = 4 * MIB
    max_http_body_bytes: int = 1 * MIB
    max_sessions_per_user: int = 500
    max_generations_per_user: int = 4
    max_messages_per_minute: int = 60
    max_title_chars: int = 200
    max_system_prompt_chars: int = 32_000
    ws_send_timeout_s: float = 30.0
    ws_max_pending_frames: int = 64
    ws_max_inflight: int = 4
    ws_max_subscriptions: int = 16
    ws_socket_sndbuf_bytes: int | None = 256 * 1024
    http_max_header_bytes: int = 64 * 1024
    http_max_headers: int = 100
    http_header_timeout_s: float = 10.0
    ws_max_sockets_per_user: int = 32
    ws_max_sockets_per_address: int = 256
    http_body_timeout_s: float = 30.0
    http_max_connections_per_address: int | None = 256
    http_max_connections: int | None = None

    def __post_init__(self) -> None:
        if self.max_frame_bytes < 1024:
            raise ConfigError("max_frame_bytes must be >= 1024")
        for f in fields(self):
            v = getattr(self, f.name)
            if (v is None and f.name not in OPTIONAL_LIMITS) or (v is not None and v <= 0):
                raise ConfigError(f"{f.name} must be > 0, got {v!r}")
        if self.ws_socket_sndbuf_bytes is not None and self.ws_socket_sndbuf_bytes < 4096:
            raise ConfigError("ws_socket_sndbuf_bytes must be >= 4096 or None")

    def public(self) -> dict[str, Any]:
        """The limits a client may need to know (sent by ``GET /api/config``)."""
        return {
            "max_frame_bytes": self.max_frame_bytes,
            "max_sessions_per_user": self.max_sessions_per_user,
            "max_generations_per_user": self.max_generations_per_user,
            "max_messages_per_minute": self.max_messages_per_minute,
            "max_title_chars": self.max_title_chars,
            "max_system_prompt_chars": self.max_system_prompt_chars,
        }


@dataclass(frozen=True)
class Defaults:
    """Per-chat defaults shown to the UI and used when a chat stores none (the one place
    they are set); checked against the engine's ranges (``engine.sampling_params.RANGES``)
    on construction.

    ``frequency_penalty`` 0.4 keeps small models out of repetition loops: on 20 typical
    first questions x 3 seeds, SmolLM2-135M looped until max_tokens in 9 of 60 replies with
    no penalty, 1 with 0.3 and none with 0.4 (bench/first_replies.py; docs/benchmarks.md,
    "First replies").

    Raises:
        ConfigError: a default is out of range.
    """

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 512
    frequency_penalty: float = 0.4
    system_prompt: str = "You are a helpful assistant."

    def __post_init__(self) -> None:
        for name, value in self.sampling().items():
            message = param_error(name, value)  # the engine's ranges and error text
            if message is not None:
                raise ConfigError(f"default {message}")

    def sampling(self) -> dict[str, Any]:
        """The default sampling parameters as an engine ``params`` dict."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                "frequency_penalty": self.frequency_penalty}

    def stateless_sampling(self) -> dict[str, Any]:
        """What a stateless API request (OpenAI, Anthropic, Responses, completions) gets for
        the fields it leaves out: ``max_tokens``, ``temperature`` and ``top_p``, not the
        chats' ``frequency_penalty`` (a penalty would push JSON and tool calls off their
        repeated keys). OpenAI's own defaults (temperature 1, top_p 1) make a small local
        model ramble (the README's first question got 5 garbled answers of 5 with
        SmolLM2-135M); llama-server and vLLM also apply server-side defaults."""
        return {k: v for k, v in self.sampling().items() if k != "frequency_penalty"}


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of one gateway process.

    Attributes:
        host, port: where uvicorn listens.
        redis_url: the Redis holding chats and reply streams.
        redis_max_connections: connections of the gateway's Redis pool (blocking stream
            reads have a pool of their own). A caller that finds them all busy waits.
        redis_pool_timeout_s: how long such a caller waits for a connection (seconds)
            before the store counts as unavailable: latency and bursts queue, and only
            a real outage answers ``store_unavailable``.
        engine_urls: the engines: our engines' internal WebSocket URLs (``ws://host:port``)
            and OpenAI-compatible servers (``http(s)://host:port/v1``: vLLM, SGLang,
            llama-server, another gateway; ``gateway/engines/upstream.py``); empty means "start a
            local engine" (done by ``python -m gateway``, not by the app factory).
        model: model path for that local engine (None: the bundled SmolLM2).
        engine_args: more ``python -m engine serve`` options for that local engine
            (e.g. ``("--dtype", "bfloat16", "--quantization", "int8")``).
        allowed_origins: extra origins allowed on the WebSocket handshake besides the
            page's own.
        allowed_hosts: host names the gateway answers to (the ``Host`` header, port
            ignored; ``*.example.com`` patterns; ``*`` allows any, which re-opens DNS
            rebinding); empty means ``LOCAL_HOSTS`` plus ``host`` when it is a specific
            address. Any other ``Host`` gets HTTP 400 (``trusted_hosts``).
        secret_key: signs the user cookie; None means read (or create) ``data_dir/secret_key``.
        api_key: when set, ``/v1`` requests must send ``Authorization: Bearer <key>``.
        cors_origins: origins whose browser pages may call ``/v1`` (CORS, preflight
            included; ``*`` allows any); empty (the default) sends no CORS headers.
        model_aliases: more names a ``/v1`` request may give for the model while only one
            model is served (for clients with a fixed model name, e.g. ``gpt-4o``); ``*``
            takes any name, as llama-server does. Empty (the default): a name no engine
            serves is 404 ``model_not_found``, as OpenAI answers (``default`` and an
            omitted name always mean any engine).
        api_seed: the sampling seed of every stateless API request (``/v1`` chat, completions,
            Messages, Responses, ``/completion``) that names none, as llama-server's and
            vLLM's ``--seed``: such requests are then reproducible (the same request gets the
            same reply). None (the default): an unseeded request draws its own randomness.
        engine_secret: when set, sent to every engine on connect (``X-Engine-Secret``);
            an engine started with the same ``ENGINE_SECRET`` refuses connections without it.
            Never sent to an OpenAI-compatible upstream.
        upstream_api_key: sent to every OpenAI-compatible upstream of ``engine_urls`` as
            ``Authorization: Bearer`` (a url may not carry it: urls show in ``/metrics``).
        upstream_max_model_len: the context (tokens) shown for an upstream that reports
            none (vLLM, SGLang and llama-server do); 0 means unknown.
        data_dir: the project's data folder (secret key, private Redis data).
        key_prefix: prefix of every Redis key (tests use a unique one each).
        session_ttl_s: TTL of every key of a chat, refreshed on each write; None = keep forever.
        stream_ttl_s: how long a reply's Redis Stream is kept after its last write.
        stream_maxlen: approximate cap on entries of one reply stream (a safety bound:
            one entry per engine frame, so it is above any reply's token count).
        lock_lease_ms: lease of a chat's generation lock (refreshed while generating).
        cancel_grace_s: after an abort, how long to wait for the engine's final frame.
        store_retry_s: while Redis is unreachable, how long a reply task keeps its reply
            in memory and retries storing it (and a socket keeps waiting for it).
        web_dir, static_dir: templates and static assets of the UI.
        ws_per_message_deflate: compress browser frames (off: deltas are tiny).
        defaults: per-chat defaults.
        limits: documented limits.
        routing: which engine serves a request (``gateway/engines/routing.py``; env
            ``ROUTING_POLICY``, ``ROUTING_LOAD_TOKENS``, ``ROUTING_TOKENIZER``,
            ``ROUTING_LOCAL_PREFILL_TOKENS``).
        shared_prompts: message texts declared shared across users' cache namespaces
            besides ``defaults.system_prompt`` (``gateway/engines/cache_scope.py``; env
            ``SHARED_PROMPTS_FILE``: a JSON array of strings).
        reasoning_markers: the opening and closing markers of a reply's reasoning, two
            words (``gateway/reasoning.py``; env ``REASONING_MARKERS``).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_max_connections: int = 256
    redis_pool_timeout_s: float = 20.0
    engine_urls: tuple[str, ...] = ()
    model: str | None = None
    engine_args: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    secret_key: str | None = None
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    model_aliases: tuple[str, ...] = ()
    api_seed: int | None = None
    engine_secret: str | None = None
    upstream_api_key: str | None = None
    upstream_max_model_len: int = 0
    data_dir: Path = field(default_factory=lambda: PROJECT_ROOT / ".data")
    key_prefix: str = ""
    session_ttl_s: int | None = None
    stream_ttl_s: int = 900
    stream_maxlen: int = 100_000
    lock_lease_ms: int = 30_000
    cancel_grace_s: float = 5.0
    store_retry_s: float = 300.0
    web_dir: Path = field(default_factory=lambda: PROJECT_ROOT / "web")
    static_dir: Path = field(default_factory=lambda: PROJECT_ROOT / "static")
    ws_per_message_deflate: bool = False
    defaults: Defaults = field(default_factory=Defaults)
    limits: Limits = field(default_factory=Limits)
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    shared_prompts: tuple[str, ...] = ()
    reasoning_markers: str = "<think> </think>"

    def __post_init__(self) -> None:
        if not (0 <= self.port < 65536):
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.session_ttl_s is not None and self.session_ttl_s <= 0:
            raise ConfigError("session_ttl_s must be > 0 or None")
        if self.stream_ttl_s <= 0 or self.lock_lease_ms < 1000 or self.stream_maxlen < 1000:
            raise ConfigError("stream_ttl_s > 0, lock_lease_ms >= 1000 and stream_maxlen >= 1000 required")
        if self.store_retry_s <= 0:
            raise ConfigError("store_retry_s must be > 0")
        if self.redis_max_connections < 1 or self.redis_pool_timeout_s <= 0:
            raise ConfigError("redis_max_connections >= 1 and redis_pool_timeout_s > 0 required")
        if self.upstream_max_model_len < 0:
            raise ConfigError("upstream_max_model_len must be >= 0")
        for u in self.engine_urls:
            scheme, sep, rest = u.partition("://")
            if not sep or scheme.lower() not in ("ws", "wss", "http", "https") or not rest:
                raise ConfigError(f"an engine url must be ws(s)://host:port (our engine) or "
                                  f"http(s)://host:port/v1 (an OpenAI-compatible server), got {u!r}")
            if "@" in rest.split("/", 1)[0]:
                raise ConfigError("an engine url may not carry credentials (urls show in /metrics); "
                                  "set UPSTREAM_API_KEY for an upstream's API key")
        for h in self.allowed_hosts:
            if h != "*" and ("*" in h[1:] or (h.startswith("*") and not h.startswith("*.")) or "/" in h):
                raise ConfigError(f"allowed host must be a name, *.domain or *, got {h!r}")
        for o in self.allowed_origins:
            if not o.startswith(("http://", "https://")) or o.endswith("/"):
                raise ConfigError(f"allowed origin must look like http(s)://host[:port], got {o!r}")
        if not all(isinstance(t, str) for t in self.shared_prompts):
            raise ConfigError("shared_prompts must be strings")
        try:
            ThinkMarkers.parse(self.reasoning_markers)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def think_markers(self) -> ThinkMarkers:
        """``reasoning_markers`` parsed."""
        return ThinkMarkers.parse(self.reasoning_markers)

    def trusted_hosts(self) -> list[str]:
        """The host names allowed in ``Host`` (see ``allowed_hosts``)."""
        if self.allowed_hosts:
            return [h.lower() for h in self.allowed_hosts]
        hosts = list(LOCAL_HOSTS)
        own = f"[{self.host}]" if ":" in self.host else self.host.lower()
        if self.host not in WILDCARD_HOSTS and own not in hosts:
            hosts.append(own)
        return hosts

    def with_overrides(self, **changes: Any) -> GatewayConfig:
        """A copy with some fields replaced; ``limits`` and ``routing`` may be given as dicts of changes."""
        rt = changes.pop("routing", None)
        if isinstance(rt, Mapping):
            changes["routing"] = replace(self.routing, **rt)
        elif rt is not None:
            changes["routing"] = rt
        lim = changes.pop("limits", None)
        if isinstance(lim, Mapping):
            changes["limits"] = replace(self.limits, **lim)
        elif lim is not None:
            changes["limits"] = lim
        return replace(self, **changes)

    def resolve_secret(self) -> str:
        """The cookie-signing secret: ``secret_key``, or the one persisted under
        ``data_dir/secret_key`` (created with mode 0600 on first use).

        Raises:
            OSError: the data folder cannot be written.
        """
        if self.secret_key:
            return self.secret_key
        path = Path(self.data_dir) / "secret_key"
        if path.exists():
            return path.read_text().strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        return key


# option name -> environment variable
ENV_VARS: dict[str, str] = {
    "host": "HOST",
    "port": "PORT",
    "redis_url": "REDIS_URL",
    "engine_urls": "ENGINE_URLS",
    "model": "MODEL",
    "engine_args": "ENGINE_ARGS",
    "allowed_origins": "ALLOWED_ORIGINS",
    "allowed_hosts": "ALLOWED_HOSTS",
    "engine_secret": "ENGINE_SECRET",
    "upstream_api_key": "UPSTREAM_API_KEY",
    "upstream_max_model_len": "UPSTREAM_MAX_MODEL_LEN",
    "secret_key": "SECRET_KEY",
    "api_key": "API_KEY",
    "cors_origins": "CORS_ORIGINS",
    "model_aliases": "MODEL_ALIASES",
    "api_seed": "API_SEED",
    "data_dir": "DATA_DIR",
    "key_prefix": "KEY_PREFIX",
    "session_ttl_s": "SESSION_TTL_S",
    "stream_ttl_s": "STREAM_TTL_S",
    "shared_prompts": "SHARED_PROMPTS_FILE",
    "reasoning_markers": "REASONING_MARKERS",
}
LIMIT_ENV_PREFIX = "LIMIT_"  # e.g. LIMIT_MAX_FRAME_BYTES=2097152
ROUTING_ENV = {"policy": "ROUTING_POLICY", "load_tokens": "ROUTING_LOAD_TOKENS", "tokenizer": "ROUTING_TOKENIZER",
               "local_prefill_tokens": "ROUTING_LOCAL_PREFILL_TOKENS"}


def read_shared_prompts(path: Path) -> tuple[str, ...]:
    """The prompts declared shared across users' caches: a JSON array of strings in ``path``.

    Raises:
        ValueError: the file cannot be read or is not such an array (``config_from_env``
            reports it as a ``ConfigError`` naming the variable).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a JSON array of strings from {path}: {e}") from None
    if not isinstance(data, list) or not all(isinstance(t, str) for t in data):
        raise ValueError(f"{path} must hold a JSON array of strings")
    return tuple(data)


def _split(value: str) -> tuple[str, ...]:
    return tuple(p for p in value.replace(",", " ").split() if p)


def config_from_env(env: Mapping[str, str] | None = None, base: GatewayConfig | None = None) -> GatewayConfig:
    """Build a config from environment variables (``ENV_VARS``; limits as
    ``LIMIT_<FIELD>``, e.g. ``LIMIT_MAX_FRAME_BYTES``). Unset variables keep ``base``'s values.

    Raises:
        ConfigError: a variable does not parse or is out of range.
    """
    env = os.environ if env is None else env
    cfg = base or GatewayConfig()
    changes: dict[str, Any] = {}
    var = ""
    try:
        for name, var in ENV_VARS.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            if name in ("port", "stream_ttl_s", "upstream_max_model_len", "api_seed"):
                changes[name] = int(raw)
            elif name == "session_ttl_s":
                changes[name] = int(raw) if int(raw) > 0 else None
            elif name in ("engine_urls", "allowed_origins", "allowed_hosts", "cors_origins", "model_aliases"):
                changes[name] = _split(raw)
            elif name == "engine_args":
                changes[name] = tuple(shlex.split(raw))  # ValueError (bad quotes) -> ConfigError below
            elif name == "data_dir":
                changes[name] = Path(raw)
            elif name == "shared_prompts":
                changes[name] = read_shared_prompts(Path(raw))
            else:
                changes[name] = raw
        limits: dict[str, Any] = {}
        for f in fields(Limits):
            var = LIMIT_ENV_PREFIX + f.name.upper()
            raw = env.get(var)
            if raw and f.name in OPTIONAL_LIMITS and raw.strip().lower() == "none":
                limits[f.name] = None
            elif raw:
                limits[f.name] = float(raw) if f.name.endswith("_s") else int(raw)
        routing: dict[str, Any] = {}
        for name, var in ROUTING_ENV.items():
            raw = env.get(var)
            if raw:
                routing[name] = (float(raw) if name == "load_tokens" else int(raw) if name == "local_prefill_tokens"
                                 else raw.strip())
                replace(cfg.routing, **{name: routing[name]})  # checks it (ValueError) while var names it
        if routing:
            changes["routing"] = routing
    except ValueError as e:
        raise ConfigError(f"bad environment variable {var}: {e}") from None
    if limits:
        changes["limits"] = limits
    return cfg.with_overrides(**changes)
