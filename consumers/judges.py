"""Judges: `judge(prompt, completion, criterion) -> reward`, plain callables.

Built in: `style`, a rule-based judge whose criteria are measurable styles (each a share in [0, 1]
of the completion's characters or a bound on its length, so the experiment in
`bench/style_shift.py` can plot how much of each style the policy produces), and `LLMJudge`, which
asks a completions server (`sao serve`, vLLM) to rate the completion against the criterion.
Any other judge is `module:callable` with the same signature.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import httpx

from schemas.config import ConfigError
from schemas.plugins import load_callable

log = logging.getLogger(__name__)

Judge = Callable[[str, str, str], float]


def _share(predicate: Callable[[str], bool]) -> Callable[[str], float]:
    return lambda text: sum(map(predicate, text)) / len(text) if text else 0.0


STYLES: dict[str, Callable[[str], float]] = {
    "uppercase": _share(lambda c: "A" <= c <= "Z"),
    "lowercase": _share(lambda c: "a" <= c <= "z"),
    "digits": _share(str.isdigit),
    "spaces": _share(str.isspace),
    "concise": lambda text: max(0.0, 1.0 - len(text.split()) / 30),
    "exclaim": lambda text: min(text.count("!"), 5) / 5,
}
"""Style name → score of a completion in [0, 1]."""


def style(prompt: str, completion: str, criterion: str) -> float:
    """The share of the completion in the style `criterion` names (one of STYLES)."""
    if criterion not in STYLES:
        raise ValueError(f"unknown style {criterion!r}; the style judge knows {sorted(STYLES)}")
    return STYLES[criterion](completion)


def style_profile(completion: str) -> dict[str, float]:
    """Every style's score: what a policy's outputs look like, whatever is being rewarded."""
    return {name: score(completion) for name, score in STYLES.items()}


class LLMJudge:
    """Rates a completion 0..10 against the criterion with a completions server; reward = rating / 10.

    The judge prompt goes as token ids when a tokenizer is given (`sao serve` takes ids only; vLLM
    takes both). An answer with no number in 0..10 scores 0 and is logged.
    """

    TEMPLATE = ("Rate from 0 to 10 how well the response follows this instruction: {criterion}\n\n"
                "Prompt: {prompt}\nResponse: {completion}\n\nRating (a number from 0 to 10):")

    def __init__(self, url: str, tokenizer=None, max_tokens: int = 4, timeout: float = 60.0, token: str = ""):
        self.url = url.rstrip("/") + "/v1/completions"
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.client = httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {token}"} if token else {})

    def __call__(self, prompt: str, completion: str, criterion: str) -> float:
        text = self.TEMPLATE.format(criterion=criterion, prompt=prompt, completion=completion)
        body = {"prompt": self.tokenizer.encode(text) if self.tokenizer is not None else text,
                "max_tokens": self.max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": 0}
        resp = self.client.post(self.url, json=body)
        resp.raise_for_status()
        answer = resp.json()["choices"][0]["text"]
        found = re.search(r"\d+(?:\.\d+)?", answer)
        if found is None or not 0 <= float(found.group()) <= 10:
            log.info("llm judge: no rating in %r; reward 0", answer)
            return 0.0
        return float(found.group()) / 10


def load_judge(spec: str, *, llm_url: str = "", tokenizer=None, token: str = "") -> Judge:
    """`style`, `llm` (needs `llm_url`; `token`: its bearer token) or `module:callable`."""
    match spec:
        case "style":
            return style
        case "llm":
            if not llm_url:
                raise ConfigError("--judge llm needs --llm-url (a completions server such as `sao serve`)")
            return LLMJudge(llm_url, tokenizer, token=token)
    if ":" not in spec:
        raise ConfigError(f"--judge {spec!r}: expected style, llm or module:callable")
    return load_callable(spec, "--judge", ("prompt", "completion", "criterion"))
