# make lab  - create .venv if needed, install, open JupyterLab on the quickstart
# make test - create .venv if needed, install, run the whole test suite

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.14.1 torchvision==0.29.1
export OMP_NUM_THREADS ?= 2

.PHONY: lab test clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[dev,timm]'
	touch $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab --ip 127.0.0.1 notebooks/00_quickstart.ipynb

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
