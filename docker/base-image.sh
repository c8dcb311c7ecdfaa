#!/usr/bin/env bash
# An offline stand-in for the official `python:3.11-slim-bookworm` image, for machines that reach
# Debian's packages but no image registry: `debootstrap --variant=minbase bookworm` plus Python,
# a JRE (the image can then run `sao broker`), libnuma (vLLM's CPU kernels link it, as the official
# image has it) and this machine's CA bundle, then `docker import`.
# Usage: docker/base-image.sh [TAG]   (default sao-base:bookworm-<hash of this script>, so an edit
# here makes a new base; nothing is done if it exists)
set -euo pipefail
tag=${1:-sao-base:bookworm-$(sha256sum "$0" | cut -c1-12)}
if docker image inspect "$tag" >/dev/null 2>&1; then echo "$tag"; exit 0; fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(mktemp -d /var/tmp/sao-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase \
  --include=python3,python3-venv,ca-certificates,openjdk-17-jre-headless,procps,libnuma1 \
  bookworm "$root" "$mirror" >&2
# trust what this machine trusts (a TLS-inspecting proxy's CA included), as users behind one must
install -m 0644 /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$tag" >&2
echo "$tag"
