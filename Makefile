# Set-up is idempotent: the virtual environment is created once and the
# project reinstalled only when pyproject.toml changes.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(TORCH_VERSION)

.PHONY: setup demo topologies-demo test docs docs-serve results-tables results verify stale hooks clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev,docs]" "torch==$(TORCH_VERSION)"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

# The main job: ECD-PSGD at 8 bits on a ring of 4 ranks (torchrun, gloo), MNIST-1D.
# --overwrite: each `make demo` replaces the previous demo's run directory (its run files
# only); other runs are never overwritten without it.
demo: setup
	$(VENV)/bin/torchrun --nproc_per_node 4 -m gossip.train --algo ecd --bits 8 --topology ring --out runs/demo-ecd8-ring4 --overwrite

topologies-demo: setup
	$(PY) -m topologies ring 8
	$(PY) -m topologies torus 16
	$(PY) -m topologies expander 64 --degree 4 --seed 0

# The default suite on every core (pytest-xdist: one worker per core, at most
# TEST_WORKERS_MAX; each test file stays on one worker, so a file's fixtures are made
# once); TEST_WORKERS=0 runs it in this process, one test after another. The 25
# slowest tests are listed at the end, to keep the suite within its time budget.
TEST_WORKERS ?= auto
TEST_WORKERS_MAX ?= 4
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses $(TEST_WORKERS_MAX) --dist loadfile --durations 25

# The documentation site (MkDocs Material, API reference by mkdocstrings) into site/,
# strict: a broken link or reference fails the build. docs-serve rebuilds on every edit.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --strict --dev-addr 127.0.0.1:8000

# Re-render the README's and docs' results tables from experiments/results/*.json
# (between <!-- results:NAME --> markers) and the benchmark's report pages.
results-tables: setup
	$(PY) -m experiments render

# Freshness (docs/provenance.md): `make stale` lists the results not certified at HEAD;
# `make verify` re-runs the training results' witnesses (minutes) and certifies what
# still computes the same; `make results` re-runs what is left stale, CPU first, within
# BUDGET minutes (resumable: run it again for the rest), each timing result after the
# 1-minute load fell below 0.3 (waiting at most LOAD_WAIT minutes, default 10).
stale: setup
	$(PY) -m experiments stale

verify: setup
	$(PY) -m experiments verify

BUDGET ?=
LOAD_WAIT ?=
results: setup
	$(PY) -m experiments results $(if $(BUDGET),--budget $(BUDGET),) $(if $(LOAD_WAIT),--load-wait $(LOAD_WAIT),)

# The pre-commit hook that re-renders the tables a commit's results files change.
hooks:
	git config core.hooksPath .githooks
	@echo "hooks: .githooks/pre-commit re-renders the tables on every commit that touches results or docs"

clean:
	rm -rf $(VENV) build site *.egg-info
