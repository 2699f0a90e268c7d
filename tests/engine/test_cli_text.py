"""What the command lines print: every ``engine serve``/``generate`` option says what it
does (and its default where it has one), ``generate`` ends its reply with a newline, and
``python -m gateway --help`` reads as plain text."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import build_parser, engine_config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _subparser(name: str) -> argparse.ArgumentParser:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("cmd", ["serve", "generate"])
def test_every_engine_option_has_help_and_valued_ones_name_their_default(cmd):
    p = _subparser(cmd)
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{cmd} {action.option_strings[0]} has no help"
        takes_value = action.nargs != 0 and not isinstance(action, argparse._StoreTrueAction)
        if takes_value and action.default is not None and not action.required:
            assert "default" in action.help, f"{cmd} {action.option_strings[0]} does not show its default"


def test_generate_ends_its_reply_with_a_newline(tiny_model_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(tiny_model_dir), "--prompt",
                        "Hello", "--max-tokens", "3", "--num-blocks", "64", "--log-level", "warning"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and r.stdout.strip()
    assert r.stderr.startswith("[")  # the numbers line starts its own line on stderr


def test_gateway_help_is_plain_text_and_explains_log_level():
    r = subprocess.run([sys.executable, "-m", "gateway", "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0
    assert "``" not in r.stdout and "python -m gateway" in r.stdout
    entry = r.stdout.split("\n  --log-level", 1)[1].split("\n  --", 1)[0]
    assert "log on stderr" in " ".join(entry.split())


def test_an_unseeded_engine_draws_a_new_generator_seed_each_start_unless_one_is_given():
    p = _subparser("serve")
    seeds = {engine_config_from_args(p.parse_args([])).seed for _ in range(4)}
    assert len(seeds) == 4  # unseeded replies differ from one start to the next
    assert engine_config_from_args(p.parse_args(["--engine-seed", "7"])).seed == 7
