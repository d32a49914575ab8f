# Set-up and checks for normhooks. `make test` and `make demo` work on a fresh machine with
# only Python: the first run creates .venv and installs everything into it.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch is pinned (constraints.txt) so pip never pulls a multi-GB CUDA build.
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed

.PHONY: install test lint typecheck docs pytest bench demo clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,demo,docs]'
	$(PIP) --no-deps pytorch-lamb==1.0.0
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy --strict src

pytest: $(STAMP)
	$(BIN)/python -m pytest

# --strict turns every warning into an error: a broken cross-reference, an API block naming an
# object that does not exist, a docstring whose Args do not match the signature.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

test: lint typecheck docs pytest

# host.py is the CPU proxy of GPU host time (the CUDA path, Triton launching nothing).
bench: $(STAMP)
	$(BIN)/python benchmarks/host.py
	$(BIN)/python benchmarks/lars.py
	$(BIN)/python benchmarks/agc.py
	$(BIN)/python benchmarks/trust_ratio.py
	$(BIN)/python benchmarks/gradient_centralization.py
	$(BIN)/python benchmarks/hypersphere.py
	$(BIN)/python benchmarks/update_rms.py
	$(BIN)/python benchmarks/ws.py
	$(BIN)/python benchmarks/wn.py
	$(BIN)/python benchmarks/sn.py

demo: $(STAMP)
	$(BIN)/normhooks demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
