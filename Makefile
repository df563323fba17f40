# Every target sets up what it needs on a fresh machine: a virtualenv with torch==2.13.0 (the
# local CPU build, installed first so nothing pulls a CUDA build), the package and its extras,
# MathJax 3 from npm for offline math, and Debian's Chromium for the browser test.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MATHJAX := book/_extra/mathjax/tex-chtml.js
MATHJAX_VERSION := 3.2.2
export HF_HUB_OFFLINE := 1
export PYTHONHASHSEED := 0

.PHONY: env book test bench prove chromium clean

env: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,book,hf,peers]"
	touch $@

$(MATHJAX):
	rm -rf book/_extra/mathjax .cache/mathjax && mkdir -p .cache/mathjax book/_extra
	cd .cache/mathjax && npm pack --silent mathjax@$(MATHJAX_VERSION) >/dev/null && tar xzf mathjax-$(MATHJAX_VERSION).tgz
	cp -r .cache/mathjax/package/es5 book/_extra/mathjax

chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

prove: env
	$(PY) -m circuitmath prove

book: env $(MATHJAX) prove
	$(VENV)/bin/jupyter-book build book --all --warningiserror --keep-going
	@echo "book built: book/_build/html/index.html"

test: env $(MATHJAX) chromium
	$(PY) -m pytest -n 2 --dist loadgroup

# Every benchmark prints its figures, then the target fails if any of them missed its target.
BENCHMARKS := prove_suite process_weights composition_scores check_speed streaming

bench: env
	@status=0; for b in $(BENCHMARKS); do echo "== benchmarks/$$b.py"; $(PY) benchmarks/$$b.py || status=1; done; exit $$status

clean:
	rm -rf book/_build book/_extra .cache
