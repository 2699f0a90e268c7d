"""bench/engine_throughput.py runs end to end (tiny model, smoke scale) and reports every key."""

from __future__ import annotations

import asyncio
import random

from bench.engine_throughput import main_async, mixed_requests, parse_args, pct, table


def test_percentiles_interpolate_and_handle_edges():
    assert pct([], 0.5) == 0.0
    assert pct([3.0], 0.99) == 3.0
    assert pct([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert pct(list(range(101)), 0.99) == 99.0


def test_engine_throughput_smoke_run_reports_all_keys(tiny_model_dir):
    a = parse_args(["--model", str(tiny_model_dir), "--smoke", "--num-blocks", "512"])
    r = asyncio.run(main_async(a))
    # ignore_eos: every request produces exactly the tokens it asked for
    asked = mixed_requests(a.mixed_requests, random.Random(0), 49152, a.max_prompt, a.max_out)
    assert r["mixed"]["ours"]["output_tokens"] == sum(n for _, n in asked)
    for key in ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50"):
        assert r["mixed"]["ours"][key] > 0
    assert r["mixed"]["transformers"]["output_tok_s"] > 0
    mt = r["multiturn"]
    assert mt["ttft_turn1_ms"] > 0 and mt["ttft_turn8_ms_cache"] > 0 and mt["ttft_turn8_ms_nocache"] > 0
    assert 0.5 < mt["cache_hit_ratio"] <= 1.0  # turns 2-3 reuse turn 1's prompt and reply
    assert r["kv"]["waste_tokens_per_request_max"] < 16  # under one block per request
    assert "mixed: output tokens/s" in table(r)


def test_decode_step_bench_times_every_format_against_its_floor(tiny_model_dir, capsys):
    """Every format is timed at every batch size; int8 reads about half of bfloat16's bytes
    and a quarter of float32's; the table prints each format's floor and its ratio to it."""
    from bench import decode_step

    assert decode_step.main(["--model", str(tiny_model_dir), "--batches", "1,3", "--steps", "2", "--context", "20",
                             "--formats", "default,exact,int8+bf16,bfloat16", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    r = out["formats"]
    assert set(r) == {"default", "exact", "int8+bf16", "bfloat16"} and out["read_bandwidth_gbs"] > 0
    for fmt in r.values():
        assert set(fmt["step_ms"]) == {"1", "3"} and all(ms > 0 for ms in fmt["step_ms"].values())
        assert fmt["kv_bytes"] > 0
    assert "int4 weights" in r["default"]["format"] and "(exact)" in r["exact"]["format"]
    # held: float32 4 bytes a weight, bfloat16 2, int8 1 plus its bfloat16 copy (3);
    # read at batch 1: int8 1 byte, about half of bfloat16's 2
    assert r["bfloat16"]["weight_bytes"] < r["int8+bf16"]["weight_bytes"] < r["exact"]["weight_bytes"]
    assert r["int8+bf16"]["read_bytes"] < 0.6 * r["bfloat16"]["read_bytes"]
    assert r["bfloat16"]["read_bytes"] < 0.6 * r["exact"]["read_bytes"]
    assert r["default"]["kv_bytes"] == r["exact"]["kv_bytes"] // 2  # bfloat16 KV against float32
    table = decode_step.format_table({k: {**v, "step_ms": {int(b): ms for b, ms in v["step_ms"].items()}}
                                      for k, v in r.items()}, [1, 3], out["read_bandwidth_gbs"])
    assert "| 3 |" in table and "batch-1 floor at" in table and "step / floor" in table


def test_decode_step_bench_compares_attention_with_sdpa_and_profiles_a_step(capsys, tiny_model_dir):
    from bench import decode_step

    assert decode_step.main(["--attention", "--contexts", "64,300", "--batches", "1,2"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and r[2].isdigit()]
    assert len(rows) == 4 and all(r.count("|") == 7 for r in rows)
    assert decode_step.main(["--profile", "--model", str(tiny_model_dir), "--context", "20"]) == 0
    prof = capsys.readouterr().out
    assert "calls per step" in prof and "linear" in prof


def test_prefill_bench_reports_tokens_per_second_per_prompt_size(tiny_model_dir, capsys):
    """bench/prefill.py end to end on ours (tiny model): every size measured, prompt tokens
    as the server counted them, and the table's ratio column against ours."""
    import json

    from bench import prefill

    assert prefill.main(["--systems", "ours", "--prompts", "64,256", "--repeats", "1", "--model",
                         str(tiny_model_dir), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["results"]["ours"]
    assert set(r) == {"64", "256"}
    assert r["256"]["prompt_tokens"] > r["64"]["prompt_tokens"] > 40 and all(x["tok_s"] > 0 for x in r.values())
    fake = {"ours": {64: {"tok_s": 100.0, "ms": 640.0}}, "llama.cpp": {64: {"tok_s": 50.0, "ms": 1280.0}}}
    assert "| 64 | 100 (640 ms) | 50 (1280 ms) | 0.50x |" in prefill.table(fake, [64])


def test_decode_step_agreement_scores_greedy_answers_against_the_exact_format(tiny_model_dir):
    """--quality --agreement: the exact format teacher-forced along its own greedy answers
    picks those same tokens, and the table has a row per format."""
    from bench import decode_step

    ids = [[1, 2, 3, 4], [5, 6]]
    own = decode_step.greedy_tokens(str(tiny_model_dir), decode_step.FORMATS["exact"], ids, 5)
    assert [len(t) for t in own] == [5, 5]
    assert decode_step.greedy_tokens(str(tiny_model_dir), decode_step.FORMATS["exact"], ids, 5, forced=own) == own
    table = decode_step.agreement_table(str(tiny_model_dir), ["int8"], [], 2)
    assert "| int8 |" in table and f"{len(decode_step.AGREEMENT_PROMPTS)} chat prompts" in table


def test_decode_step_ops_table_times_every_op_of_the_fused_layers(tiny_model_dir, capsys):
    """``--ops`` reads the fused layers' per-op counters: one row per op, every column."""
    from bench import decode_step

    assert decode_step.main(["--model", str(tiny_model_dir), "--ops", "--formats", "int4", "--batches", "1,2",
                             "--steps", "2", "--context", "20"]) == 0
    out = capsys.readouterr().out
    for op in decode_step.OP_NAMES:
        row = next(line for line in out.splitlines() if line.startswith(f"| {op} |"))
        assert row.count("|") == 5  # decode at 1, decode at 2, the prefill
    assert "decode, batch 2 (ms)" in out and "prefill of 512 (ms)" in out
