# The two commands of the README: `make train` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup train test bench bazel bazel-deps sweep clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# The main job: resnet-20's step (50 MiB at its peak) rematerialized to half its peak, then
# placed on two devices of 16 MiB each. Override with e.g. `make train ARGS="--model_name=mlp"`.
ARGS ?= --memory_ratio=0.5 --num_devices=2 --device_memory=16MiB
train: $(STAMP)
	$(PY) -m graphfit.tools.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m graphfit.tools.bench

sweep: $(STAMP)
	$(PY) -m graphfit.tools.sweep --config tools/sweep_configs/ablation.json

# Debian's offline Bazel and the rule sets WORKSPACE points at (DESIGN.md §7).
bazel-deps:
	@(command -v bazel && test -d /usr/share/bazel/rules/java && test -d /usr/share/bazel/tools/platforms) >/dev/null \
	  || (apt-get update -qq && apt-get install -y -qq bazel-bootstrap bazel-rules-java bazel-platforms)

bazel: $(STAMP) bazel-deps
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bazel build :train //tools:communication_benchmark

clean:
	rm -rf $(VENV) bazel-* .pytest_cache
