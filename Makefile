# edgevlm: the two commands.
#
#   make demo   set up .venv (first time only), then run the end-to-end demo
#   make test   set up .venv (first time only), then run the test suite
#   make lint   ruff
#
# Set-up: `python3 -m venv .venv`; on x86_64 (not a Jetson) torch==$(TORCH_VERSION) is installed
# first so that the `runtime` extra does not pull another build; on a Jetson (aarch64 with
# /etc/nv_tegra_release) torch comes from JetPack and is never installed or replaced: the venv is
# created with --system-site-packages so JetPack's torch is visible, and pip gets a constraint
# pinning torch to that exact version. Then `pip install -e '.[runtime,onnx,metrics,audio,http,dev]'`. A stamp file makes the set-up a no-op until pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.edgevlm-setup.stamp
ARCH := $(shell uname -m)
JETSON := $(shell [ "$(ARCH)" = aarch64 ] && [ -f /etc/nv_tegra_release ] && echo yes)

.PHONY: all setup demo test lint clean-venv

all: test

setup: $(STAMP)

$(STAMP): pyproject.toml
	@set -e; \
	if [ ! -x "$(BIN)/python" ]; then \
		if [ "$(JETSON)" = yes ]; then venv_flags=--system-site-packages; else venv_flags=; fi; \
		echo "+ $(PYTHON) -m venv $$venv_flags $(VENV)"; \
		$(PYTHON) -m venv $$venv_flags $(VENV) || { \
			echo "error: '$(PYTHON) -m venv' failed; on Debian/Ubuntu: sudo apt-get install -y python3-venv" >&2; \
			exit 1; }; \
	fi; \
	if [ "$(JETSON)" = yes ]; then \
		$(BIN)/python -c "import torch" 2>/dev/null || { \
			echo "error: Jetson detected but JetPack's PyTorch is not importable; install NVIDIA's torch wheel for your JetPack first (edgevlm never replaces it)" >&2; \
			exit 1; }; \
		echo "torch==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("torch"))')" > $(VENV)/torch-constraint.txt; \
		echo "Jetson: keeping JetPack's $$(cat $(VENV)/torch-constraint.txt) (pip constraint)"; \
		constraint="-c $(VENV)/torch-constraint.txt"; \
	elif [ "$(ARCH)" = x86_64 ]; then \
		if [ "$$($(BIN)/python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$(TORCH_VERSION)" ]; then \
			echo "+ pip install torch==$(TORCH_VERSION)"; \
			$(BIN)/python -m pip install "torch==$(TORCH_VERSION)"; \
		fi; \
	fi; \
	echo "+ pip install -e '.[runtime,onnx,metrics,audio,http,dev]' $${constraint:-}"; \
	$(BIN)/python -m pip install -e '.[runtime,onnx,metrics,audio,http,dev]' $${constraint:-}; \
	touch $@

demo: $(STAMP)
	$(BIN)/edgevlm demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean-venv:
	rm -rf $(VENV)
