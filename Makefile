# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, the build TORCH_SPEC names, so installing the project keeps it rather than picking one itself
# (read when .venv is created; `make clean` starts over).
TORCH_SPEC ?= torch==2.13.0
DEMO_MODEL ?= .moegate/demo-model
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run test test-ray bench-offline clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# --no-compile: bytecode is written as modules are first imported (below), not for every file of every package.
	$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-compile -e '.[test]'
	touch $@

install: $(VENV)/.installed

$(DEMO_MODEL)/config.json: | $(VENV)/.installed
	$(VENV)/bin/moegate demo-model $(DEMO_MODEL)

run: $(VENV)/.installed $(DEMO_MODEL)/config.json
	$(VENV)/bin/moegate serve --model $(DEMO_MODEL) --host $(HOST) --port $(PORT)

test: $(VENV)/.installed
	# Bytecode kept even where the environment says otherwise: the suite starts hundreds of Python processes.
	# One torch thread per process: three workers (and the engines and ranks they start) on two cores, each with
	# torch's default of a thread per core, spend most of their CPU spinning in OpenMP (measured: 3x the CPU).
	OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -ra -n 3 --dist loadfile -m "not ray" tests

# The Ray executor's tests (--distributed-executor-backend ray): a local Ray cluster takes tens of seconds to start.
test-ray: $(VENV)/.installed
	$(PY) -m pip install -q --no-compile -e '.[test,ray]'
	OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -ra -m ray tests/distributed

bench-offline: $(VENV)/.installed
	$(VENV)/bin/moegate loadgen offline

clean:
	rm -rf $(VENV) .moegate .pytest_cache
