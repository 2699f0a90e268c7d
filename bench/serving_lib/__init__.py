"""Helpers of the serving benchmarks (bench/serving.py, bench/gateway_load.py): statistics,
workloads, the OpenAI streaming client, the systems under test, plots and docs output."""
