"""compose.yaml / compose.cpu.yaml / Dockerfile: the deployment promises, checked on the
files (Docker itself does not run here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


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


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_each_image_installs_its_extra_and_the_gateways_has_no_torch():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert not project["dependencies"], "every dependency belongs to the engine's or the gateway's extra"
    assert "torch" in _names(extras["engine"])
    # transformers (with tokenizers) reads the engines' tokenizer for prefix routing; never torch
    assert not _names(extras["gateway"]) & {"torch", "safetensors", "gguf", "triton"}
    text = (ROOT / "Dockerfile").read_text()
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", text, flags=re.M | re.S))
    assert 'pip install -e ".[engine]"' in stages["engine"]
    assert 'pip install -e ".[gateway]"' in stages["gateway"]
    for name in _names(extras["engine"]) | _names(extras["gateway"]):  # no second list to keep in step
        assert f'"{name}' not in text, f"the Dockerfile lists {name} again instead of using the extra"


def test_the_gateway_imports_and_builds_its_app_without_torch():
    # What the gateway's image lacks is made unimportable; every gateway module is imported
    # and the app is built, so a stray `import torch` (or transformers...) anywhere fails here.
    code = (
        "import sys, importlib, pkgutil\n"
        "for m in ('torch', 'transformers', 'tokenizers', 'safetensors', 'gguf', 'triton', 'numpy'):\n"
        "    sys.modules[m] = None\n"
        "import gateway\n"
        "for m in pkgutil.iter_modules(gateway.__path__):\n"
        "    importlib.import_module('gateway.' + m.name)\n"
        "from gateway.config import GatewayConfig\n"
        "from gateway.server.extensions import create_app_with_extras\n"
        "create_app_with_extras(GatewayConfig())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


class _Tag:
    """A value under Compose's ``!reset`` or ``!override`` tag."""

    def __init__(self, kind: str, value: object) -> None:
        self.kind, self.value = kind, value


class TaggedLoader(yaml.SafeLoader):
    """YAML keeping what ``!reset`` / ``!override`` apply to (for merging files)."""


def _tagged(kind: str):
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> _Tag:
        if isinstance(node, yaml.MappingNode):
            return _Tag(kind, loader.construct_mapping(node, deep=True))
        if isinstance(node, yaml.SequenceNode):
            return _Tag(kind, loader.construct_sequence(node, deep=True))
        return _Tag(kind, loader.construct_scalar(node))
    return construct


TaggedLoader.add_constructor("!reset", _tagged("reset"))
TaggedLoader.add_constructor("!override", _tagged("override"))


def _merge(base: object, over: object) -> object:
    """Compose's merge of two files, as far as these files use it: mappings merge key by
    key, ``!reset`` empties, ``!override`` and any other value replace."""
    if isinstance(over, _Tag):
        return None if over.kind == "reset" else over.value
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base.get(k), v)
        return {k: v for k, v in out.items() if v is not None}
    return over


def compose_services(*files: str) -> dict:
    """The services of ``docker compose -f a -f b ...`` (``extends`` from a file resolved)."""
    services: dict = {}
    for name in files:
        for svc, spec in yaml.load((ROOT / name).read_text(), Loader=TaggedLoader)["services"].items():
            ext = spec.pop("extends", None)
            if ext is not None:
                parent = yaml.load((ROOT / ext["file"]).read_text(), Loader=TaggedLoader)["services"][ext["service"]]
                spec = _merge(parent, spec)
            services[svc] = _merge(services.get(svc), spec)
    return services


def _env(service: dict) -> dict:
    env = service.get("environment", {})
    return env if isinstance(env, dict) else dict(e.split("=", 1) for e in env)


@pytest.mark.parametrize("files", [
    ("compose.yaml", "compose.scale.yaml"),
    ("compose.yaml", "compose.cpu.yaml", "compose.scale.yaml", "compose.scale.cpu.yaml"),
])
def test_scale_override_runs_two_engines_and_two_gateways_on_one_redis_behind_one_port(files):
    services = compose_services(*files)
    assert set(services) == {"redis", "engine", "engine-2", "gateway", "gateway-2", "lb"}
    assert [n for n, s in services.items() if s.get("ports")] == ["lb"]
    assert services["lb"]["ports"] == ["${GATEWAY_PORT:-8000}:8000"]
    for name in ("engine", "engine-2"):
        e = services[name]
        assert e["build"]["target"] == "engine" and "healthcheck" in e
        assert "--port 9000" in " ".join(e["command"]) and "0.0.0.0" in " ".join(e["command"])
    for name in ("gateway", "gateway-2"):
        g = services[name]
        assert g["build"]["target"] == "gateway" and "healthcheck" in g
        cmd = " ".join(g["command"])
        assert "--engine" not in cmd  # it would override ENGINE_URLS
        assert "redis://redis:6379/0" in cmd  # one Redis for both
        assert _env(g)["ENGINE_URLS"].split() == ["ws://engine:9000", "ws://engine-2:9000"]  # one order
        assert "gateway-data:/data" in g["volumes"]  # one cookie secret
        assert {"redis", "engine", "engine-2"} <= set(g["depends_on"])
    assert services["gateway-2"]["depends_on"]["gateway"] == {"condition": "service_healthy"}
    assert set(services["lb"]["depends_on"]) == {"gateway", "gateway-2"}
    mount = services["lb"]["volumes"][0].split(":")
    conf = (ROOT / mount[0]).read_text()
    assert mount[1] == "/etc/nginx/conf.d/default.conf"
    assert "server gateway:8000" in conf and "server gateway-2:8000" in conf and "listen 8000" in conf
    assert "proxy_set_header Upgrade $http_upgrade" in conf and "proxy_buffering off" in conf
    if "compose.cpu.yaml" in files:
        assert "deploy" not in services["engine"] and "deploy" not in services["engine-2"]
        for name in ("engine", "engine-2"):
            assert "whl/cpu" in services[name]["build"]["args"]["TORCH_INDEX_URL"]
    else:
        gpus = [services[n]["deploy"]["resources"]["reservations"]["devices"] for n in ("engine", "engine-2")]
        assert [d[0]["device_ids"] for d in gpus] == [["${ENGINE1_GPU:-0}"], ["${ENGINE2_GPU:-1}"]]
