"""compose.yaml / compose.cpu.yaml / Dockerfile: the deployment promises, checked on the
files (Docker itself does not run here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's ``!reset`` / ``!override`` merge tags."""


ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")
ComposeLoader.add_constructor("!override", lambda loader, node: "!override")


def load(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)


def test_compose_runs_redis_engine_and_gateway_with_only_the_gateway_published():
    services = load("compose.yaml")["services"]
    assert set(services) == {"redis", "engine", "gateway"}
    assert [n for n, s in services.items() if s.get("ports")] == ["gateway"]
    redis, engine, gateway = services["redis"], services["engine"], services["gateway"]
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    assert any(v.endswith(":/data") for v in redis["volumes"]) and "healthcheck" in redis
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert any(":/models" in v for v in engine["volumes"]) and "healthcheck" in engine
    assert "--port 9000" in " ".join(engine["command"]) and "0.0.0.0" in " ".join(engine["command"])
    assert gateway["depends_on"] == {"redis": {"condition": "service_healthy"},
                                     "engine": {"condition": "service_healthy"}}
    cmd = " ".join(gateway["command"])
    assert "ws://engine:9000" in cmd and "redis://redis:6379" in cmd and "healthcheck" in gateway


def test_cpu_variant_drops_the_gpu_reservation_and_takes_cpu_torch():
    engine = load("compose.cpu.yaml")["services"]["engine"]
    assert engine["deploy"] == "!reset"
    assert "whl/cpu" in engine["build"]["args"]["TORCH_INDEX_URL"]


def test_dockerfile_builds_both_targets_and_they_match_compose():
    text = (ROOT / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\w+)", text, flags=re.M))
    assert {"engine", "gateway"} <= targets
    services = load("compose.yaml")["services"]
    assert services["engine"]["build"]["target"] == "engine"
    assert services["gateway"]["build"]["target"] == "gateway"
    assert "ARG TORCH_INDEX_URL" in text and "HF_HUB_OFFLINE=1" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".data" in ignored and ".git" in ignored
