"""Weight swap latency of the `hf` backend for SmolLM2-135M: from publishing the announcement on
`sao.weights` to the first token sampled on the new version, while the generator keeps decoding,
against a bare `safetensors.torch.load_file` of the same file measured in the same run.

The swap path is the producer's: the subscription reads the announcement, checks size and
sha256 of the ~0.65 GB float32 file, loads it, and the generator swaps it in at the next decode
step. The baseline, "bare load", is `load_state_dict(load_file(path))` alone (load_file by itself
only maps the file); sha256 is timed alone too. Warm page cache, as in the swaps. Uses the embedded broker unless SAO_KAFKA_BOOTSTRAP is set.

    .venv/bin/python bench/weight_swap.py [--swaps 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from producers.envs.chat import Chat  # noqa: E402
from producers.generate.base import SamplingParams  # noqa: E402
from producers.generate.hf import HFGenerator  # noqa: E402
from producers.models import load_model  # noqa: E402
from schemas.tokenizers import load_tokenizer  # noqa: E402
from producers.weights import WeightSubscriber, sha256_file  # noqa: E402
from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.kafka import KafkaConfig, ensure_topics, make_producer, produce  # noqa: E402
from schemas.messages import Weights  # noqa: E402


def timed(fn, repeats: int = 3) -> float:
    """Median seconds of `fn()`."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_variant(model: torch.nn.Module, path: Path, scale: float) -> Weights:
    """A slightly different copy of the model's weights, and its announcement (version unset)."""
    state = {k: (v * scale).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path))
    return Weights(version=0, step=0, uri=path.resolve().as_uri(), sha256=sha256_file(path),
                   num_bytes=path.stat().st_size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--swaps", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sao-swap-"))
    broker = None
    if not os.environ.get("SAO_KAFKA_BOOTSTRAP"):
        broker = EmbeddedBroker(BrokerConfig(data_dir=tmp / "kafka", port=0))
        broker.start()
    kafka = KafkaConfig(bootstrap=os.environ.get("SAO_KAFKA_BOOTSTRAP") or broker.bootstrap,
                        topic_prefix=f"bench{uuid.uuid4().hex[:8]}")
    ensure_topics(kafka, [T.WEIGHTS])
    model = load_model("smollm2")
    files = [write_variant(model, tmp / f"w{i}.safetensors", 1.0 + 1e-3 * (i + 1)) for i in range(2)]
    path = Path(files[0].uri[len("file://"):])
    state = load_file(str(path))
    lazy, sha = timed(lambda: load_file(str(path))), timed(lambda: sha256_file(path))
    bare = timed(lambda: model.load_state_dict(load_file(str(path))))  # the baseline: file -> model
    del state

    gen = HFGenerator(model, seed=0)
    marks: list[tuple[float, int]] = []  # (time, version) of every decode step
    model.register_forward_hook(lambda *_: marks.append((time.time(), gen.version)))
    sub = WeightSubscriber(kafka, gen).start()
    assert sub.caught_up.wait(60)
    stop = threading.Event()
    prompt = Chat(load_tokenizer("smollm2")).prompt_ids([{"role": "user", "content": "Count to fifty."}])

    def decode():  # the producer keeps generating while weights arrive
        while not stop.is_set():
            gen.generate(prompt, SamplingParams(max_tokens=32))

    decoder = threading.Thread(target=decode, daemon=True)
    decoder.start()
    producer = make_producer(kafka)
    latencies = []
    try:
        for v in range(1, args.swaps + 1):
            time.sleep(2.0)  # steady decoding before each announcement
            w = files[v % 2]
            w = Weights(version=v, step=v, uri=w.uri, sha256=w.sha256, num_bytes=w.num_bytes)
            t0 = time.time()
            produce(producer, kafka.topic(T.WEIGHTS), w.encode(), key=w.key)
            producer.flush(30)
            while marks[-1][1] != v:
                time.sleep(0.005)
            latencies.append(next(t for t, version in marks if version == v) - t0)
    finally:
        stop.set()
        decoder.join(60)
        sub.close()
        if broker is not None:
            broker.close()
    gib = files[0].num_bytes / 2**30
    print(f"# bench/weight_swap.py  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"# host: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); SmolLM2-135M float32 state dict, {gib:.3f} GiB file, "
          f"warm page cache; broker: {'embedded Apache Kafka' if broker else kafka.bootstrap}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"load_file (lazy mmap)                 {lazy:7.3f} s")
    print(f"sha256 of the file                    {sha:7.3f} s")
    print(f"bare load: load_file + load_state_dict {bare:7.3f} s   <- baseline")
    for v, lat in enumerate(latencies, 1):
        print(f"swap v{v}: announce -> first token on v{v}  {lat:7.3f} s   ({lat / bare:5.2f}x bare load)")
    med = statistics.median(latencies)
    print(f"median swap latency                   {med:7.3f} s   = {med / bare:.2f}x bare load "
          f"(loaded {sub.counts['loaded']}, rejected {sub.counts['rejected']})")


if __name__ == "__main__":
    main()
