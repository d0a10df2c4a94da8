#!/usr/bin/env bash
# What each built image must be (run by run.sh after the builds; CONTAINERS_CONF set by it).
set -euo pipefail
fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { echo "PASS: $*"; }
inspect() { podman image inspect --format "$2" "$1"; }
in_image() { local image=$1; shift; podman run --rm --network none --entrypoint python "$image" -c "$@"; }

for image in attnserve:cpu attnserve-export:cpu attnserve:cuda-standin; do
    [ "$(inspect "$image" '{{.Config.User}}')" = "10001:10001" ] || fail "$image does not run as 10001:10001"
done
pass "attnserve:cpu, attnserve-export:cpu, attnserve:cuda-standin run as 10001:10001"

for image in attnserve:cpu attnserve:cuda-standin; do
    test=$(inspect "$image" '{{json .Config.Healthcheck.Test}}')
    [ "$test" = '["CMD","python","/opt/attnserve/healthcheck.py"]' ] || fail "$image HEALTHCHECK is $test"
    [ "$(inspect "$image" '{{.Config.StopSignal}}')" = SIGTERM ] || fail "$image stop signal"
    in_image "$image" 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is not None)' \
        || fail "$image has torch"
    podman run --rm --network none --entrypoint sh "$image" -c '! command -v gcc && ! command -v cc' >/dev/null \
        || fail "$image has a compiler"
done
pass "serving images: HEALTHCHECK runs /opt/attnserve/healthcheck.py (grpc.health.v1), SIGTERM stops, no torch, no compiler"

in_image attnserve-export:cpu 'import torch, sys; print(torch.__version__); sys.exit(not (torch.__version__.startswith("2.13.0") and torch.version.cuda is None))' \
    || fail "attnserve-export:cpu does not have the CPU build of torch 2.13.0"
in_image attnserve-export:cpu 'import importlib.metadata as m, sys; sys.exit(any(d.metadata["Name"].startswith("nvidia-") for d in m.distributions()))' \
    || fail "attnserve-export:cpu has NVIDIA packages"
pass "attnserve-export:cpu: torch 2.13.0 CPU build, no nvidia-* packages"

providers=$(in_image attnserve:cuda-standin 'import importlib.metadata as m, onnxruntime as ort
names = {d.metadata["Name"].lower() for d in m.distributions()}
assert "onnxruntime-gpu" in names and "onnxruntime" not in names, names
print(",".join(ort.get_available_providers()))')
case ",$providers," in *,CUDAExecutionProvider,*) ;; *) fail "attnserve:cuda-standin providers: $providers" ;; esac
pass "attnserve:cuda-standin: onnxruntime-gpu in place of onnxruntime; providers $providers"
