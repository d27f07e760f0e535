# specpipe — one-command set-up, demo and tests. `make help` lists the targets.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt constraints.txt | cksum | cut -d' ' -f1)
MODEL  ?= models/demo-target
ENGINE ?= engines/demo
PYTEST_ARGS ?=

DEMO_PROMPTS := --prompt "def fibonacci(n):" \
	--prompt "$$(printf 'class Stack:\n    def __init__(self):')" \
	--prompt "$$(printf 'import os\n\n\ndef list_python_files(path):')"

.PHONY: help setup engine demo test test-slow lint format model clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 14

setup: $(STAMP)  ## create .venv and install pinned requirements (once)

$(STAMP): requirements.txt constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt -c constraints.txt
	rm -f $(VENV)/.installed-* && touch $@

$(ENGINE)/config.json: $(STAMP) $(MODEL)/config.json $(MODEL)/model.safetensors $(MODEL)/tokenizer.json
	$(BIN)/python -m build.engine --checkpoint $(MODEL) --output $(ENGINE) --force

engine: $(ENGINE)/config.json  ## build $(ENGINE) from the bundled model $(MODEL)

demo: engine  ## set up, build the demo engine and generate from a few prompts (never trains)
	$(BIN)/python -m runtime.generate --engine $(ENGINE) $(DEMO_PROMPTS) --max-tokens 64

# pytest exits 5 when no test is collected; that is not a failure of the suite.
test: setup  ## default test suite (no slow tests)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-slow: setup  ## slow tests only
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

lint: setup  ## ruff check + ruff format --check + mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup  ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

model: setup  ## re-train the bundled demo model (~30 min on 2 CPU cores)
	$(BIN)/python -m training.train_target --out $(MODEL)

clean:  ## remove built engines and caches (keeps .venv)
	rm -rf engines work_dirs .pytest_cache .mypy_cache .ruff_cache
