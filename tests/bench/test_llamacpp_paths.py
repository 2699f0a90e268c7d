"""bench/llamacpp_paths.py: every bench script finds llama.cpp where bench/build_llamacpp.sh
builds it, ``$LLAMACPP_DIR`` or its default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import llamacpp_paths as P

ROOT = Path(__file__).resolve().parents[2]


def test_the_folder_is_llamacpp_dir_or_the_build_scripts_default():
    assert P.llamacpp_dir({}) == Path.home() / ".cache/chatserve/llama.cpp"
    assert P.llamacpp_dir({"LLAMACPP_DIR": ""}) == P.DEFAULT_DIR
    assert P.llamacpp_dir({"LLAMACPP_DIR": "/x/llama-avx2"}) == Path("/x/llama-avx2")
    assert P.llamacpp_dir({"LLAMACPP_DIR": "~/l"}) == Path.home() / "l"
    # the build script's own default, so the two cannot drift apart unnoticed
    assert 'DIR="${LLAMACPP_DIR:-$HOME/.cache/chatserve/llama.cpp}"' in (ROOT / "bench/build_llamacpp.sh").read_text()


def test_programs_and_files_sit_where_the_build_script_writes_them():
    base = Path("/b")
    assert P.binary(base, "llama-bench") == Path("/b/src/vendor/llama.cpp/build/bin/llama-bench")
    assert P.peer_gguf(base, "Q4_0") == Path("/b/models/smollm2-135m-instruct-Q4_0.gguf")


def test_every_bench_script_reads_llamacpp_dir_from_the_environment(tmp_path):
    code = """
import json
from bench import decode_step, llamacpp_suite, prefill, returning_chats
from bench.serving_lib import systems
print(json.dumps([str(p) for p in (
    decode_step.LLAMA_BENCH, *decode_step.PEER_GGUFS, prefill.LLAMA_BENCH, systems.LLAMA_SERVER_DEFAULT,
    systems.PEER_Q4_0, systems.PEER_Q4_1, returning_chats.LLAMA_SERVER_DEFAULT, returning_chats.PEER_Q4_0,
    llamacpp_suite.LLAMA_SRC)]))
"""
    env = {**os.environ, "LLAMACPP_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    paths = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(paths) == 10 and all(p.startswith(str(tmp_path) + "/") for p in paths), paths
