# Two commands do everything on a fresh machine:
#   make lab    install into .venv and open JupyterLab on notebooks/ (LAB_ARGS=--no-browser for a server)
#   make test   install with test dependencies, lint (ruff, configured in pyproject.toml), run the whole test
#               suite, build the documentation (make docs)
#   make check  the inner loop, before each commit: lint, the unit tests and one short real job per strategy
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UV = $(VENV)/bin/uv pip
EXTRAS ?= cpu,notebook
# pyproject.toml's dependency groups (not published extras): test tools, and the docs' (included by test)
GROUPS ?= test
LAB_ARGS ?=
PYTEST_ARGS ?=
# a command's environment with the bind shim preloaded (its TensorFlow ports, and its children's, on loopback)
WITH_SHIM = LD_PRELOAD="$$($(VENV)/bin/jupyter-tf-workbench bind-shim)$${LD_PRELOAD:+ $$LD_PRELOAD}"

.PHONY: install chromium lab test check docs dist screenshots bench bench-training bench-tta bench-gpu bench-dashboard bench-memory bench-controller bench-launchers bench-transfers bench-network bench-soak bench-stalls bench-elastic bench-threads demo clean

EXTENSION_SOURCES := $(wildcard extension/src/*.ts extension/style/*) extension/package.json extension/yarn.lock
# the editable build compiles the bind shim into workbench/cluster/ (hatch_build.py)
BUILD_SOURCES := hatch_build.py workbench/cluster/process/bind_shim.c

$(VENV)/.installed: pyproject.toml $(EXTENSION_SOURCES) $(BUILD_SOURCES)
	.ci/ensure-compiler
	$(PYTHON) -m venv $(VENV)
	# uv resolves and installs the same packages as pip in a fraction of its time (about a minute, panel built)
	$(PY) -m pip install --quiet 'uv>=0.9'
	# the build hook rebuilds the panel only when extension/src changed: a changed style sheet counts too
	rm -rf workbench/labextension
	# byte-compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set nothing is cached later, and every
	# Python that imports TensorFlow (kernels, engines, the suite's processes) would compile it again (2.7 times the CPU)
	$(UV) install --python $(PY) --quiet --compile-bytecode -e '.[$(EXTRAS)]' $(foreach group,$(GROUPS),--group $(group))
	$(UV) check --python $(PY) --quiet
	touch $@

install: $(VENV)/.installed

chromium:
	.ci/ensure-chromium

# Jupyter, and so every kernel, runs with the bind shim: a kernel's TensorFlow port listens on loopback only.
# Kernels' threads share two malloc heaps, set before a kernel starts (it has a dozen before its first cell).
lab: install
	MALLOC_ARENA_MAX=$${MALLOC_ARENA_MAX:-2} $(WITH_SHIM) \
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 \
		$$( [ "$$(id -u)" = 0 ] && echo --allow-root ) $(LAB_ARGS)

# The suite runs as a `make lab` kernel does, with the bind shim: its own TensorFlow ports stay on loopback.
# Two pytest processes side by side (tests/run_suite.py says which tests each runs, and why).
test: install chromium
	$(PY) -m ruff check .
	$(WITH_SHIM) $(PY) tests/run_suite.py $(PYTEST_ARGS)
	$(MAKE) docs

# The inner loop (a couple of minutes): lint, the unit tests, and one short real job per strategy on one cluster.
# Two pytest processes (pytest-xdist) take the test files in turn as each finishes its last: many of them wait on a
# Python of their own importing TensorFlow. A file stays in one process: the jobs' file starts one cluster.
check: install
	$(PY) -m ruff check .
	$(WITH_SHIM) $(PY) -m pytest -n 2 --dist loadfile tests/unit tests/integration/test_check.py $(PYTEST_ARGS)

# The documentation site: docs/_build/html. Warnings are errors; the tutorials are executed (cached in
# docs/_build/.jupyter_cache: a tutorial runs again only when its code changed).
docs: install
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

# README's and the docs' screenshots, taken from a real run in headless Chromium (tests/browser/test_docs_screenshots.py)
screenshots: install chromium
	WORKBENCH_DOCS_SCREENSHOTS=1 $(WITH_SHIM) \
		$(PY) -m pytest tests/browser/test_docs_screenshots.py tests/browser/test_tracking_ui.py

# sdist and wheel into dist/, checked as PyPI would check them
dist: install
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

demo: install
	$(VENV)/bin/jupyter-tf-workbench demo

bench: install
	$(PY) bench/startup.py

bench-training: install
	$(PY) bench/training.py

# every strategy's time to a held-out accuracy against TensorFlow's own and one process (about 20 minutes)
bench-tta: install
	$(WITH_SHIM) $(PY) bench/time_to_accuracy.py

# on a machine with NVIDIA GPUs and tensorflow[and-cuda] (EXTRAS=gpu,notebook): placement and images/s, then time to
# accuracy against one process on a GPU; elsewhere each says why it skips
bench-gpu: install
	$(PY) bench/gpu.py
	$(WITH_SHIM) $(PY) bench/time_to_accuracy.py --gpu

bench-transfers: install
	$(PY) bench/transfers.py

bench-network: install
	$(PY) bench/network.py

# each task's share of the machine's cores against TensorFlow's default pools (about 10 minutes)
bench-threads: install
	$(PY) bench/threads.py

bench-soak: install
	$(PY) bench/soak.py

bench-stalls: install
	$(PY) bench/stalls.py

bench-elastic: install
	$(WITH_SHIM) $(PY) bench/elastic.py

bench-dashboard: install chromium
	$(PY) bench/dashboard.py

bench-memory: install
	$(PY) bench/tutorial_memory.py

bench-controller: install
	$(PY) bench/controller.py

# as root: Open MPI, OpenSSH and Slurm are installed when missing; the emulated hosts need namespaces
bench-launchers: install
	$(WITH_SHIM) $(PY) bench/launchers.py

clean:
	rm -rf $(VENV) build dist *.egg-info test-artifacts bench/results workbench/labextension extension/lib extension/node_modules \
		workbench/cluster/process/workbench-bind-shim.so docs/_build docs/api docs/tutorials
