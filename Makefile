# Kiln: `make build CONFIG=tiny-llama-fp8.yaml` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
CONFIG ?= tiny-llama-fp8.yaml
ARGS ?=

PY := $(VENV)/bin/python
KILN := $(VENV)/bin/kiln
STAMP := $(VENV)/.kiln-installed

.PHONY: venv build serve test bench lint mutation clean-venv

# The pinned PyTorch goes in first, so nothing that depends on torch can pull a different (multi-GB) build;
# TORCH_INDEX picks the index it comes from (PyPI's Linux wheel is the CUDA build: the CPU one is at
# https://download.pytorch.org/whl/cpu). A GPU torch brings the triton it pins; where it brought none (a CPU build on
# Linux), the tests' Triton interpreter is the tested 3.6.0.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: Kiln needs Python 3.11 or \
	newer and $(PYTHON) is $$($(PYTHON) --version 2>&1): pass PYTHON=python3.11 (or newer)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	if [ "$$(uname -s)" = Linux ] && ! $(PY) -c "import triton" 2>/dev/null; then \
		$(PY) -m pip install -q triton==3.6.0; fi
	$(PY) -m pip install -q -e '.[serve,dev]'
	touch $(STAMP)

venv: $(STAMP)

build: venv
	$(KILN) build $(CONFIG) $(ARGS)

serve: venv
	$(KILN) serve $(CONFIG) $(ARGS)

# One worker a core (at most 4), each taking whole files, so that a module's fixtures stay shared within it
test: venv
	$(VENV)/bin/pytest -q -n auto --maxprocesses 4 --dist loadfile $(ARGS)

bench: venv
	$(KILN) bench $(CONFIG) $(ARGS)

lint: venv
	$(VENV)/bin/ruff check .

# Mutation testing of the core modules on a copy of HEAD (hours on 2 cores; ARGS=tools/mutation/NAME.toml for one)
mutation: venv
	$(PY) -m pip install -q -e '.[mutation]'
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash tools/mutation/run.sh $(ARGS)

clean-venv:
	rm -rf $(VENV)
