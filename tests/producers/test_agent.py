"""Tool-using agents: tools declared as functions and offered through the chat template, calls in
the Hermes JSON format, the calc-agent task played through its stateful python session, and the
limits that end an episode (invalid calls in a row, the deadline, the turn budget), each with its
reason; the episode's session is closed however the episode ends."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from producers.envs import make_env
from producers.envs.agent import AgentLimits, ToolEpisode, ToolError, ToolSet, python, python_tools
from producers.envs.calc import CalcAgentEnv, Progress, apply, check_task, demonstration, question
from producers.envs.chat import Chat
from producers.envs.tools import CLOSE, HERMES_SYSTEM, OPEN, render_chat, tool_calls, tool_response, tool_schema
from producers.sandbox import Sandbox, SandboxConfig
from schemas.messages import SchemaError
from schemas.tokenizers import ByteTokenizer, load_tokenizer
from tests.producers.test_sandbox import _sandbox_pids

CFG = SandboxConfig(timeout_s=3.0, uid_base=380_000)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(CFG)


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("smollm2")


def lookup(city: str, metric: bool = True) -> str:
    """The weather in a city.

    Args:
        city: Its name.
        metric: Celsius rather than Fahrenheit.
    """
    if city == "Atlantis":
        raise ToolError("no such city")
    return f"{city}: 21 {'C' if metric else 'F'}"


def test_a_function_is_declared_by_its_signature_and_docstring():
    schema = tool_schema(lookup)["function"]
    assert schema["name"] == "lookup" and schema["description"] == "The weather in a city."
    assert schema["parameters"]["properties"]["city"] == {"type": "string", "description": "Its name."}
    assert schema["parameters"]["required"] == ["city"]
    assert tool_schema(python)["function"]["name"] == "python"


@pytest.mark.parametrize("text,calls,problems", [
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>', [("python", {"code": "1"})], 0),
    ('a <tool_call>{"name": "x"}</tool_call> b <tool_call>{"name": "y", "arguments": {}}</tool_call>',
     [("x", {}), ("y", {})], 0),
    ("<tool_call>{not json}</tool_call>", [], 1),
    ('<tool_call>{"arguments": {}}</tool_call>', [], 1),
    ('<tool_call>{"name": "python", "arguments": {"code": "1"', [], 1),  # cut at the token budget
    ("Answer: 42", [], 0),
])
def test_tool_calls_are_parsed_from_hermes_blocks(text, calls, problems):
    got, bad = tool_calls(text)
    assert [(c["name"], c["arguments"]) for c in got] == calls and len(bad) == problems


def test_a_template_without_tool_support_gets_the_tools_as_a_hermes_system_block(smollm2):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    text = render_chat(smollm2, messages, [tool_schema(lookup)])
    assert '"name":"lookup"' in text and "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")
    assert HERMES_SYSTEM.split("\n")[0] in text
    # a conversation's tool calls and results render as the blocks a model samples and reads
    chat = [*messages, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Oslo: 21 C"}]
    text = render_chat(smollm2, chat, [tool_schema(lookup)])
    assert '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert tool_response(["Oslo: 21 C"]) in text
    # a template that lists tools itself keeps its own rendering
    own = ByteTokenizer()
    assert render_chat(own, messages, [tool_schema(lookup)]) == own.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, tools=[tool_schema(lookup)])


def test_a_failing_call_returns_its_error_to_the_model():
    tools = ToolSet([lookup])
    assert tools.call("lookup", {"city": "Oslo"}) == ("Oslo: 21 C", True)
    for name, args, says in (("weather", {}, "no tool named 'weather'"), ("lookup", {"town": "Oslo"}, "argument"),
                             ("lookup", ["Oslo"], "JSON object"), ("lookup", {"city": "Atlantis"}, "no such city")):
        out, ok = tools.call(name, args)
        assert not ok and says in out


def play(episode: ToolEpisode, chat: Chat, replies: list[str]) -> list:
    """Each reply as the token ids a model would have sampled (ending with its stop token)."""
    steps = []
    stop = chat.stop_token_ids()[-1]
    for reply in replies:
        steps.append(episode.step(chat.encode(reply) + [stop]))
        if steps[-1].done:
            break
    return steps


def test_a_demonstration_solves_its_task_through_one_session_whose_variables_persist(sandbox, smollm2):
    env = CalcAgentEnv(tokenizer=smollm2, sandbox=sandbox)
    task = next(t for t in (env.sample_task(random.Random(s)) for s in range(50)) if len(t["steps"]) >= 3)
    demo = demonstration(task)
    episode = env.episode(task)
    try:
        steps = play(episode, Chat(smollm2), [reply for reply, _ in demo])
    finally:
        episode.close()
    assert [s.done for s in steps] == [False] * (len(demo) - 1) + [True]
    for step, (_, output) in zip(steps, demo):  # each later call used the variable the earlier one set
        if not step.done:
            assert output in smollm2.decode(step.observation)
            assert (step.tool_calls, step.tool_errors) == (1, 0)
    assert steps[-1].reward == 1.0 and steps[-1].reason == ""
    assert str(task["answer"]) in demo[-1][0] and task["item"] in question(task)


def python_call(code: str) -> str:
    return OPEN + json.dumps({"name": "python", "arguments": {"code": code}}) + CLOSE


def test_with_a_step_reward_each_operation_a_tool_output_shows_done_pays_once_and_a_turn_showing_none_costs(sandbox, smollm2):
    env = CalcAgentEnv(tokenizer=smollm2, sandbox=sandbox, step_reward=0.2)
    task = next(t for t in (env.sample_task(random.Random(s)) for s in range(50)) if len(t["steps"]) >= 3)
    running = [task["start"]]
    for op, *args in task["steps"]:
        running.append(apply(op, running[-1], args))
    demo = [reply for reply, _ in demonstration(task)]
    replies = {  # each one's turn rewards, then its outcome
        "the demonstration": (demo, [0.2] * len(task["steps"]) + [1.0]),
        # two operations in one call count both; the same value again, a failed call and the start cost
        "skipping ahead, repeating, failing": (
            [python_call(f"print({running[2]})"), python_call(f"print({running[2]})"), python_call("print(1/0)"),
             python_call(f"print({running[0]})"), "Answer: 0"], [0.4, -0.2, -0.2, -0.2, 0.0]),
        "stopping short": ([demo[0], f"Answer: {running[1]}"], [0.2, 0.0])}
    for name, (actions, expected) in replies.items():
        episode = env.episode(task)
        try:
            got = [step.reward for step in play(episode, Chat(smollm2), actions)]
        finally:
            episode.close()
        assert got == pytest.approx(expected), name
    plain = CalcAgentEnv(tokenizer=smollm2, sandbox=sandbox).episode(task)  # the answer alone: no turn reward
    try:
        assert [step.reward for step in play(plain, Chat(smollm2), demo)] == [None] * len(task["steps"]) + [1.0]
    finally:
        plain.close()
    progress = Progress(task, 0.5)  # an output's last line is what counts
    assert progress([f"working\n{running[1]}\n"]) == 0.5 and progress([f"{running[3]} and more"]) == -0.5


def test_replies_whose_calls_all_fail_end_the_episode_after_the_limit(sandbox, smollm2):
    chat = Chat(smollm2)
    episode = ToolEpisode(prompt_ids=[1], chat=chat, tools=python_tools(sandbox), score=lambda t: 1.0,
                          limits=AgentLimits(max_invalid_calls=2))
    bad = '<tool_call>{"name": "python", "arguments": {"code": "1/0"}}</tool_call>'
    good = '<tool_call>{"name": "python", "arguments": {"code": "7"}}</tool_call>'
    steps = play(episode, chat, [bad, good, "<tool_call>{oops}</tool_call>", bad])
    episode.close()
    assert "ZeroDivisionError" in smollm2.decode(steps[0].observation) and steps[0].tool_errors == 1
    assert steps[1].tool_errors == 0  # a good call resets the count
    assert "malformed tool call" in smollm2.decode(steps[2].observation)
    assert steps[3].done and steps[3].reason == "invalid_calls" and steps[3].reward == 0.0


def test_the_deadline_and_the_turn_budget_end_an_episode_with_their_reasons(sandbox, smollm2):
    chat = Chat(smollm2)
    call = '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
    late = ToolEpisode(prompt_ids=[1], chat=chat, tools=ToolSet([]), score=lambda t: 1.0,
                       limits=AgentLimits(deadline_s=0.05))
    time.sleep(0.1)
    assert play(late, chat, ["Answer: 3"])[0].reason == "deadline"
    busy = ToolEpisode(prompt_ids=[1], chat=chat, tools=python_tools(sandbox), score=lambda t: 1.0,
                       limits=AgentLimits(max_turns=3))
    steps = play(busy, chat, [call] * 5)
    busy.close()
    assert len(steps) == 3 and steps[-1].reason == "max_turns" and steps[-1].reward == 0.0


def test_closing_the_episode_ends_its_session(sandbox, smollm2):
    before = set(_sandbox_pids(CFG))
    episode = make_env("calc-agent", tokenizer=smollm2, sandbox=sandbox).episode(
        CalcAgentEnv().sample_task(random.Random(0)))
    play(episode, Chat(smollm2), ['<tool_call>{"name": "python", "arguments": {"code": "x = 1"}}</tool_call>'])
    assert set(_sandbox_pids(CFG)) - before
    episode.close()
    deadline = time.monotonic() + 10
    while set(_sandbox_pids(CFG)) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_sandbox_pids(CFG)) - before


def test_a_task_that_is_not_calc_agents_is_refused():
    task = CalcAgentEnv().sample_task(random.Random(1))
    assert check_task(task) is task
    with pytest.raises(SchemaError, match="task"):
        check_task({**task, "answer": task["answer"] + 1})
    with pytest.raises(SchemaError, match="task"):
        check_task({**task, "steps": [["rm -rf", 1]]})


def test_calc_agent_episodes_are_long_tailed_in_their_operations():
    rng, env = random.Random(0), CalcAgentEnv()
    counts = np.bincount([len(env.sample_task(rng)["steps"]) for _ in range(2000)], minlength=6)[1:]
    assert counts[0] > counts[2] > counts[4] > 0 and counts[3] >= 0.07 * 2000 * 0.8
