# Two set-up commands for a fresh machine: `make demo` and `make test`. Both create .venv when it
# is missing and install the pinned environment (pyproject.toml + constraints.txt) into it.
PYTHON ?= python3
# `make demo SEED=N`: the seed of every stage (data, SFT, RL sampling); each seed is its own run.
SEED ?= 0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow lint lock clean

# A new environment takes about 7.7 GB (torch 2.14.1 brings its CUDA libraries even on a CPU
# machine) and about 8.4 GB while pip installs it: check the disk before starting, so that a
# full disk is one clear line instead of a pip traceback and a half-installed .venv.
NEED_GB ?= 9

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || { mkdir -p $(dir $(VENV)) && set -- $$(df -Pk $(dir $(VENV)) | awk 'NR==2 {print int($$4 / 1048576), $$6}') && free=$$1 mount=$$2 && \
	  if [ "$$free" -lt $(NEED_GB) ]; then \
	    echo "make: $(VENV) needs about $(NEED_GB) GB of free disk to install (torch's CUDA libraries included), but $$mount has $$free GB: free some space, or put the environment elsewhere with VENV=/larger/disk/venv" >&2; exit 2; fi; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

# The main job on the embedded default: offline, CPU, tiny model, synthetic tasks.
demo: $(STAMP)
	$(VENV)/bin/pyvision run pipelines/recipes/tiny-cpu.yaml --run-id demo-s$(SEED) --set seed=$(SEED)

# The default test run: CPU-only, offline, a few minutes.
test: $(STAMP)
	$(PY) -m pytest -q

# The slow checks the issues ask CI to run (end-to-end recipe, RL improvement).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow || [ $$? -eq 5 ]

lint: $(STAMP)
	$(VENV)/bin/ruff check pyvision_cli pipelines benchmarks tests

# Re-lock the transitive closure after changing a pin in pyproject.toml.
lock: $(STAMP)
	$(PY) -m pip freeze --exclude-editable | grep -v '^pyvision-rl' > constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache
