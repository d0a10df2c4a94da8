# Set-up and everyday commands. `make serve` and `make test` install on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch==2.13.0 (CPU) is read from /opt/wheels where that folder exists.
PIP_FIND_LINKS_OPT := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
MODELS ?= models
PRESETS := self_attention cross_attention

.PHONY: install test serve export proto clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=/path/to/python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_FIND_LINKS_OPT) -e '.[export,plot,dev]'
	touch $(STAMP)

test: $(STAMP)
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
	rm -rf $(VENV) .pytest_cache
