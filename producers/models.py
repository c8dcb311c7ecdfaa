"""Policy models and tokenizers for producers, by name, with no network access.

- a name of the catalogue (schemas/catalogue.py: the tiny models, `smollm2`, a `.gguf` file, a
  transformers folder, a hub id in the local cache), built exactly as the learner builds it;
  SmolLM2's tokenizer and ChatML template come from the same GGUF.
- `learner` (`load_learner_model`): the architecture in the learner's weight store, random until
  the weight subscription loads the learner's newest version into it.

Also the transformers folder an engine that loads from disk (vLLM) is given (`engine_folder`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from schemas.catalogue import build_named
from schemas.tokenizers import load_tokenizer


def load_model(name: str, *, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """The policy named `name`, in float32 on `device`, in eval mode."""
    return build_named(name, seed=seed).to(device).eval()


CACHE = Path.home() / ".cache" / "sao-stream" / "models"
"""Where `engine_folder` keeps the transformers folders it makes (once each)."""


def engine_folder(name: str, *, seed: int = 0, cache: Path = CACHE) -> Path:
    """A transformers folder (config.json and safetensors, float32) of the policy `name`, for an
    engine that loads models from disk (vLLM): a folder as given, else made once into `cache`,
    atomically. SmolLM2 is the GGUF de-quantized exactly as `load_model` does it, so the engine
    starts on the very weights the learner starts on; its tokenizer files go with it."""
    if Path(name).is_dir():
        return Path(name)
    folder = cache / (f"{name}-seed{seed}" if name.startswith("tiny-") else name)
    if (folder / "config.json").is_file():
        return folder
    model = load_model(name, seed=seed)
    config = model.config
    if hasattr(config, "quantization_config"):  # GGUF: the tensors are plain float32 now
        del config.quantization_config
    tmp = cache / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(tmp, safe_serialization=True)
    if name == "smollm2":
        load_tokenizer(name).save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise
    return folder


def load_learner_model(store: Path, *, device: str = "cpu") -> tuple[torch.nn.Module, str]:
    """The learner's architecture from its weight store's `config.json`, in float32 on `device`
    and in eval mode, with random weights; and the learner's model name, whose tokenizer goes
    with it (`model.json`)."""
    config = AutoConfig.from_pretrained(store, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(device).eval(), learner_model_name(store)


def learner_model_name(store: Path) -> str:
    """The `--model.name` of the learner whose weight store this is (`model.json`)."""
    return json.loads((Path(store) / "model.json").read_text())["name"]
