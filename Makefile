# make lab  - create .venv if needed, install, open JupyterLab on the quickstart
# make gpu-check - every GPU test and GPU benchmark; raw JSON under data/benchmarks/gpu/ (needs a CUDA device)
# make test - create .venv if needed, install, lint (ruff, mypy), run the whole test suite (on Debian it first installs
#             chromium when missing, for the browser test; sudo is used unless you are root)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.14.1 torchvision==0.29.1
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export OMP_NUM_THREADS ?= 2
TEST_WORKERS ?= 2

.PHONY: lab test lint gpu-check chromium clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[dev,timm,hf,exact]'
	touch $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab --ip 127.0.0.1 notebooks/00_quickstart.ipynb

test: $(STAMP) chromium lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

# the linters the field uses: ruff (style, import order, complexity) and mypy over the package
lint: $(STAMP)
	$(BIN)/ruff check udnn_lab tests benchmarks
	$(BIN)/mypy

gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

# tests/test_browser.py drives JupyterLab with the system's chromium (Playwright's own browser downloads are not used)
chromium:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then :; \
	elif command -v apt-get >/dev/null; then \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	else echo "no chromium and no apt-get: install chromium to run tests/test_browser.py (it skips outside CI)"; fi

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
