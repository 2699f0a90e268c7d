# Two commands matter: `make run` (serve the chat) and `make test` (the test suite, as CI runs it).
.PHONY: run test test-fast check bench setup
setup:
	bash scripts/bootstrap.sh
run:
	bash scripts/run.sh $(ARGS)
test:
	bash scripts/test.sh -q
# The unit tests that need no model (no weights, engine, gateway or browser): seconds.
# TESTS_WITHOUT_MODEL makes a test that reaches a model anyway fail (tests/fixtures_models.py).
test-fast:
	TESTS_WITHOUT_MODEL=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -m "not model and not browser and not triton" $(ARGS)
# The lint and type gate (ruff, then mypy; configured in pyproject.toml). scripts/test.sh
# runs it beside the tests, so CI enforces it.
check:
	bash scripts/check.sh
bench:
	.venv/bin/python bench/engine_throughput.py
