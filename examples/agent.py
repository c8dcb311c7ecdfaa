"""An agent written with the `openai` client, trained through `sao serve`'s rollout proxy.

    sao serve --model tiny-llama-bytes          # in another terminal (with a broker: `sao broker`)
    python examples/agent.py                    # --base-url, --episodes, --api-key (SAO_SERVE_TOKEN)

Each episode is one session: the first request asks for a new one (`"session": "new"` in the
body) and every later turn passes the receipt that came back. The model may call a `calculator`
tool; the agent runs it and sends the result as a tool message, nudges a model that neither calls
nor answers, and after `--max-turns` closes the session with reward 1 if the last reply holds the
right number, else 0. The proxy publishes the trajectory, built from the exact sampled token ids,
to `sao.trajectories`, where `sao learner` trains on it. The tiny random default model rarely calls
the tool, so most rewards are 0: the loop, not the score, is what this shows.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import random

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of numbers and + - * /.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
SYSTEM = "Answer with a number. Use the calculator tool for arithmetic."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, or what is wrong with it (never eval)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * /")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"


def first_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def play(client: OpenAI, question: str, answer: str, *, max_turns: int = 3, max_tokens: int = 100,
         temperature: float = 1.0, seed: int | None = None) -> dict:
    """One episode; the proxy's close receipt (session, topic, reward, num_turns, num_tokens)."""
    messages, session, content = first_messages(question), "new", ""
    for turn in range(max_turns):
        reply = client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=temperature,
            seed=None if seed is None else seed + turn, extra_body={"session": session})
        session = reply.model_extra["session"]  # the receipt: later turns and the close name it
        message = reply.choices[0].message
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
        content = message.content or ""
        if message.tool_calls:
            for call in message.tool_calls:
                try:
                    expression = str(json.loads(call.function.arguments).get("expression", ""))
                except (ValueError, AttributeError):
                    expression = call.function.arguments
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(expression)})
        elif answer in content:
            break
        else:
            messages.append({"role": "user", "content": "Call the calculator, then give the number."})
    reward = 1.0 if answer in content else 0.0
    return client.post(f"/sessions/{session}/close", body={"reward": reward}, cast_to=object)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=os.environ.get("SAO_SERVE_TOKEN") or "none",
                   help="the server's --serve-token (default: $SAO_SERVE_TOKEN)")
    p.add_argument("--episodes", type=int, default=3)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    client, rng = OpenAI(base_url=args.base_url, api_key=args.api_key), random.Random(args.seed)
    for i in range(args.episodes):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        receipt = play(client, f"What is {a} * {b}?", str(a * b), max_turns=args.max_turns, seed=args.seed + 10 * i)
        print(json.dumps(receipt))


if __name__ == "__main__":
    main()
