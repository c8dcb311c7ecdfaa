"""Fetch the Kafka broker's jars listed in docker/kafka-jars.lock from a Maven repository into a
folder, checking each sha256 (what `sao broker` runs in the image, without Maven in the image).

Usage: python3 fetch_jars.py LOCK REPOSITORY_URL DEST
"""

import hashlib
import sys
import urllib.request
from pathlib import Path


def main(lock: str, repo: str, dest: str) -> None:
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    for line in Path(lock).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        path, sha256 = line.split()
        with urllib.request.urlopen(f"{repo.rstrip('/')}/{path}", timeout=120) as r:
            data = r.read()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise SystemExit(f"{path}: sha256 mismatch")
        (out / path.rsplit("/", 1)[1]).write_bytes(data)


if __name__ == "__main__":
    main(*sys.argv[1:])
