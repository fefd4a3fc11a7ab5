# The two set-up commands of the README: `make demo` and `make test`.
# Each makes its own virtual environment on first use (PYTHON picks the interpreter).
PYTHON ?= python3
VENV ?= .venv
PIP_FLAGS ?= -q

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) -U pip
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) -e ".[test]"
	touch $@

.PHONY: demo attention-demo test bench
demo: $(VENV)/.installed
	$(VENV)/bin/python -m dcpjax.generate --num-cpu-devices 8 --tensor-parallel-size 8 \
		--decode-context-parallel-size 2 --compare-dcp-1 --kv-cache-memory-bytes 8388608

attention-demo: $(VENV)/.installed
	$(VENV)/bin/python -m dcpjax.demo --num-cpu-devices 8

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/attention.py
