"""bench/soak.py: the 60-second soak-and-fault run (``--ci``) passes its own checks:
no reply lost or stored twice, every cut reply has its reason, no KV block leaked, no
traceback in any log, while the engine, Redis and the gateway are killed and restarted."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_the_60_second_soak_and_fault_run_loses_nothing(smollm2_dir):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed", pytrace=False)
    r = subprocess.run([sys.executable, "bench/soak.py", "--ci", "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=850)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert '"replies_lost": 0' in r.stdout and '"stored_twice": 0' in r.stdout
