# The two commands a person needs on a fresh machine:
#   make up    install, build llama-server for the CPU, fetch the demo model, serve it
#   make test  install, build, fetch, then lint and run every test (unit and integration)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8080

.PHONY: install build model up test unit lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

build: install
	$(BIN)/mtpwrap build --cpu

model: install
	$(BIN)/mtpwrap models demo

up: build model
	$(BIN)/mtpwrap up --profile cpu-demo --host $(HOST) --port $(PORT)

lint: install
	$(BIN)/ruff check mtpwrap tests benchmarks

test: build model lint
	$(BIN)/python -m pytest

unit: install
	$(BIN)/python -m pytest -m "not integration"

clean:
	rm -rf build $(VENV)
