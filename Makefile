# Set-up and everyday commands. `make serve` and `make test` install on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch==2.13.0 (CPU) is read from /opt/wheels where that folder exists.
# Editable installs leave the native data plane to `make native` (setup.py: no CMake run).
NO_NATIVE := ATTNSERVE_NATIVE_BUILD=off
PIP_FIND_LINKS_OPT := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
MODELS ?= $(or $(ATTNSERVE_MODEL_REPOSITORY),models)
PRESETS := self_attention cross_attention

.PHONY: native native-deps native-if-possible test-native-asan fuzz-native fuzz-deps install test test-fast test-python-plane test-native-plane docs lint test-ray test-containers test-ecosystem test-deps-oldest test-deps-newest serve export proto bench bench-goals bench-peers bench-stages bench-sweep bench-shm bench-ort-c bench-tools clean nginx

install: $(STAMP)

# Editable, without the native data plane (NO_NATIVE): `make native` builds it into server/ and
# rebuilds only what changed; `pip install .` builds it into the wheel.
$(STAMP): pyproject.toml setup.py
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=/path/to/python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(NO_NATIVE) $(PY) -m pip install --quiet $(PIP_FIND_LINKS_OPT) -e '.[export,plot,dev]'
	touch $(STAMP)

# The test servers serve on the default data plane: native where it is built (native-if-possible).
# In CI ($$CI set) a skipped test fails the run, unless it is a CUDA test, and so does a server
# that would fall back to the Python plane (tests/conftest.py).
test: $(STAMP) nginx native-if-possible
	ATTNSERVE_TEST_NO_SKIP=$${ATTNSERVE_TEST_NO_SKIP:-$${CI:-}} $(PY) -m pytest tests --ignore=tests/ray

# The tests that start no server, subprocess or container (marker `e2e`: tests/conftest.py).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not e2e" tests --ignore=tests/ray

# The server's tests (the e2e tier) with every test server on the Python data plane, which `make test`
# no longer runs where the native one is built: tests/server_process.py adds --data-plane python
# unless a test chooses its plane (docs/testing.md). PLANE_TESTS narrows it.
PLANE_TESTS ?= -m e2e tests --ignore=tests/ray --ignore=tests/containers
test-python-plane: $(STAMP) nginx
	ATTNSERVE_TEST_DATA_PLANE=python ATTNSERVE_TEST_NO_SKIP=$${ATTNSERVE_TEST_NO_SKIP:-$${CI:-}} \
	  $(PY) -m pytest -q $(PLANE_TESTS)

# The same tier with --data-plane native given to every test server (a failure to build fails here);
# `make test` runs it so where the plane is built. NATIVE_PLANE_TESTS narrows it.
NATIVE_PLANE_TESTS ?= $(PLANE_TESTS)
test-native-plane: $(STAMP) nginx native
	ATTNSERVE_TEST_DATA_PLANE=native ATTNSERVE_TEST_NO_SKIP=$${ATTNSERVE_TEST_NO_SKIP:-$${CI:-}} \
	  $(PY) -m pytest -q $(NATIVE_PLANE_TESTS)

# The documentation site (mkdocs.yml, docs/) into build/site; strict: a broken link or reference fails.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(NO_NATIVE) $(PY) -m pip install --quiet $(PIP_FIND_LINKS_OPT) -e '.[docs]'
	touch $@
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# tests/ray/ against a local Ray cluster each test module starts and stops (loopback, fractional
# CPUs): the ray extra goes into .venv (quicker than a virtualenv of its own: docs/ray.md).
RAY_STAMP := $(VENV)/.installed-ray
# Without hypothesis's plugin: importing it under the assertion rewriter while Ray's threads
# start tripped CPython 3.11's "AST constructor recursion depth mismatch" (tests/ray need neither).
test-ray: $(RAY_STAMP)
	$(PY) -m pytest -p no:hypothesispytest tests/ray

$(RAY_STAMP): $(STAMP)
	$(NO_NATIVE) $(PY) -m pip install --quiet $(PIP_FIND_LINKS_OPT) -e '.[export,plot,dev,ray]'
	touch $@

# Every image built and docker-compose.yml run for real, with Debian's podman (needs root; a few
# minutes): stand-in base images from Debian's packages (no registry here), the serve, export and
# CUDA images, the compose topology's checks (tests/containers/compose_check.py), hadolint and
# kubernetes-validate. tests/containers/run.sh says what each step proves and what it cannot.
test-containers: $(STAMP)
	tests/containers/run.sh

# attnserve as users install it beside the rest of the Open Inference Protocol ecosystem: in a
# virtualenv made anew each run (pip's cache is reused; no torch), `pip install . 'tritonclient[grpc]'
# kserve proto-plus` must resolve; then tests/compat/ecosystem_check.py serves $(MODELS) with that
# virtualenv's `attnserve serve` and checks our client, tritonclient and KServe's client against
# it, proto-plus beside us, and what `pip uninstall attnserve` leaves (one PASS/FAIL line each).
ECOSYSTEM_VENV := .venv-ecosystem
test-ecosystem: export
	rm -rf $(ECOSYSTEM_VENV) build/lib build/lib.* build/bdist.*  # setuptools' in-tree build dirs would keep removed files
	$(PYTHON) -m venv $(ECOSYSTEM_VENV)
	$(ECOSYSTEM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(ECOSYSTEM_VENV)/bin/python -m pip install --quiet . 'tritonclient[grpc]' kserve proto-plus
	$(ECOSYSTEM_VENV)/bin/python tests/compat/ecosystem_check.py --model-repository $(MODELS)

# Both ends of the declared dependency ranges (pyproject.toml), each in a virtualenv made anew:
# test-deps-oldest pins every run-time dependency to its lower bound (read from pyproject.toml by
# tests/compat/lower_bounds.py: protobuf==6.30.0, grpcio==1.72.1, ...); test-deps-newest lets pip
# take the newest of each (protobuf 7, grpcio-health-checking/-reflection that need it), which
# the main .venv cannot have: tritonclient and grpcio-tools 1.72.1 in the dev extra hold it at
# protobuf<7. Each runs the tests of the stubs, the server and the clients (minus the stubs'
# regeneration, which needs grpcio-tools) against models exported by the main .venv, so no
# exporter (onnx, onnxscript) enters these virtualenvs; torch does, from the local wheel, as the
# eager reference the parity tests compare with (it depends on neither numpy nor protobuf).
DEPS_CONSTRAINTS_oldest := $(PYTHON) tests/compat/lower_bounds.py
DEPS_CONSTRAINTS_newest := true
DEPS_MODELS := build/test-models
DEPS_TESTS := tests/test_proto_stubs.py tests/test_server.py tests/test_client.py \
  tests/test_client_transport.py tests/test_security.py tests/test_limits.py tests/test_engine.py \
  --deselect tests/test_proto_stubs.py::test_checked_in_stubs_match_fresh_generation
DEPS_SHOWN := protobuf grpcio grpcio-health-checking grpcio-reflection numpy onnxruntime prometheus-client
test-deps-oldest test-deps-newest: test-deps-%: $(STAMP)
	@$(MAKE) --no-print-directory export MODELS=$(DEPS_MODELS)
	rm -rf .venv-deps-$*
	$(PYTHON) -m venv .venv-deps-$*
	$(DEPS_CONSTRAINTS_$*) > .venv-deps-$*/constraints.txt
	.venv-deps-$*/bin/python -m pip install --quiet --upgrade pip
	$(NO_NATIVE) .venv-deps-$*/bin/python -m pip install --quiet $(PIP_FIND_LINKS_OPT) -c .venv-deps-$*/constraints.txt -e . \
	  'torch==2.13.0' 'pytest>=8' 'pytest-timeout>=2.3'
	@.venv-deps-$*/bin/python -c 'import importlib.metadata as m, sys; \
	  print("test-deps-$*: " + ", ".join(n + " " + m.version(n) for n in sys.argv[1:]))' $(DEPS_SHOWN)
	ATTNSERVE_TEST_DATA_PLANE=python ATTNSERVE_TEST_MODEL_REPOSITORY=$(abspath $(DEPS_MODELS)) \
	  .venv-deps-$*/bin/python -m pytest -q $(DEPS_TESTS)

# The native data plane (native/, docs/native-data-plane.md): attnserve.server._native into server/
# (git-ignored), with CMake, Debian's gRPC C++ and pybind11 (the `native` extra). build/native is
# also where `pip install .` builds (setup.py), so each reuses the other's objects: the module's
# folder and whether a missing dependency fails are given on each configure, never left cached.
NATIVE_BUILD := build/native
NATIVE_DEBS := cmake g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc
native: $(STAMP) native-deps
	@$(PY) -c 'import pybind11' 2>/dev/null || $(NO_NATIVE) $(PY) -m pip install --quiet $(PIP_FIND_LINKS_OPT) -e '.[export,plot,dev,native]'
	cmake -S native -B $(NATIVE_BUILD) -DPython_EXECUTABLE=$(abspath $(PY)) \
	  -DATTNSERVE_MODULE_DIR=$(abspath server) -DATTNSERVE_NATIVE_OPTIONAL=OFF \
	  -Dpybind11_DIR="$$($(PY) -c 'import pybind11; print(pybind11.get_cmake_dir())')"
	cmake --build $(NATIVE_BUILD) -j

# The native plane under AddressSanitizer and UBSan (docs/native-build.md, "Sanitizers and
# fuzzing"): the extension into build/native-asan/site, loaded there by native/asan/sitecustomize.py
# (server/_native*.so is left alone), and the native tests run with libasan preloaded into Python.
# A sanitizer report stops the process it is in and fails the run, whatever the tests said. The
# models are exported beforehand, outside the sanitizers (torch's export under them outlasts the
# tests' timeout).
NATIVE_ASAN_BUILD := build/native-asan
NATIVE_ASAN_TESTS ?= tests/test_native_plane.py tests/test_native_control.py tests/test_native_models.py \
  tests/test_native_limits.py tests/test_native_security.py tests/test_native_waits.py \
  tests/test_native_records.py tests/test_native_relay.py tests/test_fuzz.py tests/test_hostile_grpc.py \
  tests/test_mask_shapes.py \
  tests/test_bench_goals.py::test_the_native_floor_answers_zeros_from_its_own_thread_with_handoff
# libstdc++ preloaded too: else ASan, starting before anything loads it, cannot intercept
# __cxa_throw and aborts at the first C++ exception (onnx's, at import).
NATIVE_ASAN_ENV = LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libstdc++.so)" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:log_path=$(abspath $(NATIVE_ASAN_BUILD))/reports/asan \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$(abspath $(NATIVE_ASAN_BUILD))/reports/ubsan \
  PYTHONPATH=$(abspath $(NATIVE_ASAN_BUILD))/site
test-native-asan: $(STAMP) native-deps export
	@$(PY) -c 'import pybind11' 2>/dev/null || $(NO_NATIVE) $(PY) -m pip install --quiet $(PIP_FIND_LINKS_OPT) -e '.[export,plot,dev,native]'
	cmake -S native -B $(NATIVE_ASAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTNSERVE_SANITIZE=address,undefined \
	  -DATTNSERVE_MODULE_DIR=$(abspath $(NATIVE_ASAN_BUILD))/site -DPython_EXECUTABLE=$(abspath $(PY)) \
	  -Dpybind11_DIR="$$($(PY) -c 'import pybind11; print(pybind11.get_cmake_dir())')"
	cmake --build $(NATIVE_ASAN_BUILD) -j
	cp native/asan/sitecustomize.py $(NATIVE_ASAN_BUILD)/site/
	rm -rf $(NATIVE_ASAN_BUILD)/reports && mkdir -p $(NATIVE_ASAN_BUILD)/reports
	$(NATIVE_ASAN_ENV) $(PY) -c 'from attnserve.server import _native as n; assert "native-asan" in n.__file__, n.__file__'
	@$(NATIVE_ASAN_ENV) ATTNSERVE_TEST_NO_SKIP=1 ATTNSERVE_TEST_MODEL_REPOSITORY=$(abspath $(MODELS)) $(PY) -m pytest -q -p no:cacheprovider $(NATIVE_ASAN_TESTS); rc=$$?; \
	if [ -n "$$(ls -A $(NATIVE_ASAN_BUILD)/reports)" ]; then \
	  cat $(NATIVE_ASAN_BUILD)/reports/*; echo "test-native-asan: sanitizer reports above ($(NATIVE_ASAN_BUILD)/reports)"; exit 1; \
	fi; exit $$rc

# A libFuzzer target over the wire parser, contract checks, batching and split (native/fuzz/), with
# ASan and UBSan, seeded with tests/test_fuzz.py's cases; a bounded run: FUZZ_SECONDS (or FUZZ_RUNS).
# New inputs it finds are kept in build/native-fuzz/corpus; a crash is written there as crash-*.
NATIVE_FUZZ_BUILD := build/native-fuzz
FUZZ_SECONDS ?= 60
FUZZ_RUNS ?= -1
FUZZ_DEBS := clang libclang-rt-dev
fuzz-native: $(STAMP) native-deps fuzz-deps
	cmake -S native -B $(NATIVE_FUZZ_BUILD) -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DATTNSERVE_MODULE=OFF -DATTNSERVE_FUZZER=ON -DATTNSERVE_SANITIZE=address,undefined
	cmake --build $(NATIVE_FUZZ_BUILD) -j --target plane_fuzzer
	$(PY) native/fuzz/seeds.py $(NATIVE_FUZZ_BUILD)
	mkdir -p $(NATIVE_FUZZ_BUILD)/corpus
	cd $(NATIVE_FUZZ_BUILD) && ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 ./plane_fuzzer \
	  -max_total_time=$(FUZZ_SECONDS) -runs=$(FUZZ_RUNS) -max_len=65536 -print_final_stats=1 -artifact_prefix=corpus/ \
	  corpus seeds

# clang and its libFuzzer runtime, installed when missing and we are root.
fuzz-deps:
	@if command -v clang++ >/dev/null \
	  && [ -f "$$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing clang and libFuzzer for make fuzz-native: $(FUZZ_DEBS)"; \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $(FUZZ_DEBS); \
	else echo "make fuzz-native needs clang with libFuzzer ($(FUZZ_DEBS), Debian names)"; exit 1; fi

# `make serve` and `make test` build the native plane where they can (root, or the Debian packages
# present), so that it serves (--data-plane auto) and its tests run; elsewhere it says why, the
# Python plane serves and tests/test_native_plane.py skips (outside CI: tests/conftest.py).
native-if-possible:
	@if [ "$$(id -u)" = 0 ] || { command -v grpc_cpp_plugin >/dev/null && pkg-config --exists grpc++ 2>/dev/null; }; then \
	  $(MAKE) --no-print-directory native; \
	else echo "not building the native data plane: not root and Debian's libgrpc++-dev / protobuf-compiler-grpc" \
	  "are missing; the Python data plane serves"; fi

# Debian's build dependencies of `make native`, installed when missing and we are root.
native-deps:
	@if command -v cmake >/dev/null && command -v g++ >/dev/null && command -v grpc_cpp_plugin >/dev/null \
	  && pkg-config --exists grpc++ 2>/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing the native data plane's build dependencies: $(NATIVE_DEBS)"; \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $(NATIVE_DEBS); \
	else \
	  echo "make native needs $(NATIVE_DEBS) (Debian names); tests/test_native_plane.py skips without it"; exit 1; \
	fi

# tests/test_deploy_nginx.py runs a real nginx (deploy/nginx/nginx.conf). Install the Debian
# package when it is missing and we are root; otherwise say so (that test then skips).
nginx:
	@if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "nginx is not installed: apt-get update && apt-get install -y nginx"; \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nginx; \
	else \
	  echo "nginx is not installed and this is not root with apt-get: tests/test_deploy_nginx.py will skip"; \
	fi

# Export each default model unless the repository already has a version of it.
export: $(STAMP)
	@for preset in $(PRESETS); do \
	  if ls -d $(MODELS)/$$preset/[0-9]* >/dev/null 2>&1; then \
	    echo "$(MODELS)/$$preset exists; not exporting"; \
	  else \
	    $(VENV)/bin/attnserve export --preset $$preset --repository $(MODELS) || exit $$?; \
	  fi; \
	done

# On the native data plane where it can be built (native-if-possible), else the Python one: the
# start line says which, and a line before it why not native (--data-plane auto).
serve: export native-if-possible
	exec $(VENV)/bin/attnserve serve --model-repository $(MODELS)

# The benchmark (bench/): issue 26's goals first (bench/goals.py: native and grpc.aio floors, both
# planes, REST, in-process ONNX Runtime, alternating rounds; GOALS_ARGS="--rounds 3 --seconds 3"),
# then the server vs in-process ONNX Runtime under load, the sequence-length sweep (bench/sweep.py:
# one request per length, eager PyTorch, in-process ONNX Runtime unfused and fused, the server; a
# fresh process per configuration) and the workers' scaling; figures in bench/results/.
BENCH_VENV := .venv-bench
bench: export bench-tools
	@$(PY) -c 'from attnserve.server.native import why_unavailable as w; raise SystemExit(w() is not None)' || \
	  echo "bench: the native data plane is not built (make native): no native floor, native plane or goals"
	$(PY) -m bench.goals --repository $(MODELS) $(GOALS_ARGS)
	$(PY) -m bench --repository $(MODELS) $(BENCH_ARGS)
	$(PY) -m bench.sweep --repository $(MODELS) $(SWEEP_ARGS)
	$(PY) -m bench.scaling --repository $(MODELS) $(SCALING_ARGS)

# Issue 26's goals alone (a few minutes): bench/goals.py, GOALS_ARGS as above.
bench-goals: export bench-tools
	$(PY) -m bench.goals --repository $(MODELS) $(GOALS_ARGS)

# The goals with PyTriton beside them at c=32 (bench/pytriton_peer.py: the same ONNX graphs in a
# PyTriton Python model, Triton's dynamic batcher), in the same run. PyTriton (Triton's server
# binary inside its wheel) goes into a virtualenv of its own, with our onnxruntime's version.
PYTRITON_VENV := build/pytriton-venv
PYTRITON_VERSION ?= 0.7.0
bench-peers: export bench-tools $(PYTRITON_VENV)/.installed
	$(PY) -m bench.goals --repository $(MODELS) --peers pytriton $(GOALS_ARGS)

$(PYTRITON_VENV)/.installed: $(STAMP)
	$(PYTHON) -m venv $(PYTRITON_VENV)
	$(PYTRITON_VENV)/bin/python -m pip install --quiet 'nvidia-pytriton==$(PYTRITON_VERSION)' \
	  "onnxruntime==$$($(PY) -c 'import onnxruntime; print(onnxruntime.__version__)')"
	touch $@

# Where a native-plane request's time goes (bench/stages.py: the plane's own counters per stage, a
# fresh server per model, --batches-in-flight value and concurrency); STAGES_ARGS="--device cuda
# --batches-in-flight 1,2". JSON to bench/results/stages-<device>.json.
bench-stages: export bench-tools
	$(PY) -m bench.stages --repository $(MODELS) $(STAGES_ARGS)

bench-sweep: export
	$(PY) -m bench.sweep --repository $(MODELS) $(SWEEP_ARGS)

# Issue 30's ratio alone (under a minute): self_attention (1, 4096, 512), `output` through system
# shared memory, timed in alternating rounds against in-process fused ONNX Runtime; one JSON line.
SHM_ROUNDS ?= 10
bench-shm: export
	$(PY) -m bench.sweep --one pair --shared-memory --model self_attention --q-len 4096 --k-len 4096 \
	  --pair-rounds $(SHM_ROUNDS) --repository $(MODELS)

# Issue 26's question of where the run lives (under a minute): ONNX Runtime's Python session, as the
# native plane's runner calls it, against its C API from a small C++ program (bench/ort_c), per
# batch, in alternating rounds; JSON to bench/results/ort-c.json. The wheel ships no C headers:
# the first build reads them from $ORT_C_HEADERS (docs/performance.md, bench.ort_c). ORT_C_ARGS="--rounds 5".
bench-ort-c: export
	$(PY) -m bench.ort_c --repository $(MODELS) $(ORT_C_ARGS)

# NVIDIA's perf_analyzer: its binary ships in tritonclient 2.45's wheel; it links libcudart.so.12
# (pip: nvidia-cuda-runtime-cu12, no GPU needed) and libb64 (Debian: libb64-0d). If it cannot be
# installed, the benchmark falls back to its own multi-process load generator.
bench-tools: $(BENCH_VENV)/.installed
$(BENCH_VENV)/.installed:
	-@ldconfig -p | grep -q libb64.so.0d || { [ "$$(id -u)" = 0 ] && echo "installing libb64-0d for perf_analyzer" && \
	  (apt-get install -y -q libb64-0d >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q libb64-0d >/dev/null)); }
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --no-deps 'tritonclient==2.45.0' 'nvidia-cuda-runtime-cu12==12.9.79'
	touch $@

# Regenerate the checked-in gRPC stubs from proto/inference.proto.
proto: $(STAMP)
	$(PY) -m attnserve.proto.generate

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(ECOSYSTEM_VENV) .venv-deps-oldest .venv-deps-newest .venv-containers .pytest_cache
