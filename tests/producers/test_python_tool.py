"""The python-tool env with the real sandbox: code runs, its output comes back as observation
tokens, and hostile code costs one observation, never the episode or the producer."""

import random

import pytest

from producers.envs import make_env
from schemas.tokenizers import ByteTokenizer
from producers.envs.python_tool import extract_code
from producers.sandbox import Sandbox, SandboxConfig

tok = ByteTokenizer()


@pytest.fixture(scope="module")
def env():
    return make_env("python-tool", tokenizer=tok, sandbox=Sandbox(SandboxConfig(timeout_s=1.5)),
                    max_turns=3)


def act(text: str) -> list[int]:
    return tok.encode(text + "<|im_end|>")


@pytest.mark.parametrize("text, code", [
    ("Let me compute.\n```python\nprint(2+2)\n```\n", "print(2+2)\n"),
    ("```python\nx=1\n```\nthen\n```python\nprint(3)\n```", "print(3)\n"),
    ("unclosed\n```python\nprint(5)", "print(5)"),
    ("```python\n   \n```", None),
    ("no code. Answer: 4", None),
])
def test_extract_code(text, code):
    assert extract_code(text) == code


def test_code_output_comes_back_as_an_observation_then_the_answer_is_verified(env):
    task = {"question": "What is 123 * 456?", "answer": 56088}
    ep = env.episode(task)
    step = ep.step(act("```python\nprint(123 * 456)\n```"))
    assert not step.done and step.reward is None
    obs = tok.decode(step.observation)
    assert obs.startswith("\n<|im_start|>user\n```output\n56088\n```") and obs.endswith("assistant\n")
    final = ep.step(act("Answer: 56088"))
    assert final.done and final.reward == 1.0


def test_the_last_turn_is_final_even_with_code(env):
    ep = env.episode({"question": "q", "answer": 1})
    for _ in range(env.max_turns - 1):
        assert not ep.step(act("```python\nprint(1)\n```")).done
    last = ep.step(act("```python\nprint(1)\n```\nAnswer: 1"))
    assert last.done and last.reward == 1.0


@pytest.mark.parametrize("code, reported", [
    ("while True:\n    pass", "timeout"),
    ("import os\nwhile True:\n    os.fork()", "Resource temporarily unavailable"),
    ("x = bytearray(10 * 2**30)", "MemoryError"),
    ("f = open('big', 'wb')\nfor _ in range(1024):\n    f.write(b'0' * 2**20)", "File too large"),
    ("print(open('/work/main/pyproject.toml').read())", "No such file or directory"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9092), timeout=1)", "Network is unreachable"),
])
def test_hostile_code_is_reported_and_the_next_prompt_runs(env, code, reported):
    ep = env.episode({"question": "q", "answer": 7})
    step = ep.step(act(f"```python\n{code}\n```"))
    assert not step.done and reported in tok.decode(step.observation)
    assert ep.step(act("Answer: 7")).reward == 1.0
    nxt = env.episode(env.sample_task(random.Random(0)))  # the next prompt runs normally
    assert "42" in tok.decode(nxt.step(act("```python\nprint(6 * 7)\n```")).observation)


def test_eight_episodes_at_once_are_isolated_from_each_other():
    """The producer's concurrency: 8 episodes' tool calls run at the same time (each in its own
    worker thread, as the service runs them); none sees another's files, processes or uid."""
    import asyncio

    code = ("import glob, os, time\n"
            "open('mine', 'w').write('secret-{i}')\n"
            "time.sleep(1.0)  # all eight are running now\n"
            "found = sorted(open(f).read() for f in glob.glob('/tmp/**', recursive=True)\n"
            "               if os.path.isfile(f) and not f.endswith('.py'))\n"
            "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "print('found', found, 'pids', len(pids), 'uid', os.getuid())\n")
    env = make_env("python-tool", tokenizer=tok, sandbox=Sandbox(SandboxConfig(timeout_s=30)), max_turns=3)
    episodes = [env.episode({"question": "q", "answer": i}) for i in range(8)]

    async def all_at_once():
        return await asyncio.gather(*(asyncio.to_thread(ep.step, act(f"```python\n{code.format(i=i)}```"))
                                      for i, ep in enumerate(episodes)))

    seen = [tok.decode(step.observation) for step in asyncio.run(all_at_once())]
    uids = set()
    for i, obs in enumerate(seen):
        assert f"found ['secret-{i}'] pids" in obs, obs  # its own file only
        assert int(obs.split("pids ")[1].split()[0]) <= 3  # its namespace: sh, python (and a child)
        uids.add(obs.split("uid ")[1].split()[0])
    assert len(uids) == 8
