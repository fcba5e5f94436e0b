# Every target sets itself up: a fresh machine needs nothing but python3.
PYTHON ?= python3
VENV ?= .venv
# The CPU build lies on local disk; override for other machines (e.g. TORCH_SPEC="torch>=2.6").
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m experiments.demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q tests

# GPU only: pytest-benchmark suite, PISA beside its dense baselines in one process.
bench: $(STAMP)
	$(PY) -m pytest -q benchmarks -o python_files='bench_*.py' --benchmark-enable \
		--benchmark-json=profiles/bench.json

clean:
	rm -rf $(VENV) .hypothesis .pytest_cache
