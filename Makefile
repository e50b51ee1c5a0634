# Two commands a newcomer needs:  `make demo` (set up, then run the demo) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_PIN := torch==2.13.0
TS     := clients/typescript

.PHONY: setup demo test test-fast lint protos check-protos clean

setup: $(VENV)/.modules $(TS)/node_modules/.installed

# torch is pinned first: a bare `torch` requirement would pull a multi-GB CUDA build.
# The editable install is strict (a link tree under build/) so that mypy can follow it.
$(VENV)/.installed: pyproject.toml compression/_kernels.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install $(TORCH_PIN)
	$(BIN)/pip install -e ".[dev]" --config-settings editable_mode=strict
	touch $@

# The strict link tree lists modules one by one: install it again when a module is added or
# removed (the list differs from the one last installed), not when one is only edited.
MODULES := $(sort $(shell find src coordinator site compression security protos -name '*.py' 2>/dev/null))
$(VENV)/.modules: $(VENV)/.installed FORCE
	@echo "$(MODULES)" | cmp -s - $@ || { \
		$(BIN)/pip install -q -e ".[dev]" --no-deps --config-settings editable_mode=strict && \
		echo "$(MODULES)" > $@; }

.PHONY: FORCE
FORCE:

# The TypeScript site (docs/protocol.md): exactly the committed package-lock.json.
$(TS)/node_modules/.installed: $(TS)/package-lock.json
	cd $(TS) && npm ci --no-audit --no-fund
	touch $@

demo: setup
	$(BIN)/geodiloco demo --json runs/demo.json --run-dir runs/demo

# Two workers, whole files each, long files first (tests/conftest.py orders them).
test: setup
	cd $(TS) && npm test --silent
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not integration" tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy -p geodiloco
	$(BIN)/lint-imports

protos: setup
	PATH=$(BIN):$$PATH scripts/gen_protos.sh

check-protos: setup
	PATH=$(BIN):$$PATH scripts/check_protos.sh

clean:
	rm -rf $(VENV) build *.egg-info runs .pytest_cache .mypy_cache .ruff_cache $(TS)/node_modules
