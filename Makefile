# The two commands of the README: `make train` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HUB_PINS := keras-hub==0.32.0 regex==2026.12.2 tokenizers==0.23.3
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup train test bench bazel bazel-deps sweep clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	# pyproject's `hub` extra, without its requirements (they would replace tensorflow-cpu).
	$(PY) -m pip install -q --no-deps $(HUB_PINS)
	touch $@

# The main job: an mlp step (16 layers of 256, batch 2048) that peaks at 40 MiB on one device
# is fitted over four devices of 10.5 MiB each (virtual CPUs without GPUs). It fits neither on one
# device nor by placement alone, nor rematerialized to one 10.5 MiB device; the joint search
# (pipeline.joint) picks the remat budget and the placement together, trains a few steps and
# prints planned against measured peaks per device; the report a person reads goes to
# out/train_report/summary.md. Override with e.g. `make train ARGS="--model_name=resnet"`.
ARGS ?= --model_name=mlp --batch_size=2048 --model_arg=depth=16 --model_arg=width=256 \
	--model_arg=input_dim=256 --num_devices=4 --device_memory=10.5MiB --joint \
	--steps=5 --report_dir=out/train_report
train: $(STAMP)
	$(PY) -m graphfit.tools.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 tests

bench: $(STAMP)
	$(PY) -m graphfit.bench

sweep: $(STAMP)
	$(PY) -m graphfit.tools.sweep --config tools/sweep_configs/ablation.json

# Debian's offline Bazel and the rule sets WORKSPACE points at (docs/DESIGN.md §7).
bazel-deps:
	@(command -v bazel && test -d /usr/share/bazel/rules/java && test -d /usr/share/bazel/tools/platforms) >/dev/null \
	  || (apt-get update -qq && apt-get install -y -qq bazel-bootstrap bazel-rules-java bazel-platforms)

bazel: $(STAMP) bazel-deps
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bazel build :train //tools:communication_benchmark

clean:
	rm -rf $(VENV) bazel-* .pytest_cache
