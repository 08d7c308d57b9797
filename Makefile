# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.cleave-installed
STEPS ?= 30
STATE_DIR ?= cleave-state

.PHONY: setup demo test test-fast bench plots lint clean package

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU build on this machine's disk; letting pip pick
# torch for the `torch>=2.4` range would download a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/cleave-coordinator serve --job coordinator.jobs.tiny_gpt:make_job \
		--steps $(STEPS) --local-workers 2 --port 0 --state-dir $(STATE_DIR) --fresh

test: setup
	$(BIN)/python -m pytest -q

# The unit tier (tests/unit/): one process, no network, about two minutes.
test-fast: setup
	$(BIN)/python -m pytest -q tests/unit

bench: setup
	$(BIN)/python bench/bench_tile.py
	$(BIN)/python bench/bench_worker.py
	$(BIN)/python bench/bench_wire.py
	$(BIN)/python bench/bench_egress.py
	$(BIN)/python bench/bench_ingress.py
	$(BIN)/python bench/bench_verify.py
	$(BIN)/python bench/bench_step.py
	$(BIN)/python bench/bench_core.py

# Every picture in docs/: the benchmarks' from their tables in docs/benchmarks.md (seconds),
# the simulator's by running its report again (about 20 minutes on 2 cores).
plots: setup
	$(BIN)/python bench/plots.py
	$(BIN)/python -m coordinator.sim report

lint: setup
	$(BIN)/ruff check common coordinator client_app tests bench docs/examples
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# `make package`: the one-folder PyInstaller bundle dist/cleave-app/ and, from it,
# dist/cleave-app_VERSION_ARCH.deb (packaging/, docs/packaging.md). The `package`
# extra goes into the same venv, so the bundle carries the torch `make setup` chose.
PACKAGE_STAMP := $(VENV)/.cleave-package-installed

$(PACKAGE_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[package]'
	touch $(PACKAGE_STAMP)

package: $(PACKAGE_STAMP)
	$(BIN)/pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller \
		packaging/pyinstaller/cleave-app.spec
	packaging/linux/build_deb.sh dist/cleave-app dist

clean:
	rm -rf $(VENV) cleave-state .pytest_cache .mypy_cache .ruff_cache
