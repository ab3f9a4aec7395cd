# Every target installs what it needs into .venv first, so on a fresh machine
# `make demo` and `make test` are the only two commands needed.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
PYTEST_ARGS ?=
# Where `make bench` runs Redis and the client: same, split, both (core both ways) or none.
PIN ?= both
# The fault-injection soak (tests/soak): seconds of traffic and faults, seed, integrations.
SOAK_DURATION ?= 1200
SOAK_SEED ?= 1
SOAK_INTEGRATIONS ?= celery,rabbitmq,kafka,replay

.PHONY: install test lint typecheck bench demo soak clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[celery,rabbitmq,kafka,faststream,dramatiq,http,sql,django,zstd,embedded,testing,metrics,otel,asyncio,test,dev,bench]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check dedupe_worker tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

soak: $(STAMP)
	$(BIN)/python -m tests.soak --duration $(SOAK_DURATION) --seed $(SOAK_SEED) --integrations $(SOAK_INTEGRATIONS)

bench: $(STAMP)
	$(BIN)/python -m bench --pin $(PIN)

demo: $(STAMP)
	$(BIN)/dedupe-worker demo

clean:
	rm -rf $(VENV) dist build .pytest_cache .mypy_cache .ruff_cache
