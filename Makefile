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
