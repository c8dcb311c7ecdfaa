"""The OpenAI-compatible request and response shapes of `sao serve`, as pure functions.

`POST /v1/completions` is the subset of `vllm serve` that producers use (docs/vllm.md §3.2): a token-id
`prompt`, `logprobs: 0`, `return_token_ids`, explicit sampling fields. `POST /v1/chat/completions`
takes OpenAI chat messages (and `tools`), streamed or not; its replies carry the sampled
`token_ids` and, like completions, `weight_versions`: spans `{version, start, end}` over the
output tokens, since weights may change in the middle of a request.

Chat messages are normalized to what the template renders and a session's later turn must
repeat (role, text, tool calls and their ids); tool calls are parsed out of sampled text in the
Hermes style, `<tool_call>{"name": …, "arguments": …}</tool_call>` (the byte tokenizer's template,
Qwen, Hermes), and a reply without them, or with a block that is not such JSON, stays content.

Both refuse, with a 400 naming the field, what would sample from anything but `softmax(logits / T)`
(penalties, min_p, logit bias, stop strings, guided decoding, n > 1, alternatives in `logprobs`): the
log-probs returned, and trained on, must be those of the distribution actually sampled from.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import numpy as np

from producers.envs.tools import OPEN, strip_calls, tool_calls
from producers.generate.base import NEUTRAL_SAMPLING, Generation, SamplingParams
from schemas.http import RequestError  # the one refusal type of both HTTP servers; re-exported here

_UNSUPPORTED = ("logit_bias", "bad_words", "allowed_token_ids", "min_tokens", "stop", "echo",
                "guided_json", "guided_regex", "guided_choice", "structured_outputs", "prompt_logprobs",
                "functions", "function_call", "top_logprobs")

ROLES = ("system", "user", "assistant", "tool")


def check_context(prompt_len: int, max_tokens: int, context: int) -> None:
    """RequestError unless the prompt plus `max_tokens` fits the model's context window."""
    if prompt_len + max_tokens > context:
        raise RequestError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                           f"model's context window of {context} tokens")


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """The content and OpenAI tool calls of a sampled reply; all content unless every
    `<tool_call>` block holds {"name": str, "arguments": …} (producers/envs/tools.py)."""
    calls, problems = tool_calls(text)
    if problems or not calls:
        return text, []
    return strip_calls(text), [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(
                                    c["arguments"], str) else json.dumps(c["arguments"])}} for c in calls]


def streamable(text: str, tools: bool) -> int:
    """How much of a reply still being sampled can be sent: not a trailing partial UTF-8
    character, and with tools nothing from a `<tool_call>` (or what may begin one) on, since a
    call is known only once complete."""
    n = len(text.rstrip("\ufffd"))
    if tools:
        at = text.find(OPEN, 0, n)
        if at >= 0:
            return at
        n -= next((k for k in range(len(OPEN) - 1, 0, -1) if text[:n].endswith(OPEN[:k])), 0)
    return n


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where}.content: expected a string or a list of text parts")


def _tool_calls(calls, where: str) -> list[dict]:
    try:
        return [{"id": str(c["id"]), "type": "function",
                 "function": {"name": str(c["function"]["name"]), "arguments": str(c["function"]["arguments"])}}
                for c in calls]
    except (KeyError, TypeError):
        raise RequestError(f"{where}.tool_calls: expected [{{id, function: {{name, arguments}}}}]") from None


def normalize(messages) -> list[dict]:
    """Messages as the template renders them and a later turn compares them: role, text content,
    and the ids, names and arguments of tool calls and tool results."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"{where}: expected an object whose role is one of {ROLES}")
        msg = {"role": m["role"], "content": _text(m.get("content"), where)}
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        for name in ("tool_call_id", "name"):
            if m.get(name) is not None:
                msg[name] = str(m[name])
        out.append(msg)
    return out


def parse_sampling(body: dict, n_tokens, max_tokens: int) -> SamplingParams:
    """The sampling fields both endpoints share; RequestError names the bad one. SamplingParams
    checks the values; refused here is what it cannot express (n, penalties, other samplers)."""
    if body.get("n", 1) != 1:
        raise RequestError("n: only n=1 is served")
    for name, neutral in NEUTRAL_SAMPLING.items():
        if body.get(name, neutral) != neutral:
            raise RequestError(f"{name}: must be {neutral}; it would change the sampled distribution")
    for name in _UNSUPPORTED:
        if body.get(name):
            raise RequestError(f"{name}: not supported")
    stop, top_k = body.get("stop_token_ids") or [], body.get("top_k", 0)
    if not isinstance(stop, list):
        raise RequestError("stop_token_ids: expected a list of token ids")
    try:
        params = SamplingParams(temperature=body.get("temperature", 1.0), max_tokens=n_tokens,
                                top_p=body.get("top_p", 1.0), top_k=0 if top_k == -1 else top_k,  # -1: vLLM's off
                                stop_token_ids=tuple(stop), seed=body.get("seed"))
    except ValueError as e:  # its message starts with the field's name
        raise RequestError(str(e)) from None
    if params.max_tokens > max_tokens:
        raise RequestError(f"max_tokens: must be at most {max_tokens} (the server's --max-tokens)")
    return params


def parse_request(body: dict, max_tokens: int = 4096) -> tuple[list[int], SamplingParams]:
    """Prompt ids and sampling params of a completions request; RequestError names the bad field."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of one
    if not (isinstance(prompt, list) and prompt and
            all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        raise RequestError("prompt: expected a non-empty list of token ids (text prompts are not served)")
    if body.get("stream"):
        raise RequestError("stream: completions are not streamed")
    if body.get("logprobs") not in (None, 0):
        raise RequestError("logprobs: only 0 (the sampled token's log-prob) is served")
    return prompt, parse_sampling(body, body.get("max_tokens", 16), max_tokens)


@dataclass(kw_only=True)
class ChatRequest:
    messages: list[dict]
    tools: list | None
    params: SamplingParams
    max_tokens: int | None
    """None: as many as fit the context window (capped by the server's max_tokens)."""
    stream: bool
    logprobs: bool
    usage_chunk: bool
    """Streaming: send a last chunk with the usage (stream_options.include_usage)."""
    parse_tools: bool
    session: str | None
    prompt_id: str | None


def parse_chat(body: dict, max_tokens: int = 4096, session: str | None = None) -> ChatRequest:
    """A chat request; `session` (the X-SAO-Session header) stands in for a missing `session` field."""
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools: expected a list of objects")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError("tool_choice: only auto or none (forcing a call would change the distribution)")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise RequestError("response_format: only text")
    session, prompt_id = body.get("session", session), body.get("prompt_id")
    if not (session is None or isinstance(session, str) and session) or not (
            prompt_id is None or isinstance(prompt_id, str) and prompt_id):
        raise RequestError("session/prompt_id: expected non-empty strings")
    given = body.get("max_completion_tokens")  # the current name; max_tokens is the deprecated one
    given = body.get("max_tokens") if given is None else given
    stream_options = body.get("stream_options") or {}
    return ChatRequest(messages=normalize(body.get("messages")), tools=tools,
                       params=parse_sampling(body, max_tokens if given is None else given, max_tokens),
                       max_tokens=given, stream=bool(body.get("stream")), logprobs=bool(body.get("logprobs")),
                       usage_chunk=isinstance(stream_options, dict) and bool(stream_options.get("include_usage")),
                       parse_tools=bool(tools) and choice != "none", session=session, prompt_id=prompt_id)


def version_spans(versions: np.ndarray) -> list[dict]:
    """[{version, start, end}] runs of equal versions over output-token indexes."""
    spans = []
    for i, v in enumerate(versions.tolist()):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def usage(prompt_len: int, out: Generation) -> dict:
    n = len(out.token_ids)
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


def completion_response(out: Generation, prompt_ids: list[int], model: str, text: str) -> dict:
    tokens, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
    names = [f"token_id:{t}" for t in tokens]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "usage": usage(len(prompt_ids), out),
            "choices": [{"index": 0, "text": text, "finish_reason": out.finish_reason,
                         "stop_reason": tokens[-1] if out.finish_reason == "stop" else None,
                         "token_ids": tokens, "prompt_token_ids": prompt_ids,
                         "logprobs": {"tokens": names, "token_logprobs": logprobs,
                                      "top_logprobs": [{n: x} for n, x in zip(names, logprobs)],
                                      "text_offset": []},
                         "weight_versions": version_spans(out.versions)}]}


def assistant_reply(text: str, parse_tools: bool) -> dict:
    """The assistant message of a sampled reply, normalized as a later turn must repeat it."""
    content, calls = parse_tool_calls(text) if parse_tools else (text, [])
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def finish_reason(out: Generation, reply: dict) -> str:
    return "tool_calls" if reply.get("tool_calls") else out.finish_reason


def chat_logprobs(out: Generation) -> dict:
    return {"content": [{"token": f"token_id:{t}", "logprob": x, "bytes": None, "top_logprobs": []}
                        for t, x in zip(out.token_ids.tolist(), out.logprobs.tolist())]}


def chat_response(out: Generation, prompt_len: int, model: str, reply: dict, *, session: str | None,
                  logprobs: bool) -> dict:
    message = {**reply, "content": reply["content"] or (None if reply.get("tool_calls") else "")}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "session": session, "usage": usage(prompt_len, out),
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(out, reply),
                         "logprobs": chat_logprobs(out) if logprobs else None,
                         "token_ids": out.token_ids.tolist(), "weight_versions": version_spans(out.versions)}]}


def chat_chunk(head: dict, delta: dict, **choice) -> dict:
    """One streamed chunk; `head` holds id, object, created, model and session."""
    return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None, **choice}]}
