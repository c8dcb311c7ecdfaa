"""Weight publication latency and host memory for SmolLM2-135M-sized weights, against a bare
safetensors save of the gathered state dict.

Publication = gather the FSDP2-sharded policy a bucket at a time and stream each bucket into the
weight store's file (safetensors, sha256, fsync, rename), announce it on `sao.weights` and wait for
the broker's ack; timed until a consumer on the topic has the announcement. The base: gathering the
whole state dict, then `save_file` of it to the same disk, measured in the same run. Host memory:
peak resident bytes added during each (bench/rss.py). Random weights with SmolLM2-135M's shape
(no 16 s GGUF dequantisation needed for a size benchmark).
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rss import PeakRSS  # noqa: E402
from bench.shapes import SMOLLM2_135M  # noqa: E402
from learner.parallel import (ParallelConfig, gather_buckets, init_distributed, parallelize,  # noqa: E402
                              parameter_specs)
from learner.store import WeightStore  # noqa: E402
from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer, make_producer, produce  # noqa: E402
from schemas.messages import Weights  # noqa: E402

ROUNDS = 5


def main() -> None:
    init_distributed("cpu")
    policy = parallelize(LlamaForCausalLM(SMOLLM2_135M), ParallelConfig())
    n_params = sum(p.numel() for p in policy.parameters())
    with EmbeddedBroker(BrokerConfig(port=0)) as broker, tempfile.TemporaryDirectory(dir=".") as tmp:
        cfg = KafkaConfig(bootstrap=broker.bootstrap, topic_prefix=f"w{uuid.uuid4().hex[:6]}", settings={})
        ensure_topics(cfg)
        seen: dict[int, float] = {}
        ready = threading.Event()

        def watch():
            consumer = make_consumer(cfg, "watch", **{"fetch.wait.max.ms": 10})
            consumer.subscribe([cfg.topic(T.WEIGHTS)], on_assign=lambda *_: ready.set())
            while len(seen) < ROUNDS:
                msg = consumer.poll(0.05)
                if msg is not None and msg.error() is None:
                    seen[Weights.decode(msg.value()).version] = time.perf_counter()
            consumer.close()

        threading.Thread(target=watch, daemon=True).start()
        ready.wait(60)
        store, producer = WeightStore(Path(tmp) / "weights", keep=2), make_producer(cfg)
        produce(producer, cfg.topic(T.PROMPTS), b"warm-up")  # acquire the idempotent producer id
        producer.flush(30)
        publish, bare, size, publish_mem, bare_mem = [], [], 0, 0, 0
        bucket = 32 << 20
        for version in range(ROUNDS):
            t0 = time.perf_counter()
            with PeakRSS() as memory:
                w = store.save(parameter_specs(policy), gather_buckets(policy, bucket), version, step=version)
            produce(producer, cfg.topic(T.WEIGHTS), w.encode(), key=w.key)
            producer.flush(30)
            while version not in seen:
                time.sleep(0.001)
            publish.append(seen[version] - t0)
            publish_mem, size = max(publish_mem, memory.added), w.num_bytes
            t0 = time.perf_counter()
            with PeakRSS() as memory:
                state = {name: t for b in gather_buckets(policy, 1 << 62) for name, t in b}
                state.pop("lm_head.weight", None)  # tied to the embeddings: save_file refuses shared tensors
                save_file(state, Path(tmp) / "bare.safetensors")
                del state
            bare.append(time.perf_counter() - t0)
            bare_mem = max(bare_mem, memory.added)
    print(f"weight_publish: SmolLM2-135M shape, {n_params / 1e6:.0f}M params, {size / 1e6:.0f} MB fp32, "
          f"{ROUNDS} rounds (median)  [{platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}]")
    print(f"{'path':<52}{'seconds':>9}{'x bare':>8}{'host MB added':>15}{'x bare':>8}")
    print(f"{'bare: gather the state dict, save_file':<52}{np.median(bare):>9.3f}{1.0:>8.2f}"
          f"{bare_mem / 1e6:>15.0f}{1.0:>8.2f}")
    print(f"{f'publish: {bucket >> 20} MB buckets streamed, announce, consumed':<52}{np.median(publish):>9.3f}"
          f"{np.median(publish) / np.median(bare):>8.2f}{publish_mem / 1e6:>15.0f}{publish_mem / bare_mem:>8.2f}")


if __name__ == "__main__":
    main()
