# Two commands do all the set-up on a fresh machine:
#   make run   -> .venv with the package and its lab extra (torch pinned), trains the digits ViT if needed, writes report/
#   make test  -> the same set-up plus the dev dependencies, then the whole test suite
# The library (import blockhess) needs torch, numpy and psutil only: pip install -e . ; the
# command line and the experiments (blockhess_lab) need the lab extra: pip install -e '.[lab]'.
# make docs  -> the same set-up plus the docs extra, runs the gallery's examples (docs/gallery.py), builds the site into site/
# make docs-data re-runs the commands whose JSON docs/ quotes into runs/ and stores it in docs/data/
PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
CONSTRAINTS := constraints.txt

.PHONY: run test install install-dev docs bench docs-data clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[lab]"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-laplace.txt
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[dev]"
	$(PIP) install -q --no-deps -c $(CONSTRAINTS) -r requirements-laplace.txt  # tests/test_laplace.py; why --no-deps: the file
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[docs]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: install
	$(VENV)/bin/blockhess report --out report

TEST_WORKERS ?= 2
test: install-dev
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile  # the files shared out among TEST_WORKERS processes (tests/conftest.py)

docs: $(VENV)/.installed-docs
	$(PY) docs/gallery.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: install
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[bench]"
	$(PIP) install -q --no-deps -c $(CONSTRAINTS) -r requirements-laplace.txt  # curvlinops without torchvision
	$(VENV)/bin/blockhess bench --out bench-results

docs-data: install
	$(PY) docs/data/refresh.py

clean:
	rm -rf $(VENV) report bench-results checkpoints runs site
