# The two commands a person needs on a fresh machine:
#   make up    install, build llama-server for the CPU, fetch the demo model, serve it
#   make test  install, lint, the unit tier (minutes, no build); then build, fetch and run
#              the rest (slow and integration tests): every test once
#   make fuzz  the front's whole fuzz campaign (15 minutes)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8080

.PHONY: install build model up test unit hermetic lint clean wheelhouse system-deps build-deps fuzz

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# With nvcc present, the cuBLAS wheel (~450 MB) lets the tests configure the CUDA build.
	$(BIN)/python -m pip install -q -e ".[test$$(command -v nvcc >/dev/null && echo ,cuda)]"
	touch $(STAMP)

install: $(STAMP)

# The demo model comes first: the build tries each new llama-server on it before keeping it.
build: install model build-deps
	$(BIN)/mtpwrap build --cpu

model: install
	$(BIN)/mtpwrap models demo

up: build model
	$(BIN)/mtpwrap up --profile cpu-demo --host $(HOST) --port $(PORT)

lint: install
	$(BIN)/ruff check mtpwrap tests benchmarks docs
	$(BIN)/mypy mtpwrap
	$(BIN)/lint-imports --no-cache
	$(BIN)/vulture  # dead code; paths and whitelist in pyproject.toml [tool.vulture]

# System tools (command:package): `patch` applies the llama.cpp patch set (patches/) at build
# time, and ccache lets a rebuild under a new cache key reuse unchanged objects; the fleet tests
# run HAProxy and Prometheus (with promtool) for real, the status page's test Chromium (with
# its driver), the offline bundle's test a network namespace (unshare, ip) and openssl.
# Installed with apt-get when missing and run as root; otherwise one line says what to install.
BUILD_TOOLS := patch:patch ccache:ccache
SYSTEM_TOOLS := $(BUILD_TOOLS) haproxy:haproxy prometheus:prometheus promtool:prometheus \
                openssl:openssl chromium:chromium chromedriver:chromium-driver \
                unshare:util-linux ip:iproute2
TOOLS ?= $(SYSTEM_TOOLS)
build-deps:
	@$(MAKE) --no-print-directory system-deps TOOLS="$(BUILD_TOOLS)"
system-deps:
	@missing=""; for tp in $(TOOLS); do \
	  command -v $${tp%%:*} >/dev/null 2>&1 || missing="$$missing $${tp#*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	missing=$$(echo $$missing | tr ' ' '\n' | sort -u | tr '\n' ' '); \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $$missing"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing \
	  || { apt-get update && DEBIAN_FRONTEND=noninteractive \
	       apt-get install -y --no-install-recommends $$missing; }; \
	else echo "missing system packages: $$missing(run: sudo make system-deps)"; fi

# System tools first (the unit tier runs HAProxy and promtool), then lint and the unit tier,
# so a broken unit test fails before anything is compiled. The rest on one worker per core, two
# at most, each test file on one worker: every llama-server a test starts takes one thread.
test: install system-deps lint unit model build
	$(BIN)/python -m pytest -m "integration or slow" -n auto --maxprocesses 2 --dist loadfile \
	  --durations=40

# The front's fuzz campaign (tests/fuzz/campaign.py): seeds, generated bodies, raw HTTP/1.1,
# upstream faults and an operator's faults on the real llama-server in FUZZ_SECONDS (a random
# seed, printed; FUZZ_SEED to repeat one). Every new failure class is shrunk and kept in
# tests/fuzz/seeds/.
FUZZ_SECONDS ?= 840
fuzz: build model
	$(BIN)/python -m tests.fuzz.campaign --seconds $(FUZZ_SECONDS) --save-found \
	  $(if $(FUZZ_SEED),--seed $(FUZZ_SEED))

# The unit tier: every test not marked integration or slow; each gets an empty MTPWRAP_HOME.
# One worker per core (pytest-xdist), each test file on one worker: these tests run fakes, not
# llama-server, so they share the cores well.
unit: install
	$(BIN)/python -m pytest -m "not integration and not slow" -n auto --dist loadfile --durations=15

# Every test not marked integration (slow ones too) as a fresh machine without network or
# build tools runs it: no network, an empty MTPWRAP_HOME, no cmake or C/C++ compiler on PATH.
hermetic: install
	.ci/hermetic $(BIN)/python -m pytest -m "not integration"

# The runtime wheels (matplotlib left out: plots are skipped) for a machine without network or
# venv: `make wheelhouse PYVER=3.12`, then carry .wheelhouse. WHEELS=lent leaves out what the
# lent GPU machine's image already has (benchmarks/gpu_plan.py LENT_IMAGE_HAS).
WHEELHOUSE ?= .wheelhouse
WHEELS ?= all
PYVER ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
ARCH  ?= $(shell uname -m)
wheelhouse: install
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --implementation cp \
	  --python-version $(PYVER) --platform manylinux_2_28_$(ARCH) \
	  --platform manylinux_2_27_$(ARCH) --platform manylinux_2_17_$(ARCH) \
	  --platform manylinux2014_$(ARCH) -d $(WHEELHOUSE) \
	  $$($(BIN)/python -c "from benchmarks import gpu_plan; \
	    print(' '.join(gpu_plan.wheels('$(WHEELS)' == 'lent')))")
	du -sh $(WHEELHOUSE)

clean:
	rm -rf build $(VENV)
