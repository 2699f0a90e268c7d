"""bench/first_replies.py: the script runs (``--quick``: no model) and its loop detector
tells a repetition loop from ordinary prose, lists and code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.first_replies import PROMPTS, Reply, candidates, self_check, tail_repeats
from gateway.config import Defaults

ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_runs_without_a_model_and_lists_the_configurations():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "first_replies.py"), "--quick"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "loop detector ok; 20 prompts" in out
    assert "gateway defaults" in out


def test_the_loop_detector_passes_its_own_crafted_examples():
    self_check()


def test_a_phrase_repeated_without_spaces_or_with_varying_whitespace_is_a_loop():
    assert tail_repeats("Intro text that is fine. " + "abc123=" * 200)
    assert tail_repeats("Start. " + "".join(f"It is a story about the cat.{' ' * (i % 3)}\n" for i in range(60)))


def test_a_long_reply_of_distinct_sentences_is_not_a_loop():
    text = " ".join(f"Sentence number {i} talks about topic {i * 7 % 13} and detail {i * 3}." for i in range(80))
    assert not tail_repeats(text)
    assert not Reply("p", text, 512, "length", 1.0).loops  # cut at max_tokens, but no loop


def test_the_gateway_defaults_are_one_of_the_measured_configurations_and_prompts_are_twenty():
    assert len(PROMPTS) == 20 and len(set(PROMPTS)) == 20
    assert any(c.params == Defaults().sampling() for c in candidates(Defaults()))
