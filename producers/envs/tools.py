"""Tools an agent calls: declared as plain Python functions, offered through the model's chat
template, called in the Hermes / Qwen JSON format.

- A tool is a function with annotated parameters and a Google-style docstring; `tool_schema` makes
  the JSON schema chat templates take from them (transformers' `get_json_schema`: the name, the
  docstring's first paragraph as the description, each `Args:` line as a parameter's).
- `render_chat` renders a conversation with its tools through the tokenizer's own template. A
  template that ignores `tools` (SmolLM2's ChatML) gets them as a Hermes system block instead, and
  a conversation's assistant `tool_calls` and `tool` results are rendered as the blocks below, so
  every model sees tools the same way whether or not its template knows them.
- A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the sampled text
  (`tool_calls` parses it; `sao serve`'s rollout proxy uses the same parser), and its result goes
  back as `<tool_response>...</tool_response>` in the next user turn (`tool_response`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
OPEN, CLOSE = "<tool_call>", "</tool_call>"

HERMES_SYSTEM = ("Tools:\n<tools>\n{tools}\n</tools>\nCall one as <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}"
                 "</tool_call>; its result comes in <tool_response>.")


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of tool `fn`, from its signature and docstring (a DocstringParsingException
    or TypeError names what is missing)."""
    from transformers.utils import get_json_schema  # only where tools are used

    schema = get_json_schema(fn)
    schema["function"].pop("return", None)  # not part of what templates show
    return schema


def tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """The calls in a sampled reply, `{"name": str, "arguments": ...}` for each well-formed
    `<tool_call>` block, and a problem for each block that is not (not JSON, no name, or a block
    left open at the end of the reply)."""
    calls, problems = [], []
    for m in _CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except (ValueError, RecursionError):  # RecursionError: JSON nested beyond Python's stack
            problems.append(f"not JSON: {m.group(1)[:80]!r}")
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            problems.append(f"no \"name\": {m.group(1)[:80]!r}")
            continue
        calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    if text.rfind(OPEN) > text.rfind(CLOSE):
        problems.append("a <tool_call> left open")
    return calls, problems


def strip_calls(text: str) -> str:
    """The reply without its `<tool_call>` blocks: what it says besides calling."""
    return _CALL.sub("", text)


def tool_response(outputs: list[str]) -> str:
    """The user turn that carries the results of one reply's calls, in call order."""
    return "\n".join(f"<tool_response>\n{out}\n</tool_response>" for out in outputs)


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, generation: bool = True) -> str:
    """`messages` (OpenAI chat format) rendered by the tokenizer's template, offering `tools`
    (module docstring)."""
    def apply(msgs: list[dict], **kw) -> str:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=generation, tokenize=False, **kw)
    if not tools:
        return apply(messages)
    native = apply(messages, tools=tools)
    if native != apply(messages):  # the template lists the tools itself
        return native
    listing = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, separators=(",", ":")) for t in tools))
    msgs = [_plain(m) for m in messages]
    if msgs and msgs[0]["role"] == "system":
        msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + listing}
    else:
        msgs.insert(0, {"role": "system", "content": listing})
    return apply(msgs)


def _plain(m: dict) -> dict:
    """A message as text a template without tool support renders: calls as blocks, results as a user turn."""
    if m.get("role") == "tool":
        return {"role": "user", "content": tool_response([m.get("content") or ""])}
    content = (m.get("content") or "") + "".join(
        OPEN + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))})
        + CLOSE for c in m.get("tool_calls") or ())
    return {"role": m["role"], "content": content}


def _arguments(args):
    try:
        return json.loads(args) if isinstance(args, str) else (args or {})
    except ValueError:
        return args  # arguments that are not JSON render as the string they are
