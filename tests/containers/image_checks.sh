#!/usr/bin/env bash
# What each built image must be (run by run.sh after the builds; CONTAINERS_CONF set by it).
set -euo pipefail
fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { echo "PASS: $*"; }
inspect() { podman image inspect --format "$2" "$1"; }
in_image() { local image=$1; shift; podman run --rm --network none --no-healthcheck --entrypoint python "$image" -c "$@"; }

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
    podman run --rm --network none --no-healthcheck --entrypoint sh "$image" -c '! command -v gcc && ! command -v cc' >/dev/null \
        || fail "$image has a compiler"
    podman run --rm --network none --no-healthcheck --entrypoint sh "$image" -c '[ ! -e /usr/include/grpc++ ] && ! command -v protoc' \
        || fail "$image has the native data plane's build dependencies (gRPC headers or protoc)"
done
pass "serving images: HEALTHCHECK runs /opt/attnserve/healthcheck.py (grpc.health.v1), SIGTERM stops, no torch, no compiler, no gRPC headers"

# The native data plane: built in the build stage, it loads in each serving image with only the
# run-time libraries (compose_check.py serves calls on it).
for image in attnserve:cpu attnserve:cuda-standin; do
    so=$(podman run --rm --network none --no-healthcheck --entrypoint sh "$image" -c 'ls /opt/venv/lib/python3*/site-packages/attnserve/server/_native*.so')
    missing=$(podman run --rm --network none --no-healthcheck --entrypoint ldd "$image" "$so" | grep 'not found' || true)
    [ -z "$missing" ] || fail "$image: $so links libraries the image lacks: $missing"
done
pass "attnserve:cpu, attnserve:cuda-standin: the native data plane's extension is in the image and ldd finds every library it links"

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

# The CUDA provider must link the CUDA major version of the base the Dockerfile names
# (onnxruntime-gpu >= 1.27 on PyPI links CUDA 13: it would not load on the CUDA 12 base).
cuda_major=$(sed -n 's/^ARG CUDA_IMAGE=nvidia\/cuda:\([0-9]*\)\..*/\1/p' deploy/Dockerfile.cuda)
linked=$(podman run --rm --network none --no-healthcheck --entrypoint sh attnserve:cuda-standin -c \
    'ldd /opt/venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime_providers_cuda.so' | grep -o 'libcudart\.so\.[0-9]*' | sort -u)
[ "$linked" = "libcudart.so.$cuda_major" ] || fail "the CUDA provider links $linked, the base image (CUDA_IMAGE) is CUDA $cuda_major"
pass "attnserve:cuda-standin: the CUDA provider links libcudart.so.$cuda_major, the CUDA major version of CUDA_IMAGE"
