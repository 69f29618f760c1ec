# The two commands the README gives. Each creates .venv if it is missing and installs into it; pip
# skips what is already installed, so they run the same on a fresh machine and on a used checkout.
# torch goes in first, pinned: on this kind of machine torch==2.13.0 is a CPU wheel on local disk,
# whereas letting `pip install -e .` resolve torch>=2.4 could fetch a multi-GB CUDA build.
# The tests run on two pytest-xdist workers (12-14 minutes on 2 cores). tests/test_torchrun.py's tests share one
# torchrun launch for all their jobs, whichever worker runs them (a lock in the run's directory).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
STAGES ?= 2
PIP    := $(VENV)/bin/pip -q

.PHONY: train test

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

train: $(VENV)/bin/python
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[examples]'
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --stages $(STAGES) --max-seconds 90

test: $(VENV)/bin/python
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[test]'
	$(VENV)/bin/python -m pytest -q -n 2
