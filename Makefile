# edgevlm: the two commands.
#
#   make demo   install missing system packages, set up .venv (first time only), run the end-to-end demo
#   make test   install missing system packages, set up .venv (first time only), run the test suite
#   make lint   ruff
#
# System packages: scripts/system-deps.sh holds the one list (`test` and `demo` groups). It checks
# them with one dpkg-query call and does nothing more when all are installed; missing ones are
# installed with apt-get as root or with passwordless sudo, else it prints the exact
# `sudo apt-get ...` command and stops. EDGEVLM_SYSTEM_DEPS=skip skips it.
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

.PHONY: all setup system-deps system-deps-demo demo test lint clean-venv

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

# Prerequisites run left to right: the system packages (python3-venv among them) before the venv.
system-deps:
	@scripts/system-deps.sh test

system-deps-demo:
	@scripts/system-deps.sh demo

demo: system-deps-demo $(STAMP)
	$(BIN)/edgevlm demo

test: system-deps $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean-venv:
	rm -rf $(VENV)
