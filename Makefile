# `make test` builds .venv from the project's own files, runs `make lint` (ruff, ruff format, mypy),
# then the whole suite.
# `make demo` runs the main job with the bundled SmolLM2-135M-Instruct model.
VENV ?= .venv
# The interpreter .venv is made from: the distribution's CPython 3.11 where there is one (Debian
# and Ubuntu build it with PGO and LTO into the executable), else `python3`. A source build
# without them (pyenv's default: a shared libpython, no PGO) ran the router's Python about 1.5x
# slower and cost it 4-22% more CPU per streamed token (docs/performance.md). The torch wheel on
# these machines is for 3.11; without its venv module (Debian's python3.11-venv) the distribution's
# is passed over. `make venv PYTHON=...` picks another.
PYTHON ?= $(shell /usr/bin/python3.11 -c 'import ensurepip, venv, sys; print(sys.executable)' 2>/dev/null || echo python3)
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: test test-containers demo lint venv bench clean proto

venv: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps -r requirements-nodeps.txt
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

# The fast checks: lint, format, types (mypy's settings are in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check pdserve tests
	$(VENV)/bin/ruff format --check pdserve tests
	$(VENV)/bin/mypy

# The suite runs on every core (pytest-xdist), a test file per worker at a time so a module's
# cluster starts once: 24 minutes in one process on a 2-core AVX2 EPYC, 18 on two workers, since
# many tests wait on processes starting. TEST_WORKERS=0 runs it in this process. The 25 slowest
# set-ups and tests are listed at the end: the suite must stay under 20 minutes here.
TEST_WORKERS ?= auto
test: lint
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=25

# deploy/docker-compose.yml in real containers (podman, its Docker API, Debian's docker-compose):
# builds the image of deploy/Dockerfile on a local Debian base (made once, then cached in
# ~/.cache/pdserve/containers), starts the cluster, checks it, kills a decode engine, takes it down.
# Installs podman, debootstrap and docker-compose from Debian when run as root; skips, saying why,
# where it cannot. About 4 minutes on 2 cores from nothing (CI: 3:53), 2-3 once the images are cached.
test-containers: $(STAMP)
	PDSERVE_CONTAINER_TESTS=1 $(PY) -m pytest -q -ra -p no:cacheprovider --log-cli-level=INFO \
		--log-cli-format='%(asctime)s %(name)s: %(message)s' tests/deploy/containers

demo: $(STAMP)
	$(PY) -m pdserve.demo

bench: $(STAMP)
	$(VENV)/bin/pdserve bench engine

# Regenerate the committed gRPC stubs (pdserve/v1/) after editing proto/ (a test checks they match).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/pdserve/v1/*.proto

clean:
	rm -rf $(VENV)
