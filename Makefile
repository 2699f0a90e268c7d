# Two commands matter: `make run` (serve the chat) and `make test` (the test suite, as CI runs it).
.PHONY: run test bench setup
setup:
	bash scripts/bootstrap.sh
run:
	bash scripts/run.sh $(ARGS)
test:
	bash scripts/test.sh -q
bench:
	.venv/bin/python bench/engine_throughput.py
