#!/bin/sh
# The export job (compose `export` service, Kubernetes init container): write each default model
# into the model repository unless the repository already has a version of it, so a restart or a
# second `docker compose up` reuses the models instead of exporting them again.
#
#   ATTNSERVE_MODEL_REPOSITORY   the repository, the same variable the server reads (default: models)
#   EXPORT_PRESETS               presets to export (default: "self_attention cross_attention")
#   PYTHON                       the interpreter (default: python)
#   ATTNSERVE                    the command (default: attnserve)
#
# "Has a version" is decided by the contract's own code (attnserve.contract.versions: an integer
# directory holding model.onnx), so this job and the server cannot disagree about it. An
# interrupted export leaves no version behind (attnserve export writes aside, then renames).
set -eu

repository="${ATTNSERVE_MODEL_REPOSITORY:-models}"
presets="${EXPORT_PRESETS:-self_attention cross_attention}"
python="${PYTHON:-python}"
attnserve="${ATTNSERVE:-attnserve}"

mkdir -p "$repository"
for preset in $presets; do
    if "$python" -c 'import sys; from pathlib import Path; from attnserve.contract import versions; sys.exit(0 if versions(Path(sys.argv[1])) else 1)' "$repository/$preset"; then
        echo "$repository/$preset has a version; not exporting"
    else
        echo "exporting $preset into $repository"
        "$attnserve" export --preset "$preset" --repository "$repository"
    fi
done
