"""Judges: the style judge's criteria, the LLM judge's protocol, and `sao judge` on the real broker
switching criterion by control message and by schedule."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from consumers.control import set_criterion
from consumers.judge import JudgeConfig, run
from consumers.judges import STYLES, LLMJudge, load_judge, style
from schemas.tokenizers import ByteTokenizer
from schemas import topics as T
from schemas.config import ConfigError
from sao.broker import free_port
from tests.consumers.util import Service, pending_trajectory, publish, read_topic, wait_until

TEXTS = ["HELLO THERE", "hello there", "2024 1999"]


def test_the_style_judge_scores_the_same_texts_by_the_criterion_it_is_given():
    assert [style("", t, "uppercase") for t in TEXTS] == [10 / 11, 0.0, 0.0]
    assert [style("", t, "lowercase") for t in TEXTS] == [0.0, 10 / 11, 0.0]
    assert [style("", t, "digits") for t in TEXTS] == [0.0, 0.0, 8 / 9]
    assert style("", "WOW!!", "exclaim") == 0.4 and style("", "", "uppercase") == 0.0
    assert style("", "a b c", "concise") > style("", " ".join(["w"] * 20), "concise")
    assert len(STYLES) >= 3
    with pytest.raises(ValueError, match="unknown style"):
        style("", "x", "sarcastic")
    with pytest.raises(ConfigError):
        load_judge("llm")


def test_the_llm_judge_asks_a_completions_server_with_the_criterion_and_scales_its_rating():
    seen = []

    class Completions(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, ByteTokenizer().decode(body["prompt"])))
            data = json.dumps({"choices": [{"text": " 7 out of 10"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        judge = LLMJudge(f"http://127.0.0.1:{server.server_address[1]}", tokenizer=ByteTokenizer())
        assert judge("Write a haiku.", "old pond, frog", "be formal") == 0.7
        [(path, prompt)] = seen
        assert path == "/v1/completions" and "be formal" in prompt and "old pond, frog" in prompt
    finally:
        server.shutdown()


def _texts(kafka, texts: list[str]) -> list[str]:
    """Publish one pending trajectory per text, all on one partition so the judge sees them in order."""
    trajs = [pending_trajectory(f"{t[:5]}-{uuid.uuid4().hex[:6]}", prompt_len=2,
                                tokens=np.array([ord("?"), ord(" "), *t.encode()])) for t in texts]
    publish(kafka, T.PENDING, [(b"one-partition", t.encode()) for t in trajs])
    return [t.id for t in trajs]


def _rewards(kafka, ids: list[str]) -> list[tuple[float, str]]:
    got = {r.trajectory_id: r for r in read_topic(kafka, T.REWARDS, 0, until=lambda rs: set(ids) <=
                                                  {r.trajectory_id for r in rs})}
    return [(round(got[i].reward, 3), got[i].criterion) for i in ids]


def test_sao_judge_follows_its_schedule_and_the_control_topic(kafka_cfg):
    stop = threading.Event()
    cfg = JudgeConfig(criteria=("uppercase", "lowercase"), switch_every=3, log_every_s=0, kafka=kafka_cfg)
    judge = threading.Thread(target=run, args=(cfg, stop))
    judge.start()
    try:
        first = _texts(kafka_cfg, TEXTS)  # three under uppercase, then the schedule moves on
        second = _texts(kafka_cfg, TEXTS)
        assert _rewards(kafka_cfg, first) == [(0.909, "uppercase"), (0.0, "uppercase"), (0.0, "uppercase")]
        assert _rewards(kafka_cfg, second) == [(0.0, "lowercase"), (0.909, "lowercase"), (0.0, "lowercase")]
        set_criterion(kafka_cfg, "digits")
        # the judge reads the control topic between trajectories: probe until one is judged by it
        wait_until(lambda: _rewards(kafka_cfg, _texts(kafka_cfg, ["probe"])) == [(0.0, "digits")], timeout=60,
                   every=0)
        third = _texts(kafka_cfg, TEXTS)
        assert _rewards(kafka_cfg, third) == [(0.0, "digits"), (0.0, "digits"), (0.889, "digits")]
    finally:
        stop.set()
        judge.join(30)


def test_the_llm_judge_speaks_the_protocol_of_sao_serve_and_sends_its_token(kafka_cfg):
    port = free_port()
    server = Service(kafka_cfg, "serve", "--model", "tiny-llama-bytes", "--port", str(port), "--no-follow-weights",
                     "--serve-token", "s3cret")
    try:
        wait_until(lambda: _answers(f"http://127.0.0.1:{port}/health") or server.p.poll() is not None, timeout=120)
        assert server.p.poll() is None, server.log()
        url = f"http://127.0.0.1:{port}"
        judge = load_judge("llm", llm_url=url, tokenizer=ByteTokenizer(), token="s3cret")
        # a random tiny model rarely answers with a number: the point is that the request is served
        assert 0.0 <= judge("Write a haiku.", "old pond", "formal") <= 1.0
        with pytest.raises(httpx.HTTPStatusError, match="401"):
            load_judge("llm", llm_url=url, tokenizer=ByteTokenizer())("Write a haiku.", "old pond", "formal")
    finally:
        server.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def hostile(prompt, completion, criterion):
    """A judge plug-in that misbehaves on some completions."""
    match completion:
        case "exit":
            raise SystemExit(2)
        case "nan":
            return float("nan")
        case "hang":
            time.sleep(3600)
        case "word":
            return "good"
    return 0.75


def test_a_judge_plug_in_that_fails_skips_that_trajectory_and_the_judge_scores_the_next(kafka_cfg):
    stop, port = threading.Event(), free_port()
    cfg = JudgeConfig(judge="tests.consumers.test_judge:hostile", judge_timeout=1.0, metrics_port=port,
                      log_every_s=0, kafka=kafka_cfg)
    judge = threading.Thread(target=run, args=(cfg, stop))
    judge.start()
    try:
        ids = _texts(kafka_cfg, ["exit", "nan", "hang", "word", "fine", "fine too"])
        assert _rewards(kafka_cfg, ids[4:]) == [(0.75, "uppercase"), (0.75, "uppercase")]  # after the four bad ones
        assert not {r.trajectory_id for r in read_topic(kafka_cfg, T.REWARDS, 3, timeout=3)} & set(ids[:4])
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'sao_judge_skipped_total{reason="judge_error"} 4.0' in text
        assert 'sao_judge_rewards_total{criterion="uppercase"} 2.0' in text and "sao_judge_seconds_count 2.0" in text
    finally:
        stop.set()
        judge.join(30)
    assert not judge.is_alive()
