# make lab  - create .venv if needed, install, open JupyterLab on the quickstart
# make gpu-check - the GPU corpus and every GPU test; raw JSON under data/benchmarks/gpu/ (needs a CUDA device). It runs
#                  in .venv where there is one, else in the machine's own python (a GPU image with its own torch), and
#                  installs from .whl/ what that lacks; make gpu-wheels fills .whl/ here, to carry there
# make test - create .venv if needed, install, lint (ruff, mypy), run the whole test suite (on Debian it first installs
#             chromium when missing, for the browser test; sudo is used unless you are root), the timing tests alone last
# make test-compat - create .venv-oldest if needed with the oldest torch and transformers the package supports,
#             install, run the compatibility subset there (tests marked compat)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.14.1 torchvision==0.29.1
OLDEST := .venv-oldest
OLDEST_STAMP := $(OLDEST)/.installed
TORCH_OLDEST ?= torch==2.11.0 torchvision==0.26.0
TRANSFORMERS_OLDEST ?= transformers==5.17.*
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export OMP_NUM_THREADS ?= 2
TEST_WORKERS ?= 2

.PHONY: lab test test-compat lint gpu-check gpu-wheels chromium clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[dev,timm,hf,exact,lightning]'
	touch $(STAMP)

# the oldest releases stay pinned while the project is installed (a constraints file: pip may not upgrade them);
# its torch loads .venv's CUDA libraries (same CUDA major) rather than a second 3 GB copy: the tests run on the CPU
$(OLDEST_STAMP): pyproject.toml Makefile $(STAMP)
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	printf '%s\n' $(TORCH_OLDEST) '$(TRANSFORMERS_OLDEST)' > $(OLDEST)/constraints.txt
	$(OLDEST)/bin/python -m pip install --quiet --no-cache-dir --no-deps $(TORCH_OLDEST)
	$(OLDEST)/bin/python .ci/share_cuda_libraries.py $$($(OLDEST)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
		$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || test $$? = 3
	$(OLDEST)/bin/python -m pip install --quiet --no-cache-dir -c $(OLDEST)/constraints.txt $(TORCH_OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --no-cache-dir -c $(OLDEST)/constraints.txt -e '.[dev,timm,hf,exact]'
	touch $(OLDEST_STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab --ip 127.0.0.1 notebooks/00_quickstart.ipynb

test: $(STAMP) chromium lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m 'not timing'
	$(BIN)/python -m pytest -m timing

# trace, plan, runtime exactness, a DDP and an FSDP2 gloo run and notebook 00 on the oldest torch (pyproject's floor)
test-compat: $(OLDEST_STAMP)
	$(OLDEST)/bin/python -m pytest -m 'compat and not timing' -n $(TEST_WORKERS) -rs
	$(OLDEST)/bin/python -m pytest -m 'compat and timing'

# the linters the field uses: ruff (style, import order, complexity) and mypy over the package
lint: $(STAMP)
	$(BIN)/ruff check udnn_lab tests benchmarks
	$(BIN)/mypy

GPU_PYTHON ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || command -v python3)
GPU_IMAGE_PYTHON ?= 3.12
GPU_WHEELS := altair vl-convert-python nbformat nbclient ipywidgets anywidget highspy
# Lightning and its own small packages, without their dependencies (pip would fetch torch again)
GPU_LIGHTNING := lightning lightning-utilities torchmetrics

gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py

# the packages a GPU image without them needs for every GPU test (numpy and torch it has), as wheels for its Python
gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download --quiet --only-binary=:all: --python-version $(GPU_IMAGE_PYTHON) --platform any \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_IMAGE_PYTHON) \
		--platform any -d .whl $(GPU_LIGHTNING)
	rm -f .whl/numpy-*.whl
	du -sh .whl

# tests/test_browser.py drives JupyterLab with the system's chromium (Playwright's own browser downloads are not used)
chromium:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then :; \
	elif command -v apt-get >/dev/null; then \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	else echo "no chromium and no apt-get: install chromium to run tests/test_browser.py (it skips outside CI)"; fi

clean:
	rm -rf $(VENV) $(OLDEST) .pytest_cache .hypothesis
