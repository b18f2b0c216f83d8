# Every target installs what it needs into .venv first, so a fresh machine needs only python3 + make.
VENV   ?= .venv
PY     := $(VENV)/bin/python
MSERVE := $(VENV)/bin/mserve
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error

.PHONY: install demo test test-quick bench-engine gpu-wheels clean image image-offline test-deploy

install: $(VENV)/.installed

# torch is pinned first on its own: 2.13.0 is the CPU wheel this machine kind has on disk; any other
# pin would pull a multi-GB CUDA build. pyproject's range accepts it, so nothing else replaces it.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,bench,video,audio,documents]'
	touch $@

models/tiny-llava/config.json: | install
	$(MSERVE) make-tiny-model models/tiny-llava --arch llava --size tiny

models/small-llava/config.json: | install
	$(MSERVE) make-tiny-model models/small-llava --arch llava --size small

demo: install models/tiny-llava/config.json
	$(PY) -m mserve.demo --model models/tiny-llava

test: install
	$(PY) -m pytest -q --durations=25

test-quick: install
	$(PY) -m pytest -q -m "not slow"

bench-engine: install models/small-llava/config.json
	$(MSERVE) bench engine --model models/small-llava --json-out bench/results/engine.json

# Images (deploy/README.md). `image`: the user's default, from python:3.11-slim and PyPI (needs registry
# access). `image-offline`: nothing pulled from a registry: a Debian base from mmdebstrap, every wheel from
# deploy/wheelhouse (filled by pip download first), the Redis image from Debian's redis-server.
MSERVE_IMAGE ?= mserve:cpu
BASE_IMAGE   ?= python:3.11-slim

image:
	docker build -f deploy/Dockerfile --build-arg BASE_IMAGE=$(BASE_IMAGE) -t $(MSERVE_IMAGE) .

image-offline:
	MSERVE_IMAGE=mserve:offline deploy/offline.sh tools images

# Real containers: starts a Docker engine when none answers (and stops it after), builds the offline
# images, runs tests/deploy/test_compose.py (never collected by `make test`).
test-deploy: install
	PYTHON=$(PY) MSERVE_IMAGE=mserve:offline deploy/offline.sh test

# The wheels the GPU machine's image lacks, for bench/gpu_check.py (bench/gpu_check.md): into .whl/.
gpu-wheels:
	bench/lab/gpu/wheels.sh .whl

clean:
	rm -rf $(VENV) models
