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

.PHONY: env book test soak bench prove prove-lowest-sympy mutate chromium clean

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

# The lowest sympy pyproject.toml admits, beside the venv's (the highest): every proof must hold on both.
SYMPY_LOWEST := 1.13.3
SYMPY_LOWEST_DIR := .cache/sympy-$(SYMPY_LOWEST)

$(SYMPY_LOWEST_DIR)/sympy/__init__.py: | env
	$(PY) -m pip install --quiet --no-deps --target $(SYMPY_LOWEST_DIR) sympy==$(SYMPY_LOWEST)

prove-lowest-sympy: env $(SYMPY_LOWEST_DIR)/sympy/__init__.py
	@PYTHONPATH=$(SYMPY_LOWEST_DIR) $(PY) -c "import sympy; assert sympy.__version__ == '$(SYMPY_LOWEST)', sympy.__version__"
	@PYTHONPATH=$(SYMPY_LOWEST_DIR) $(PY) -m circuitmath prove > .cache/prove-sympy-$(SYMPY_LOWEST).txt \
		|| { cat .cache/prove-sympy-$(SYMPY_LOWEST).txt; echo "proofs fail on sympy $(SYMPY_LOWEST)"; exit 1; }
	@tail -1 .cache/prove-sympy-$(SYMPY_LOWEST).txt | sed 's/^/sympy $(SYMPY_LOWEST): /'

# Quiet: the proof table and Sphinx's and the kernels' chatter go to .cache/, shown when they fail.
book: env $(MATHJAX)
	@mkdir -p .cache && $(PY) -m circuitmath prove > .cache/prove.txt || { cat .cache/prove.txt; exit 1; }
	@tail -1 .cache/prove.txt
	@echo "building the book: every chapter executed (log: .cache/book.log)"
	@$(VENV)/bin/jupyter-book build book --all --warningiserror --keep-going > .cache/book.log 2>&1 \
		|| { tail -n 60 .cache/book.log; echo "the book did not build: .cache/book.log"; exit 1; }
	@echo "book built: book/_build/html/index.html"

test: env $(MATHJAX) chromium prove-lowest-sympy
	$(PY) -m pytest -n 2 --dist loadgroup

# Mutation testing (not part of `make test`: it runs the related tests once per mutant, tens of
# minutes on two cores). Prints every surviving mutant and the kill rate; MUTATE_ARGS passes
# options (e.g. MUTATE_ARGS="--only _processing --per-file 0").
mutate: env
	$(PY) .ci/mutate.py --jobs 2 $(MUTATE_ARGS)

# The property tests (hypothesis's own "hypothesis" marker) with random draws and SOAK_EXAMPLES
# examples each: tests/conftest.py's "soak" profile. Slow, so not part of `make test`; a failure
# prints a blob that reproduces it.
SOAK_EXAMPLES ?= 400

soak: env
	SOAK_EXAMPLES=$(SOAK_EXAMPLES) $(PY) -m pytest tests -m hypothesis -n 2 --dist loadgroup --hypothesis-profile=soak --hypothesis-show-statistics -p no:cacheprovider

# Every benchmark prints its figures, then the target fails if any of them missed its target.
BENCHMARKS := prove_suite process_weights composition_scores check_speed check_load streaming blame sharpness one_row_control

bench: env
	@status=0; for b in $(BENCHMARKS); do echo "== benchmarks/$$b.py"; $(PY) benchmarks/$$b.py || status=1; done; exit $$status

clean:
	rm -rf book/_build book/_extra .cache
