"""Build the project image on a machine that reaches package registries but no image registry.

    python docker/build.py [--tag sao-stream:latest] [--base IMAGE] [--dockerfile Dockerfile]

1. the base image: `--base`, else `sao-base:bookworm-<hash>` made by docker/base-image.sh (debootstrap +
   `docker import`, about three minutes once) standing in for `python:3.11-slim-bookworm`;
2. the pinned wheels, fetched once into ~/.cache/sao-stream/wheelhouse (docker/wheelhouse.sh);
3. the Kafka jars from the cache `make install` filled;
4. `docker build --network host`, with the wheels and jars served on a loopback port for the
   duration (WHEELS_URL, KAFKA_JARS_URL): the build context stays the source tree (a few hundred
   KB), no wheel is baked into a layer it does not install, and Docker's layer cache makes a
   rebuild after a source change take seconds.
5. the image the tag named before, when the build replaced it and nothing else names it: every
   rebuild would otherwise leave 7 GB untagged in Docker's store, and a machine that runs the
   suite daily fills its disk in a week.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _script(name: str, *args: str) -> str:
    out = subprocess.run([str(ROOT / "docker" / name), *args], check=True, stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


def artifact_tree(wheels: Path, jars: Path, lock: Path, into: Path) -> None:
    """`into/wheels` -> the wheelhouse; `into/maven/<path>` -> each jar, in Maven's layout."""
    (into / "wheels").symlink_to(wheels)
    for line in lock.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            path = line.split()[0]
            (into / "maven" / path).parent.mkdir(parents=True, exist_ok=True)
            (into / "maven" / path).symlink_to(jars / path.rsplit("/", 1)[1])


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _image_id(ref: str) -> str | None:
    out = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return out.stdout.strip() or None


def _drop_replaced(previous: str | None, tag: str) -> None:
    """Remove `previous` if the build moved `tag` off it and no other tag names it."""
    if previous is None or previous == _image_id(tag):
        return
    tags = subprocess.run(["docker", "image", "inspect", "--format", "{{len .RepoTags}}", previous],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout.strip()
    if tags == "0":
        # refused while a container still uses it; that image then goes with a later build
        subprocess.run(["docker", "image", "rm", previous], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def build(tag: str, base: str | None, dockerfile: str, extra: list[str]) -> float:
    from sao.broker import BrokerConfig, fetch_jars

    base = base or _script("base-image.sh")
    wheels = Path(_script("wheelhouse.sh"))
    jars = fetch_jars(BrokerConfig().jar_cache)
    previous = _image_id(tag)
    with tempfile.TemporaryDirectory(prefix="sao-artifacts-") as tmp:
        artifact_tree(wheels, jars, ROOT / "docker" / "kafka-jars.lock", Path(tmp))
        # a fixed port: the URLs are build arguments, and a changed argument would void Docker's cache
        port = int(os.environ.get("SAO_ARTIFACT_PORT", "47831"))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(_Quiet, directory=tmp))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        t0 = time.monotonic()
        try:
            subprocess.run(["docker", "build", "--network", "host", "-f", str(ROOT / dockerfile), "-t", tag,
                            "--build-arg", f"BASE_IMAGE={base}", "--build-arg", f"WHEELS_URL={url}/wheels/",
                            "--build-arg", f"KAFKA_JARS_URL={url}/maven", *extra, str(ROOT)],
                           check=True, env={**os.environ, "DOCKER_BUILDKIT": "0"})
        finally:
            server.shutdown()
    _drop_replaced(previous, tag)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", default=os.environ.get("SAO_IMAGE", "sao-stream:latest"))
    ap.add_argument("--base", default=os.environ.get("SAO_BASE_IMAGE"))
    ap.add_argument("--dockerfile", default="Dockerfile")
    args, extra = ap.parse_known_args()
    seconds = build(args.tag, args.base, args.dockerfile, extra)
    print(f"built {args.tag} in {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
