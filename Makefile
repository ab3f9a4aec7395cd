# Every target installs what it needs into .venv first, so on a fresh machine
# `make demo` and `make test` are the only two commands needed.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
PYTEST_ARGS ?=
# Where `make bench` runs Redis and the client: same, split, both (core both ways) or none.
PIN ?= both
# `make bench BASELINE=<git ref>`: every bench also against that ref's code, taking turns (bench/baseline.py).
BASELINE ?=
# The fault-injection soak (tests/soak): seconds of traffic and faults, seed, integrations.
SOAK_DURATION ?= 1200
SOAK_SEED ?= 1
SOAK_INTEGRATIONS ?= celery,rabbitmq,kafka,replay
# `make test-oldest`: the suite again in a second venv on the oldest redis-py pyproject.toml
# admits (the floor of its `redis[hiredis]>=X` line), so a redis-py change we depend on is caught,
# and with DEDUPE_PURE_PYTHON=1, so the fallback that packs commands with hiredis instead of the
# compiled dedupe_worker._resp is tested every run too (`make test` tests the compiled one).
VENV_OLDEST  ?= .venv-oldest
REDIS_FLOOR  := $(shell sed -n 's/.*"redis\[hiredis\]>=\([0-9.]*\)".*/\1/p' pyproject.toml)
STAMP_OLDEST  = $(VENV_OLDEST)/.installed-redis-$(REDIS_FLOOR)
EXTRAS        = celery,rabbitmq,kafka,faststream,dramatiq,http,sql,django,zstd,embedded,testing,metrics,otel,asyncio,test,dev
# `make docs-serve` listens here.
DOCS_ADDR    ?= 127.0.0.1:8000

.PHONY: install test test-oldest lint typecheck bench demo soak docs docs-serve clean

# The editable install compiles dedupe_worker/_resp.c beside it (hatch_build.py): again when it changes.
BUILT_FROM    = pyproject.toml hatch_build.py dedupe_worker/_resp.c

$(STAMP): $(BUILT_FROM)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS),bench,docs]"
	touch $(STAMP)

# kombu[redis]: the tests use Redis as a Celery broker, so kombu (and Celery) must be releases
# whose Redis transport still takes the oldest redis-py (kombu 5.7 wants redis-py 6.1+).
$(STAMP_OLDEST): $(BUILT_FROM)
	test -n "$(REDIS_FLOOR)"
	test -x $(VENV_OLDEST)/bin/python || $(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_OLDEST)/bin/python -m pip install --quiet -e ".[$(EXTRAS)]" "redis[hiredis]==$(REDIS_FLOOR)" "kombu[redis]"
	rm -f $(VENV_OLDEST)/.installed-redis-*
	touch $(STAMP_OLDEST)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-oldest: $(STAMP_OLDEST)
	$(VENV_OLDEST)/bin/python -c "import redis; assert redis.__version__ == '$(REDIS_FLOOR)', redis.__version__"
	DEDUPE_PURE_PYTHON=1 $(VENV_OLDEST)/bin/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check dedupe_worker tests bench hatch_build.py mkdocs_hooks.py

typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy hatch_build.py mkdocs_hooks.py

soak: $(STAMP)
	$(BIN)/python -m tests.soak --duration $(SOAK_DURATION) --seed $(SOAK_SEED) --integrations $(SOAK_INTEGRATIONS)

bench: $(STAMP)
	$(BIN)/python -m bench --pin $(PIN) $(if $(BASELINE),--baseline $(BASELINE))

demo: $(STAMP)
	$(BIN)/dedupe-worker demo

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link, a missing
# page or an API reference that does not resolve fails the build.
# NO_MKDOCS_2_WARNING: Material's banner about its successor, printed on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict --dev-addr $(DOCS_ADDR)

clean:
	rm -rf $(VENV) $(VENV_OLDEST) dist build site .pytest_cache .mypy_cache .ruff_cache
