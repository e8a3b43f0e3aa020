# One command to start (make run), one to test (make test). `make help` lists the rest.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install run demo test test-slow chaos lint format up migrate clean bench n8n-e2e

help: ## List the targets with what they do
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install: $(STAMP) ## Create .venv and install the project with its test tools
	@[ -x /usr/bin/chromium ] || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq chromium) ; } || true

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: install ## Run everything (receiver, relay, worker; embedded servers if no URLs are set)
	$(VENV)/bin/idem dev

demo: install ## Tell the story: a lost CRM answer, a redelivery, still one task
	$(VENV)/bin/idem demo

test: install ## Run the test suite (real PostgreSQL, Redis and Celery workers; slow soaks excluded)
	$(PY) -m pytest

test-slow: install ## Run the slow soaks only
	$(PY) -m pytest -m slow

n8n-e2e: install ## The n8n examples in a real n8n 2.8.4 (installs it into .n8n/ unless N8N_BIN is set)
	$(PY) -m tests.n8n_e2e

chaos: install ## Chaos soak: kills, restarts, lost answers; checks every event (5 min)
	$(PY) -m tests.chaos.soak

bench: install ## Measure throughput, latency and memory on this machine (~20 min; docs/performance.md)
	$(PY) -m bench.run

lint: install ## ruff and mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: install ## Apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

up: ## Run the production stack with Docker Compose (needs FLOWER_PASSWORD)
	docker compose up --build

migrate: install ## Apply database migrations to DATABASE_URL
	$(VENV)/bin/idem migrate

clean: ## Remove the venv and local data (.idem/)
	rm -rf $(VENV) .idem
