# Set-up and everyday commands. `make serve` and `make test` install on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# NVIDIA's tritonclient needs protobuf < 7, our stubs >= 7: it gets a virtualenv of its own,
# used only by the compatibility test.
COMPAT_VENV := .venv-tritonclient
COMPAT_STAMP := $(COMPAT_VENV)/.installed
# torch==2.13.0 (CPU) is read from /opt/wheels where that folder exists.
PIP_FIND_LINKS_OPT := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
MODELS ?= $(or $(ATTNSERVE_MODEL_REPOSITORY),models)
PRESETS := self_attention cross_attention

.PHONY: install test serve export proto clean

install: $(STAMP) $(COMPAT_STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=/path/to/python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_FIND_LINKS_OPT) -e '.[export,plot,dev]'
	touch $(STAMP)

$(COMPAT_STAMP):
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet 'tritonclient[grpc]==2.73.0'
	touch $(COMPAT_STAMP)

test: $(STAMP) $(COMPAT_STAMP)
	$(PY) -m pytest tests

# Export each default model unless the repository already has a version of it.
export: $(STAMP)
	@for preset in $(PRESETS); do \
	  if ls -d $(MODELS)/$$preset/[0-9]* >/dev/null 2>&1; then \
	    echo "$(MODELS)/$$preset exists; not exporting"; \
	  else \
	    $(PY) -m export --preset $$preset --repository $(MODELS) || exit $$?; \
	  fi; \
	done

serve: export
	exec $(PY) -m server --model-repository $(MODELS)

# Regenerate the checked-in gRPC stubs from proto/inference.proto.
proto: $(STAMP)
	$(PY) -m proto.generate

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .pytest_cache
