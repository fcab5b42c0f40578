# A new user runs `make demo` or `make test`; both create .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean bench-cpu

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: with it present nothing else can pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,data]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/tracerl train --config configs/tiny-arith.yaml

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
