# Two commands for a fresh machine (see README.md):
#   make demo   set up .venv, run the main job (the engine on the preset that suits this machine)
#   make test   bash .ci/run: set up .venv, check the export, lint, run every test, notebook and solution
#   make test-busy  the same beside two CPU-bound burners, as on a CI machine that other work keeps busy
# and, while editing:
#   make lint   CI's checks without the tests: export --check (of committed work), ruff check, ruff format --check, mypy
#   make fmt    ruff format, then regenerate the modules and .ipynb files from the reformatted notebooks
#   make readme rewrite the README's reading times, computed from the notebooks by tools/reading_time.py
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo notebooks test test-busy export lint fmt readme

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m minivllm

notebooks: setup
	$(PY) -m jupyter nbconvert --to notebook --execute notebooks/0*.ipynb --output-dir build/notebooks
	$(PY) -m jupyter nbconvert --to notebook --execute notebooks/deep_dives/*.ipynb --output-dir build/notebooks/deep_dives
	@echo "executed notebooks: build/notebooks/; figures:"; ls -1 build/figures/*.png | sed 's/^/  /'

export: setup
	$(PY) tools/export.py

lint: setup
	$(PY) tools/export.py --check
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

fmt: setup
	$(PY) -m ruff format .
	$(PY) tools/export.py

readme: setup
	$(PY) tools/reading_time.py --write-readme

test:
	bash .ci/run

# Nothing may depend on timing or load: this shows it, with both of this machine's cores kept busy all along.
test-busy:
	@pids=""; for i in 1 2; do $(PYTHON) -c 'while True: pass' & pids="$$pids $$!"; done; \
	trap "kill $$pids" EXIT; bash .ci/run
