# `make demo` and `make test` set everything up themselves (a virtualenv in .venv/).
VENV    := .venv
PY      := $(VENV)/bin/python
CLI     := $(VENV)/bin/megatron-ext
STAMP   := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel, so nothing pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

# this machine's cost model, measured once (~40 s): the presets were measured on another day
# and machines of one kind differ by up to 1.7x, which the demo's predicted step times would show
$(VENV)/tiny-cpu-4-profiled.yaml: $(STAMP)
	$(CLI) profile --out $@

demo: setup $(VENV)/tiny-cpu-4-profiled.yaml
	$(CLI) train --compare flexsp,static_ulysses --steps 6 --cost-model $(VENV)/tiny-cpu-4-profiled.yaml
	$(CLI) train --pp 2 --planner elastic_pp --steps 4 --cost-model $(VENV)/tiny-cpu-4-profiled.yaml
	$(CLI) plan --lengths configs/lengths/stdlib.txt --model gpt-7b --cluster a100-40g-8x8

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(CLI) bench planner

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
