# hvdx development commands. Every target that runs code bootstraps first (idempotent).
# HVDX_STACK picks the stack (requirements/<stack>.txt; default: requirements/default-stack),
# and with it the venv: `make test HVDX_STACK=tf2.21` runs the tests on TensorFlow 2.21.
HVDX_STACK ?= $(shell cat requirements/default-stack)
export HVDX_STACK
VENV ?= $(shell HVDX_STACK=$(HVDX_STACK) bash scripts/bootstrap.sh --venv)
PY := $(VENV)/bin/python
# 2 nodes x 2 ranks on one machine: horovodrun treats the two host names as two nodes.
HOSTS ?= localhost:2,127.0.0.1:2
NP ?= 4
PYTEST_ARGS ?=
# TensorFlow's start-up banners, once per rank, hide the demo's output.
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: bootstrap build demo test test-fast clean
bootstrap:
	HVDX_VENV=$(abspath $(VENV)) bash scripts/bootstrap.sh

# Incremental rebuild of the op library (csrc/) after a C++/CUDA change.
build: bootstrap

demo: bootstrap
	$(VENV)/bin/horovodrun -np $(NP) -H $(HOSTS) --gloo $(PY) examples/dawnbench.py --preset demo

# tf.keras is Keras 3 in the tests' process from TensorFlow 2.16 on, as in a user's; the tests
# of Keras 2 as tf.keras in that process (marked keras2) run after, in tests/keras2_pass.sh.
test: bootstrap
	$(PY) -m pytest $(PYTEST_ARGS)
	bash tests/keras2_pass.sh $(PY)

# The fast loop while editing: every test that runs in this process (no multi-rank launch,
# no benchmark smoke run). `make test` runs them all, multi-rank and slow ones included.
test-fast: bootstrap
	$(PY) -m pytest -m "not multirank and not slow" $(PYTEST_ARGS)
	bash tests/keras2_pass.sh $(PY)

clean:
	rm -rf build hvdx/_hvdx_ops*.so *.egg-info
