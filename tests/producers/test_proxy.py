"""`sao serve` as a rollout proxy: an `openai`-client agent's sessions become trajectories made of
the template's tokens and the exact sampled ids, on the real broker, with the guards of the endpoint.

The tiny random model never calls a tool on its own, so the module first teaches one (about a
hundred Adam steps) to answer the example agent's question with a calculator call."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from openai import OpenAI

from examples.agent import TOOLS, first_messages, play
from producers.envs.chat import Chat
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator
from producers.generate.http import HttpGenerator
from producers.models import load_model
from schemas.catalogue import TINY_LLAMA_BYTES
from producers.serve.api import parse_tool_calls, streamable
from producers.serve.proxy import Sessions, kafka_publisher
from producers.serve.service import ServeConfig, make_server
from sao.broker import free_port
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import make_producer
from schemas.messages import Reward
from schemas.tokenizers import ByteTokenizer
from tests.consumers.util import joiner, publish
from tests.producers.test_serve import T as TEMPERATURE, _learner_model, _max_gap
from tests.producers.util import REPO, read_topic, wait_until

QUESTION, ANSWER = "What is 6 * 7?", "42"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
TOKEN = "s3cret"
TOK = ByteTokenizer()
IM_END = TOK.eos_token_id


@pytest.fixture(scope="module")
def taught() -> torch.nn.Module:
    """tiny-llama-bytes taught to answer the agent's first turn with CALL and its end of turn."""
    prompt = TOK.encode(TOK.apply_chat_template(first_messages(QUESTION), tools=TOOLS, add_generation_prompt=True))
    target = TOK.encode(CALL + "<|im_end|>")
    model = load_model("tiny-llama-bytes").train()
    ids = torch.tensor([prompt + target])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):  # ~100 steps, a few seconds on an idle CPU core
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="none")
        if nll.max().item() < 0.02:  # then 30 seeds of 30 sampled the call exactly at T = 0.7
            break
        opt.zero_grad()
        nll.mean().backward()
        opt.step()
    assert nll.max().item() < 0.02
    return model.eval()


class Proxy:
    """A real `sao serve` (in-process, free loopback port) publishing sessions to the test's topics."""

    def __init__(self, model, kafka, *, token: str = TOKEN, idle_s: float = 600.0, max_concurrent: int = 8):
        self.gen = HFGenerator(model, seed=0)
        self.producer = make_producer(kafka)
        self.sessions = Sessions(Chat(TOK), kafka_publisher(self.producer, kafka), context=4096, idle_s=idle_s,
                                 producer_id="test")
        self.server = make_server(self.gen, TOK, token=token, max_concurrent=max_concurrent, sessions=self.sessions)
        self.url = "http://%s:%d" % self.server.server_address[:2]
        self.headers = {"Authorization": f"Bearer {token}"}
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def client(self, **kw) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=TOKEN, **kw)

    def chat(self, **body) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=self.headers, timeout=60)

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.sessions.close_all()
        self.gen.close()


@pytest.fixture
def proxy(taught, kafka_cfg):
    p = Proxy(taught, kafka_cfg)
    yield p
    p.close()


def _chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _read(kafka, topic, tid: str, timeout: float = 60.0):
    found = read_topic(kafka, topic, 0, timeout=timeout, until=lambda ms: any(m.id == tid for m in ms))
    return next(m for m in found if m.id == tid)


def test_a_three_turn_tool_using_conversation_is_the_template_tokens_plus_the_exact_sampled_ids(
        proxy, kafka_cfg, tmp_path):
    sent = []  # (request body, response body) of every chat turn, as on the wire
    hook = lambda r: r.read() and r.request.url.path.endswith("/chat/completions") and sent.append(
        (json.loads(r.request.content), r.json()))
    client = proxy.client(http_client=httpx.Client(event_hooks={"response": [hook]}))
    receipt = play(client, QUESTION, ANSWER, max_turns=3, temperature=TEMPERATURE, seed=1)
    assert receipt["topic"] == kafka_cfg.topic(T.TRAJECTORIES) and receipt["num_turns"] == 3
    first = sent[0][1]["choices"][0]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    assert json.loads(first["message"]["tool_calls"][0]["function"]["arguments"]) == {"expression": "6 * 7"}
    assert sent[1][0]["messages"][3] == {"role": "tool", "tool_call_id": first["message"]["tool_calls"][0]["id"],
                                         "content": "42"}

    traj = _read(kafka_cfg, T.TRAJECTORIES, receipt["session"])
    # independently: ChatML of the new messages around each turn's sampled ids
    expected = TOK.encode(TOK.apply_chat_template(first_messages(QUESTION), tools=TOOLS, add_generation_prompt=True))
    mask = [0] * len(expected)
    for turn, (request, response) in enumerate(sent):
        if turn:
            new = request["messages"][len(sent[turn - 1][0]["messages"]) + 1:]
            close = "\n" if expected[-1] == IM_END else "<|im_end|>\n"
            obs = TOK.encode(close + _chatml(new) + "<|im_start|>assistant\n")
            expected, mask = expected + obs, mask + [0] * len(obs)
        ids = response["choices"][0]["token_ids"]
        expected, mask = expected + ids, mask + [1] * len(ids)
    assert traj.tokens.tolist() == expected
    assert traj.action_mask.tolist() == mask
    assert traj.prompt_len == mask.index(1) and traj.num_turns == 3 and traj.reward == receipt["reward"]
    assert traj.env == "proxy" and traj.temperature == TEMPERATURE
    assert (traj.versions == np.where(traj.action_mask == 1, 0, -1)).all()
    assert _max_gap([traj], _learner_model(proxy.gen, tmp_path, TINY_LLAMA_BYTES)) < 1e-4


def test_streaming_sends_text_in_pieces_tool_calls_whole_and_records_the_same_turn(proxy, kafka_cfg):
    stream = proxy.client().chat.completions.create(
        model="default", messages=first_messages(QUESTION), tools=TOOLS, max_tokens=100, temperature=TEMPERATURE,
        seed=1, stream=True, extra_body={"session": "new"})
    chunks = list(stream)
    calls = [c for ch in chunks for c in ch.choices[0].delta.tool_calls or ()]
    assert [c.function.arguments for c in calls] == ['{"expression": "6 * 7"}']
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    session = chunks[0].model_extra["session"]
    ids = chunks[-1].choices[0].model_extra["token_ids"]
    assert TOK.decode(ids) == CALL + "<|im_end|>"

    messages = first_messages(QUESTION) + [
        {"role": "assistant", "tool_calls": [c.model_dump(include={"id", "type", "function"}) for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "42"}]
    pieces = [ch.choices[0].delta.content for ch in proxy.client().chat.completions.create(
        model="default", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=TEMPERATURE,
        seed=2, stream=True, extra_body={"session": session}) if ch.choices[0].delta.content]
    assert len(pieces) > 1  # streamed as sampled (no call to hold back), not in one piece at the end
    r = httpx.post(f"{proxy.url}/v1/sessions/{session}/close", headers=proxy.headers, json={})
    assert r.status_code == 200 and r.json()["topic"] == kafka_cfg.topic(T.PENDING)
    traj = _read(kafka_cfg, T.PENDING, session)
    acted = traj.tokens[traj.action_mask == 1].tolist()
    assert acted[:len(ids)] == ids and traj.num_turns == 2 and traj.reward is None


def test_a_reward_posted_later_by_receipt_is_joined_onto_the_trajectories_topic(taught, kafka_cfg):
    join, _ = joiner(kafka_cfg)  # starting takes seconds: meanwhile, play
    proxy = Proxy(taught, kafka_cfg)
    try:
        r = proxy.chat(messages=[{"role": "user", "content": "hi"}], max_tokens=8, session="new")
        receipt = r.headers["X-SAO-Session"]
        assert r.status_code == 200 and r.json()["session"] == receipt
        r = httpx.post(f"{proxy.url}/v1/sessions/{receipt}/close", headers=proxy.headers)
        assert r.json()["topic"] == kafka_cfg.topic(T.PENDING)
        publish(kafka_cfg, T.REWARDS, [Reward(trajectory_id=receipt, reward=0.25)])
        joined = _read(kafka_cfg, T.TRAJECTORIES, receipt, timeout=120)
        assert joined.reward == 0.25 and joined.num_turns == 1
    finally:
        proxy.close()
        join.stop()


def test_an_idle_session_is_published_to_pending_as_truncated(taught, kafka_cfg):
    proxy = Proxy(taught, kafka_cfg, idle_s=0.5)
    try:
        r = proxy.chat(messages=[{"role": "user", "content": "hi"}], max_tokens=8, session="new")
        receipt = r.json()["session"]
        traj = _read(kafka_cfg, T.PENDING, receipt)
        assert traj.finish_reason == "truncated" and traj.meta == {"closed": "expired"} and traj.num_turns == 1
        r = httpx.post(f"{proxy.url}/v1/sessions/{receipt}/close", headers=proxy.headers, json={"reward": 1})
        assert r.status_code == 404  # published once, not twice
    finally:
        proxy.close()


def test_a_sigkilled_proxy_takes_its_open_sessions_up_from_its_journal(kafka_cfg, tmp_path):
    """`sao serve --sessions-dir`: a session opened before a SIGKILL goes on after the restart,
    and its trajectory holds both turns' sampled ids; a journal file that is not a session is set
    aside, and the server starts all the same."""
    port, journal, log = free_port(), tmp_path / "sessions", tmp_path / "serve.log"
    journal.mkdir()
    (journal / "proxy-garbage.msgpack").write_bytes(b"\xc1 not a session")
    env = {**os.environ, "SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix,
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{port}"

    def serve() -> subprocess.Popen:
        with open(log, "a") as out:
            p = subprocess.Popen([sys.executable, "-m", "sao", "serve", "--model", "tiny-llama-bytes", "--port",
                                  str(port), "--sessions-dir", str(journal)], cwd=REPO, env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
        wait_until(lambda: _healthy(url) or p.poll() is not None, timeout=120)
        assert p.poll() is None, log.read_text()[-3000:]
        return p

    def turn(messages, session):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 8, "temperature": 1.0, "seed": 3, "session": session})
        assert r.status_code == 200, r.text
        return r.json()

    first = serve()
    try:
        messages = [{"role": "user", "content": "hi"}]
        one = turn(messages, "new")
        receipt = one["session"]
        assert (journal / f"{receipt}.msgpack").exists()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    second = serve()
    try:
        assert "took up 1 open sessions" in log.read_text()
        assert (journal / "proxy-garbage.unreadable").exists()
        messages += [one["choices"][0]["message"], {"role": "user", "content": "and again"}]
        two = turn(messages, receipt)
        r = httpx.post(f"{url}/v1/sessions/{receipt}/close", json={"reward": 1.0}, timeout=60)
        assert r.status_code == 200, r.text
        assert not (journal / f"{receipt}.msgpack").exists()  # published: no longer open
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(60)
    traj = _read(kafka_cfg, T.TRAJECTORIES, receipt)
    sampled = one["choices"][0]["token_ids"] + two["choices"][0]["token_ids"]
    assert traj.num_turns == 2 and traj.reward == 1.0
    assert traj.tokens[traj.action_mask == 1].tolist() == sampled


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_history_that_is_not_the_sessions_is_refused_and_the_session_goes_on(proxy):
    messages = [{"role": "user", "content": "hi"}]
    r = proxy.chat(messages=messages, max_tokens=8, session="new")
    receipt, reply = r.json()["session"], r.json()["choices"][0]["message"]
    edited = {**reply, "content": reply["content"] + "!"}
    r = proxy.chat(messages=messages + [edited, {"role": "user", "content": "go on"}], max_tokens=8, session=receipt)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[1] differs")
    r = proxy.chat(messages=messages + [reply], max_tokens=8, session=receipt)
    assert r.status_code == 400  # nothing new to answer
    r = proxy.chat(messages=messages + [reply, {"role": "user", "content": "go on"}], max_tokens=8, session=receipt)
    assert r.status_code == 200 and r.headers["X-SAO-Session"] == receipt
    assert proxy.chat(messages=messages, max_tokens=8, session="proxy-nope").status_code == 404
    proxy.sessions.max_open = 1  # this session holds the one place: opening another waits for it
    r = proxy.chat(messages=messages, max_tokens=8, session="new")
    assert r.status_code == 429 and "--max-sessions" in r.json()["error"]["message"]
    assert proxy.chat(messages=messages, max_tokens=8).status_code == 200  # a turn outside sessions


def test_prompts_beyond_the_context_window_get_400_before_any_work(proxy):
    forwards = []
    hook = proxy.gen.model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        over = [
            httpx.post(f"{proxy.url}/v1/completions", headers=proxy.headers,
                       json={"prompt": [1] * 4000, "max_tokens": 200}),
            proxy.chat(messages=[{"role": "user", "content": "x" * 5000}]),
            proxy.chat(messages=[{"role": "user", "content": "x" * 3000}], max_tokens=2000),
            httpx.post(f"{proxy.url}/v1/completions", headers=proxy.headers, timeout=60,
                       json={"prompt": [1] * 2_000_000, "max_tokens": 1}),  # refused by its size, unread
        ]
    finally:
        hook.remove()
    deep = httpx.post(f"{proxy.url}/v1/chat/completions", headers={**proxy.headers, "Content-Type": "application/json"},
                      content=b"[" * 100_000)
    assert deep.status_code == 400 and "nested deeper" in deep.json()["error"]["message"]
    assert [r.status_code for r in over] == [400, 400, 400, 413]
    assert all("context window" in r.json()["error"]["message"] for r in over)
    assert not forwards
    assert httpx.get(f"{proxy.url}/health").status_code == 200


def test_past_max_concurrent_a_request_gets_429_and_an_http_producer_retries(taught, kafka_cfg, caplog):
    proxy = Proxy(taught, kafka_cfg, max_concurrent=1)
    producer = HttpGenerator(proxy.url, token=TOKEN)
    engine = proxy.gen._step_lock  # held here, the engine stands still and the first request stays in flight
    engine.acquire()
    held = True
    try:
        with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", headers=proxy.headers,
                          json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                "max_tokens": 4}) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # its role chunk: it holds the one slot
            second = proxy.chat(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert second.status_code == 429 and second.headers["Retry-After"] == "1"
            later = ThreadPoolExecutor(1).submit(asyncio.run, producer.generate([1, 2], SamplingParams(max_tokens=2)))
            wait_until(lambda: "(429)" in caplog.text)  # refused, and retrying rather than dead-lettering
            engine.release()
            held = False
            assert [x for x in lines if x][-1] == "data: [DONE]"
        assert len(later.result(timeout=60).token_ids) == 2
        assert proxy.chat(messages=[{"role": "user", "content": "hi"}], max_tokens=4).status_code == 200
    finally:
        if held:  # not engine.locked(): once released, the engine thread holds it for its own steps
            engine.release()
        proxy.close()


def test_with_a_token_every_post_needs_it_and_beyond_loopback_one_is_required(proxy):
    params = SamplingParams(max_tokens=2)
    assert len(asyncio.run(HttpGenerator(proxy.url, token=TOKEN).generate([1, 2], params)).token_ids) == 2
    with pytest.raises(PermissionError, match="--serve-token"):  # stops the producer, dead-letters nothing
        asyncio.run(HttpGenerator(proxy.url).generate([1, 2], params))
    for path, body in [("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "session": "new"}),
                       ("/v1/sessions/proxy-x/close", {"reward": 1.0})]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(proxy.url + path, json=body, headers=headers)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(f"{proxy.url}/health").status_code == 200
    with pytest.raises(ConfigError, match="--serve-token"):
        ServeConfig(host="0.0.0.0")
    ServeConfig(host="0.0.0.0", serve_token="t")


def test_the_example_agent_runs_with_one_command(proxy, kafka_cfg):
    out = subprocess.run([sys.executable, "examples/agent.py", "--base-url", f"{proxy.url}/v1", "--api-key", TOKEN,
                          "--episodes", "2", "--max-turns", "2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    receipts = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(receipts) == 2 and all(r["topic"] == kafka_cfg.topic(T.TRAJECTORIES) for r in receipts)


def test_tool_calls_are_parsed_only_when_every_block_is_a_call():
    content, calls = parse_tool_calls("Let me see. " + CALL)
    assert content == "Let me see. " and calls[0]["function"] == {"name": "calculator",
                                                                  "arguments": '{"expression": "6 * 7"}'}
    assert parse_tool_calls("x <tool_call>{oops}</tool_call>") == ("x <tool_call>{oops}</tool_call>", [])
    assert parse_tool_calls("no call") == ("no call", [])
    deep = "<tool_call>" + "[" * 5000 + "</tool_call>"
    assert parse_tool_calls(deep) == (deep, [])


@given(st.text(alphabet="ab<>_lotc/{}\ufffd", max_size=40))
def test_streamed_text_is_a_prefix_of_the_final_content(text):
    full = text + CALL
    for end in range(len(full) + 1):
        n = streamable(full[:end], tools=True)
        assert parse_tool_calls(full)[0].startswith(full[:n]) and n <= end
