"""Browser frame validation, the user cookie, the Origin check and config parsing."""

from __future__ import annotations

import pytest

from gateway.api.auth import COOKIE_NAME, UserIds, cookie_value, origin_allowed
from gateway.api.socket_frames import (
    CancelFrame,
    ChatFrame,
    PingFrame,
    ProtocolError,
    RegenerateFrame,
    ResumeFrame,
    decode_json,
    parse_client_frame,
)
from gateway.config import ConfigError, GatewayConfig, Limits, config_from_env


def test_valid_frames_parse_into_their_dataclasses():
    assert parse_client_frame({"type": "ping"}) == PingFrame()
    chat = parse_client_frame({"type": "chat", "content": "hi", "session_id": "s1", "params": {"temperature": 0},
                               "client_msg_id": "abc:1", "extra": "ignored"})
    assert chat == ChatFrame(content="hi", session_id="s1", params={"temperature": 0}, client_msg_id="abc:1")
    assert parse_client_frame({"type": "chat", "content": "x"}).session_id is None
    assert parse_client_frame({"type": "cancel", "request_id": "r1"}) == CancelFrame("r1")
    assert parse_client_frame({"type": "regenerate", "session_id": "s"}) == RegenerateFrame("s", {})
    assert parse_client_frame({"type": "resume", "request_id": "r", "last_seq": 7}) == ResumeFrame("r", 7)
    assert parse_client_frame({"type": "resume", "request_id": "r"}).last_seq == 0


@pytest.mark.parametrize("frame", [
    [], "chat", 3, None,
    {}, {"type": 1}, {"type": "nope"}, {"type": "CHAT", "content": "x"},
    {"type": "chat"}, {"type": "chat", "content": ""}, {"type": "chat", "content": "   "},
    {"type": "chat", "content": 5}, {"type": "chat", "content": "x", "params": [1]},
    {"type": "chat", "content": "x", "session_id": "../../etc"}, {"type": "chat", "content": "x", "session_id": 4},
    {"type": "chat", "content": "x", "client_msg_id": "has space"},
    {"type": "cancel"}, {"type": "cancel", "request_id": ""}, {"type": "cancel", "request_id": "a" * 65},
    {"type": "regenerate"}, {"type": "resume", "request_id": "r", "last_seq": -1},
    {"type": "resume", "request_id": "r", "last_seq": "3"}, {"type": "resume", "request_id": "r", "last_seq": True},
])
def test_malformed_frames_are_bad_frame_errors(frame):
    with pytest.raises(ProtocolError) as e:
        parse_client_frame(frame)
    assert e.value.code == "bad_frame" and e.value.message


def test_bad_frame_errors_echo_well_formed_ids_only():
    with pytest.raises(ProtocolError) as e:
        parse_client_frame({"type": "resume", "request_id": "r9", "last_seq": -2})
    assert e.value.request_id == "r9"
    with pytest.raises(ProtocolError) as e:
        parse_client_frame({"type": "chat", "session_id": "bad id!", "content": ""})
    assert e.value.session_id is None


@pytest.mark.parametrize("text", ["", "{", "nul\x00l", "[1,", "{" * 100_000 + "}" * 100_000])
def test_non_json_is_a_bad_frame(text):
    with pytest.raises(ProtocolError):
        decode_json(text)


def test_user_cookie_round_trips_and_rejects_forgery():
    ids = UserIds("secret-1")
    uid = ids.new_id()
    signed = ids.sign(uid)
    assert ids.verify(signed) == uid
    assert UserIds("secret-2").verify(signed) is None
    assert ids.verify(signed[:-2] + "xx") is None
    assert ids.verify(ids.sign("not-hex")) is None
    assert ids.verify(None) is None and ids.verify("") is None


def scope(origin: str | None, host: str = "chat.example:8000", cookie: str | None = None) -> dict:
    headers = [(b"host", host.encode())]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    if cookie is not None:
        headers.append((b"cookie", cookie.encode()))
    return {"type": "websocket", "headers": headers}


def test_origin_must_be_the_pages_own_or_configured():
    assert origin_allowed(scope("http://chat.example:8000"), ())
    assert origin_allowed(scope("https://chat.example:8000"), ())
    assert not origin_allowed(scope("http://evil.example"), ())
    assert not origin_allowed(scope("http://chat.example:8001"), ())
    assert not origin_allowed(scope("null"), ())
    assert not origin_allowed(scope(None), ())
    assert origin_allowed(scope("http://app.example"), ("http://app.example",))


def test_cookie_header_parsing_tolerates_junk():
    assert cookie_value(scope(None, cookie=f"a=1; {COOKIE_NAME}=v.sig; b=2")) == "v.sig"
    assert cookie_value(scope(None, cookie="garbage;;==")) is None
    assert cookie_value(scope(None)) is None


def test_config_reads_environment_variables_and_validates(tmp_path):
    cfg = config_from_env({"PORT": "9001", "ENGINE_URLS": "ws://a:1, ws://b:2", "SESSION_TTL_S": "60",
                           "ALLOWED_ORIGINS": "https://x.example", "LIMIT_MAX_FRAME_BYTES": "2048",
                           "LIMIT_WS_SEND_TIMEOUT_S": "1.5", "KEY_PREFIX": "p:",
                           "ENGINE_ARGS": "--dtype bfloat16 --quantization 'int8'"})
    assert cfg.port == 9001 and cfg.engine_urls == ("ws://a:1", "ws://b:2") and cfg.session_ttl_s == 60
    assert cfg.allowed_origins == ("https://x.example",) and cfg.key_prefix == "p:"
    assert cfg.engine_args == ("--dtype", "bfloat16", "--quantization", "int8")
    assert cfg.limits.max_frame_bytes == 2048 and cfg.limits.ws_send_timeout_s == 1.5
    assert config_from_env({}).port == GatewayConfig().port
    with pytest.raises(ConfigError, match="PORT"):
        config_from_env({"PORT": "eighty"})
    with pytest.raises(ConfigError, match="ENGINE_ARGS"):
        config_from_env({"ENGINE_ARGS": "--dtype 'bf"})
    with pytest.raises(ConfigError):
        Limits(max_frame_bytes=512)
    with pytest.raises(ConfigError):
        Limits(http_max_connections_per_address=0)
    assert config_from_env({"LIMIT_HTTP_MAX_CONNECTIONS_PER_ADDRESS": "none"}).limits.http_max_connections_per_address \
        is None
    with pytest.raises(ConfigError, match="LIMIT_WS_MAX_INFLIGHT"):
        config_from_env({"LIMIT_WS_MAX_INFLIGHT": "none"})
    shared = tmp_path / "shared.json"
    shared.write_text('["Read the museum guide.", "You are a helpful assistant."]')
    assert config_from_env({"SHARED_PROMPTS_FILE": str(shared)}).shared_prompts == (
        "Read the museum guide.", "You are a helpful assistant.")
    shared.write_text('{"not": "a list"}')
    with pytest.raises(ConfigError, match="SHARED_PROMPTS_FILE"):
        config_from_env({"SHARED_PROMPTS_FILE": str(shared)})
    with pytest.raises(ConfigError):
        GatewayConfig(allowed_origins=("x.example",))


def test_secret_is_created_once_and_kept(tmp_path):
    cfg = GatewayConfig(data_dir=tmp_path)
    first = cfg.resolve_secret()
    assert first and cfg.resolve_secret() == first
    assert (tmp_path / "secret_key").stat().st_mode & 0o077 == 0
    assert GatewayConfig(secret_key="given", data_dir=tmp_path).resolve_secret() == "given"


def test_engine_args_take_a_single_option_and_refuse_bad_quotes():
    from gateway.__main__ import parse_args

    cfg, _ = parse_args(["--engine-args", "--no-prefix-cache"], GatewayConfig())
    assert cfg.engine_args == ("--no-prefix-cache",)
    cfg, _ = parse_args(["--engine-args", "--dtype bfloat16 --quantization int8", "--port", "8123"], GatewayConfig())
    assert cfg.engine_args == ("--dtype", "bfloat16", "--quantization", "int8") and cfg.port == 8123
    with pytest.raises(ConfigError, match="--engine-args"):
        parse_args(["--engine-args", "--dtype 'bf"], GatewayConfig())
