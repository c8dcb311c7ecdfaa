"""The prompt feeder: the backlog formula, JSONL input, and backpressure on the real broker."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading

import pytest
from hypothesis import given, strategies as st

from producers.feeder.datasets import epoch_order, load_rows
from producers.feeder.service import FEED_HEADER, SAMPLE_HEADER, Backlog, FeedConfig, run
from schemas.progress import unfinished
from schemas import topics as T
from schemas.kafka import make_consumer, make_producer, produce
from schemas.config import ConfigError
from schemas.messages import Prompt
from tests.producers.util import wait_until


def test_unfinished_hand_case():
    high = {0: 10, 1: 5, 2: 0}
    low = {0: 0, 1: 2, 2: 0}
    committed = {0: 7, 1: -1001}  # partition 1: never committed -> counted from its low watermark
    assert unfinished(high, low, committed) == (10 - 7) + (5 - 2) + 0


@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100), st.integers(0, 100)), max_size=12))
def test_unfinished_is_published_minus_finished(parts):
    high, low, committed = {}, {}, {}
    for p, (a, b, c) in enumerate(parts):
        lo, co, hi = sorted((a, b, c))
        high[p], low[p], committed[p] = hi, lo, co
    assert unfinished(high, low, committed) == sum(high[p] - committed[p] for p in high)
    assert unfinished(high, low, {}) == sum(high[p] - low[p] for p in high)


def test_jsonl_lines_become_prompts_and_bad_lines_are_skipped(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([json.dumps({"id": "a", "task": {"target": 1}}),
                               "not json",
                               json.dumps({"target": 2}),
                               json.dumps([1, 2]),
                               "",
                               json.dumps({"task": {"question": "q", "answer": 1}, "env": "math"})]))
    errors = []
    prompts = load_rows(path, "toy-target", errors)
    assert [p.task for p in prompts] == [{"target": 1}, {"target": 2}, {"question": "q", "answer": 1}]
    assert [p.id for p in prompts] == ["a", "prompts.jsonl:3", "prompts.jsonl:6"]  # stable per row
    assert [p.env for p in prompts] == ["toy-target", "toy-target", "math"]
    assert [e.split(":")[1] for e in errors] == ["2", "4"]


def _finish(kafka_cfg, n: int) -> list[Prompt]:
    """Play the producers' group: consume n prompts, committing each."""
    consumer = make_consumer(kafka_cfg, "sao-producers")
    consumer.subscribe([kafka_cfg.topic(T.PROMPTS)])
    got = []
    try:
        while len(got) < n:
            msg = consumer.poll(1.0)
            if msg is None or msg.error():
                continue
            got.append(Prompt.decode(msg.value()))
            consumer.commit(msg, asynchronous=False)  # finished one by one, as producers do
    finally:
        consumer.close()
    return got


def test_backpressure_bounds_unfinished_prompts(kafka_cfg):
    stop = threading.Event()
    cfg = FeedConfig(env="toy-target", max_unfinished=5, poll_s=0.1, kafka=kafka_cfg)
    feeder = threading.Thread(target=run, args=(cfg, stop))
    feeder.start()
    backlog = Backlog(kafka_cfg, "sao-producers")
    try:
        wait_until(lambda: backlog.count() == 5)
        stop.wait(1.0)
        assert backlog.count() == 5  # no producers: the feeder waits rather than flood the topic
        _finish(kafka_cfg, 3)
        wait_until(lambda: backlog.count() == 5)  # refilled to the bound, not beyond
        stop.wait(0.5)
        published = sum(backlog.consumer.get_watermark_offsets(tp, cached=False)[1] for tp in backlog.tps)
        assert published == 8
    finally:
        stop.set()
        feeder.join(30)
        backlog.close()


def test_a_counted_feed_publishes_exactly_count_and_waits_until_done(kafka_cfg):
    cfg = FeedConfig(env="math", count=4, max_unfinished=10, poll_s=0.1, wait_done=True, kafka=kafka_cfg)
    result = []
    feeder = threading.Thread(target=lambda: result.append(run(cfg)))
    feeder.start()
    prompts = _finish(kafka_cfg, 4)
    feeder.join(60)
    assert result == [4] and not feeder.is_alive()
    assert all(p.env == "math" and isinstance(p.task["answer"], int) for p in prompts)


def test_epochs_keep_row_ids_and_groups_fan_out_with_distinct_trajectory_ids(kafka_cfg, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"target": t}) for t in (1, 2, 3)))
    cfg = FeedConfig(env="toy-target", dataset=str(path), epochs=2, group_size=4, max_unfinished=100,
                     kafka=kafka_cfg)
    assert run(cfg) == 24
    prompts = _finish(kafka_cfg, 24)
    assert {p.id for p in prompts} == {"rows.jsonl:1", "rows.jsonl:2", "rows.jsonl:3"}  # stable per row
    assert len({p.trajectory_id for p in prompts}) == 24  # a second epoch is new, not a duplicate
    groups = {}
    for p in prompts:
        groups.setdefault(p.group, []).append(p)
    assert len(groups) == 6  # 3 rows x 2 epochs
    assert all(sorted(p.sample for p in g) == [0, 1, 2, 3] and {p.group_size for p in g} == {4}
               and len({json.dumps(p.task) for p in g}) == 1 for g in groups.values())


def test_impossible_feed_settings_name_the_flag():
    for name in ("epochs", "group_size", "max_unfinished"):
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')}"):
            FeedConfig(**{name: 0})
    with pytest.raises(ConfigError, match="no sample_task.*give it --dataset"):
        FeedConfig(env="tests.producers.test_plugins:Recording")  # a text env fed only by datasets


def test_parquet_rows_become_prompts_with_struct_or_json_tasks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": ["r1", None], "task": ['{"target": 1}', '{"target": 2}']}), path)
    assert [(p.id, p.task) for p in load_rows(path, "toy-target", [])] == \
        [("r1", {"target": 1}), ("rows.parquet:2", {"target": 2})]
    bare = tmp_path / "bare.parquet"  # no task column: the row is the task
    pq.write_table(pa.table({"target": [3, 0], "env": ["toy-target", "toy-target"]}), bare)
    assert [p.task for p in load_rows(bare, "math", [])] == [{"target": 3}, {"target": 0}]


def test_every_epoch_has_its_own_reproducible_order():
    orders = [epoch_order(50, seed=7, epoch=e, shuffle=True) for e in range(3)]
    assert all(sorted(o) == list(range(50)) for o in orders)
    assert orders[0] != orders[1] != orders[2]
    assert orders[1] == epoch_order(50, seed=7, epoch=1, shuffle=True)
    assert epoch_order(5, seed=7, epoch=1, shuffle=False) == [0, 1, 2, 3, 4]


def _rows(tmp_path, n: int):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"target": t % 4, "id": f"row{t}"}) for t in range(n)))
    return path


def _samples(prompts: list[Prompt]) -> list[tuple[str, int, int]]:
    return sorted((p.id, p.attempt, p.sample) for p in prompts)


def test_a_dataset_feed_resumes_past_samples_acknowledged_after_its_last_saved_position(kafka_cfg, tmp_path):
    path = _rows(tmp_path, 6)
    cfg = lambda **kw: FeedConfig(env="toy-target", dataset=str(path), group_size=2, max_unfinished=100,
                                  kafka=kafka_cfg, **kw)
    assert run(cfg(count=4)) == 4  # groups 0 and 1; the saved position is group 2
    # a feeder that died after the broker acknowledged part of its next batch, before saving
    producer = make_producer(kafka_cfg)
    rows = load_rows(path, "toy-target", [])
    for group, sample in ((2, 1), (4, 0)):
        prompt = dataclasses.replace(rows[group], sample=sample, group_size=2)
        produce(producer, kafka_cfg.topic(T.PROMPTS), prompt.encode(), key=prompt.key,
                headers=[(FEED_HEADER, cfg().feed_id.encode()), (SAMPLE_HEADER, f"{group}.{sample}".encode())])
    assert producer.flush(30) == 0
    assert run(cfg()) == 6  # the rest of groups 2..5, without the two samples already out
    expected = _samples([dataclasses.replace(r, sample=s, group_size=2) for r in rows for s in (0, 1)])
    assert _samples(_finish(kafka_cfg, 12)) == expected  # every sample exactly once
    assert run(cfg()) == 0  # the feed is done; a restart publishes nothing
    assert run(cfg(from_start=True)) == 12


def test_a_sigkilled_dataset_feed_restarts_where_it_was_and_repeats_nothing(kafka_cfg, tmp_path):
    path = _rows(tmp_path, 10)
    cmd = [sys.executable, "-m", "sao", "feed", "--dataset", str(path), "--epochs", "2", "--shuffle",
           "--group-size", "2", "--max-unfinished", "6", "--poll-s", "0.05"]
    env = {**os.environ, "SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix}
    feeder = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        got = _finish(kafka_cfg, 16)  # the producers' group works through the first ones ...
        feeder.kill()  # ... and the feeder dies mid-feed
        feeder.wait(30)
        feeder = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        got += _finish(kafka_cfg, 40 - len(got))
        assert feeder.wait(60) == 0, feeder.stderr.read()[-3000:]
        assert "resumes at group" in feeder.stderr.read()
    finally:
        feeder.kill()
        feeder.wait(30)
    rows = load_rows(path, "toy-target", [])
    expected = [(r.id, epoch, s) for epoch in (0, 1) for r in rows for s in (0, 1)]
    assert _samples(got) == sorted(expected)  # 2 epochs x 10 rows x 2 samples, each exactly once


def test_the_feeder_rides_out_its_broker_killed_and_restarted(tmp_path):
    """SIGKILL of the only broker while the feeder waits on its backlog (reading watermarks and
    the group's offsets every poll), then the broker back on the same data: the feeder carries on
    by itself and publishes its whole count."""
    from sao.broker import BrokerConfig, EmbeddedBroker, free_port
    from schemas.kafka import KafkaConfig, ensure_topics

    broker = EmbeddedBroker(BrokerConfig(data_dir=tmp_path / "kafka", port=free_port())).start()
    kafka = KafkaConfig(bootstrap=broker.bootstrap, topic_prefix="fault")
    ensure_topics(kafka)
    result, errors = [], []

    def feed():
        try:
            result.append(run(FeedConfig(env="toy-target", count=12, max_unfinished=6, poll_s=0.1, kafka=kafka)))
        except BaseException as e:  # noqa: BLE001 - what a dying feeder raised, for the assertion
            errors.append(e)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        backlog = Backlog(kafka, "sao-producers")
        wait_until(lambda: backlog.count() == 6)
        backlog.close()
        broker.kill(0)  # SIGKILL: no controlled shutdown
        feeder.join(65)  # past the minute after which its retries used to give up (schemas/retry.OUTAGE_S)
        assert feeder.is_alive() and not errors, errors
        broker.restart(0)
        _finish(kafka, 12)  # the remaining six are published once the broker is back
        feeder.join(60)
        assert result == [12] and not errors, errors
    finally:
        broker.close()
