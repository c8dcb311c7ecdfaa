"""Weight sync end to end, in one run: bytes per update, seconds from a learner step to every
producer generating on the new version, and what the engines were paused for, for the default
transport (anchors and deltas, inline or as files), the collective transport and LoRA.

Each case runs a real `sao learner` on trajectories pre-published to the broker (bf16 publication,
the paper's policy learning rate 1e-6: the rate decides how many bf16 elements move per step), and
two hf producers in this process, each a `WeightSubscriber` and an `HFGenerator` decoding without
pause (a forward hook records the version of every decode step). Figures:

- bytes per update ÷ the full model (the version-0 anchor), over the deltas (an anchor every 20
  versions is listed apart); target <= 0.05 in bf16; and what each producer moved per update
  (the payloads it read, or over the link the whole state);
- sync: from the end of a learner step's update to the first decode step of the last producer on
  that version (the producers' own per-update `lag_s` excludes the learner side);
- pause: what decoding stopped for at each update (the hf backend's in-place copy), and its ratio
  to the sync it belongs to (target <= 0.2);
- the learner's background publication (snapshot handed over → announced) and the producers'
  fetch/rebuild/verify and load, per update;
- disk: bytes each producer wrote to disk per update: the kernel's `write_bytes` (counted as pages
  are dirtied) of the threads that follow the weights and swap them into the engine, which live
  as long as the producer (the process's own figure would include the learner's, added when the
  learner process is reaped); target 0: every update reaches the engine in memory, however it
  travelled.

    .venv/bin/python bench/weight_sync.py [--steps 20] [--hidden 512] [--layers 8] [--vocab 8192]
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import tyro  # noqa: E402

from bench.shapes import synthetic  # noqa: E402
from learner.models import tiny_llama  # noqa: E402
from producers.generate.base import SamplingParams  # noqa: E402
from producers.generate.hf import HFGenerator  # noqa: E402
from sao.broker import BrokerConfig, EmbeddedBroker, free_port  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer, make_producer, produce  # noqa: E402
from schemas.messages import Weights  # noqa: E402
from schemas.weights.follow import FollowConfig, WeightSubscriber  # noqa: E402


@dataclass(kw_only=True)
class WeightSyncConfig:
    """The learner's model and steps, the same for every case."""

    steps: int = 20
    """learner steps per case"""
    batch: int = 8
    """trajectories per step"""
    length: int = 128
    """tokens per trajectory"""
    hidden: int = 512
    """width of the tiny Llama"""
    layers: int = 8
    """depth of the tiny Llama"""
    vocab: int = 8192
    """vocabulary of the tiny Llama"""
    lr: float = 1e-6
    """policy learning rate (the paper's): it decides how many bf16 elements move per step"""
    lora_rank: int = 8
    """rank of the LoRA case (its learning rate 1e-4)"""


class Engine:
    """A producer's weight path: subscription, generator, a decode loop, and what it saw."""

    def __init__(self, kafka: KafkaConfig, model: torch.nn.Module, follow: FollowConfig):
        self.gen = HFGenerator(model, seed=0)
        self.marks: list[tuple[float, int]] = []  # (time, version) of every decode step
        model.register_forward_hook(lambda *_: self.marks.append((time.time(), self.gen.version)))
        self.sub = WeightSubscriber(kafka, self.gen, follow=follow).start()
        self.updates: dict[int, dict] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._decode, self._watch)]
        for t in self._threads:
            t.start()

    def _decode(self) -> None:
        params = SamplingParams(max_tokens=8)
        while not self._stop.is_set():
            asyncio.run(self.gen.generate([1, 2, 3, 4], params))

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            last = self.sub.last
            if last and last["version"] not in self.updates:
                self.updates[last["version"]] = dict(last)

    def disk_bytes_written(self) -> int:
        """Bytes the weight path's threads (the subscriber's and the engine's) have caused to be
        written to storage since they started."""
        total = 0
        for thread in (self.sub._thread, self.gen._thread):
            io = Path(f"/proc/self/task/{thread.native_id}/io").read_text().splitlines()
            total += int(dict(line.split(": ") for line in io)["write_bytes"])
        return total

    def first_decode(self, version: int) -> float | None:
        return next((t for t, v in self.marks if v >= version), None)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        self.sub.close()
        self.gen.close()


def announcements(kafka: KafkaConfig) -> list[Weights]:
    consumer = make_consumer(kafka, f"bench-{uuid.uuid4().hex}")
    consumer.subscribe([kafka.topic(T.WEIGHTS)])
    got, idle = [], time.monotonic() + 30
    while time.monotonic() < idle:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            got.append(Weights.decode(msg.value()))
            idle = time.monotonic() + 2
    consumer.close()
    return got


def run_case(bootstrap: str, args: WeightSyncConfig, flags: list[str], follow: FollowConfig) -> dict:
    kafka = KafkaConfig(bootstrap=bootstrap, topic_prefix=f"ws{uuid.uuid4().hex[:8]}", settings={})
    ensure_topics(kafka)
    producer = make_producer(kafka)
    for t in synthetic((args.steps + 1) * args.batch, args.length, args.vocab):
        produce(producer, kafka.topic(T.TRAJECTORIES), t.encode(), key=t.key)
    assert producer.flush(60) == 0
    dims = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, seed=0)
    engines = [Engine(kafka, tiny_llama(**dims), follow) for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "sao", "learner", "--run-dir", f"{tmp}/learner", "--weights-dir", f"{tmp}/weights",
               "--kafka.bootstrap", bootstrap, "--kafka.topic-prefix", kafka.topic_prefix,
               "--batch-trajectories", str(args.batch), "--max-steps", str(args.steps), "--max-staleness", "-1",
               "--model.vocab-size", str(args.vocab), "--model.hidden-size", str(args.hidden),
               "--model.num-layers", str(args.layers), "--update.warmup-steps", "0",
               "--update.lr-policy", str(args.lr), *flags]
        subprocess.run(cmd, check=True, cwd=ROOT, stderr=subprocess.DEVNULL, env={**os.environ, "SAO_LOG_LEVEL": "WARNING"})
        steps = [json.loads(x) for x in Path(f"{tmp}/learner/metrics.jsonl").read_text().splitlines()]
    ws = announcements(kafka)
    deadline = time.monotonic() + 60
    while any(e.gen.version < ws[-1].version for e in engines) and time.monotonic() < deadline:
        time.sleep(0.1)
    written = sum(e.disk_bytes_written() for e in engines)
    loads = sum(e.sub.counts["loaded"] for e in engines)
    for e in engines:
        e.close()
    return summarise(steps, ws, engines) | {"disk": written / max(loads, 1)}


def summarise(steps: list[dict], ws: list[Weights], engines: list[Engine]) -> dict:
    update_end = {s["weights/version"]: s["time"] - (s["perf/step_s"] - s["perf/train_s"]) for s in steps}
    full = ws[0].num_bytes
    deltas = [w for w in ws if w.base >= 0]
    syncs, pauses, ratios = [], [], []
    for w in deltas:
        firsts = [e.first_decode(w.version) for e in engines]
        if w.version not in update_end or None in firsts:
            continue
        sync = max(firsts) - update_end[w.version]
        syncs.append(sync)
        for e in engines:
            if (u := e.updates.get(w.version)) is not None:
                pauses.append(u["pause_s"])
                ratios.append(u["pause_s"] / sync)
    per = {k: [u[k] for e in engines for u in e.updates.values() if k in u]
           for k in ("fetch_s", "load_s", "bytes")}
    publish = [s["weights/encode_s"] + s["weights/write_s"] + s["weights/announce_s"] + s["weights/broadcast_s"]
               for s in steps if "weights/encode_s" in s]
    return {"updates": len(deltas), "full": full, "anchors": [w.num_bytes for w in ws if w.base < 0],
            "delta_median": statistics.median(w.num_bytes for w in deltas), "delta_last": deltas[-1].num_bytes,
            "sync": syncs, "pause": pauses, "ratio": ratios, "publish": publish, **per,
            "sources": [dict(e.sub.by_source) for e in engines],
            "snapshot_s": statistics.median(s["perf/publish_s"] for s in steps[1:])}


def main() -> None:
    args = tyro.cli(WeightSyncConfig, description=__doc__)
    torch.set_num_threads(1)  # the two producers' engines share this process; the learner has its own
    port = free_port()
    cases = {
        "files+inline": ([], FollowConfig()),
        "collective": (["--weights.transport", "collective", "--weights.collective-port", str(port)],
                       FollowConfig(collective_addr=f"127.0.0.1:{port}")),
        f"lora r{args.lora_rank}": (["--model.lora-rank", str(args.lora_rank), "--update.lr-policy", "1e-4"],
                                    FollowConfig()),
    }
    broker = None if os.environ.get("SAO_KAFKA_BOOTSTRAP") else EmbeddedBroker(BrokerConfig(port=0)).start()
    try:
        bootstrap = os.environ.get("SAO_KAFKA_BOOTSTRAP") or broker.bootstrap
        results = {name: run_case(bootstrap, args, flags, follow) for name, (flags, follow) in cases.items()}
    finally:
        if broker is not None:
            broker.close()
    n_params = sum(p.numel() for p in tiny_llama(vocab_size=args.vocab, hidden_size=args.hidden,
                                                 num_layers=args.layers).parameters())
    print(f"weight_sync: tiny-llama h{args.hidden} L{args.layers} V{args.vocab} ({n_params / 1e6:.1f}M params, "
          f"{results['files+inline']['full'] / 1e6:.1f} MB bf16), {args.steps} steps x {args.batch} x {args.length} "
          f"tokens, lr {args.lr:g} (LoRA 1e-4), 2 hf producers  [{platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, load average {os.getloadavg()[0]:.1f}]")
    print(f"{'case':<14}{'deltas':>7}{'median B':>11}{'÷ full':>8}{'moved B':>10}{'sync s':>14}{'pause s':>9}{'pause÷sync':>11}"
          f"{'publish s':>10}{'fetch s':>9}{'load s':>8}{'disk B':>11}  how the updates came")

    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    for name, r in results.items():
        print(f"{name:<14}{r['updates']:>7}{r['delta_median']:>11.0f}{r['delta_median'] / r['full']:>8.4f}"
              f"{med(r['bytes']):>10.0f}"
              f"{med(r['sync']):>8.3f}/{max(r['sync'], default=float('nan')):<5.2f}{med(r['pause']):>9.4f}"
              f"{med(r['ratio']):>11.3f}{med(r['publish']):>10.3f}{med(r['fetch_s']):>9.3f}"
              f"{med(r['load_s']):>8.3f}{r['disk']:>11.0f}  {r['sources'][0]}")
    for name, r in results.items():
        print(f"{name}: anchors {[round(a / 1e6, 2) for a in r['anchors']]} MB; last delta "
              f"{r['delta_last'] / r['full']:.4f} of full; snapshot on the training thread {r['snapshot_s']:.3f} s/step")


if __name__ == "__main__":
    main()
