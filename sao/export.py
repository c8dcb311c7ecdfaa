"""`sao export`: one version of the policy as a folder `transformers` and `vllm serve` load.

The weights come from where a run keeps them, exactly as they were at that version:

- the weight store and `sao.weights` (default): the version's anchor and the deltas after it,
  rebuilt and verified against the announced digest as a producer rebuilds them
  (schemas/weights/chain.py), in the dtype they were published in (`--weights.dtype` of the learner;
  float32 for the learner's exact weights);
- a learner checkpoint (`--checkpoint`: a `step…` folder, or the learner's run dir for its newest):
  the policy's float32 master weights at the version the checkpoint holds, read from its DCP
  shards without a process group.

The folder holds `config.json`, `model.safetensors`, `generation_config.json`, the tokenizer with
its chat template (the byte tokenizer of `tiny-llama-bytes` as a transformers tokenizer; models over
raw token ids have none), and `export.json` saying what it is. LoRA runs export the merged weights
`W + scale · B @ A`, and the adapter alone as a PEFT folder in `<out>/adapter` (its base is the
run's `--model.name`). The folder is written beside `--out` and renamed over it, whole or not at all.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ExportConfig:
    out: Path = Path("runs/export")
    """The folder to write (replaced whole if it exists)."""
    version: int = -1
    """Policy version to export; -1: the newest announced (or, with --checkpoint, the checkpoint's)."""
    checkpoint: Path | None = None
    """Export from a learner checkpoint instead of the weight store: a `step…` folder, or a learner
    run dir (its newest). Its model is described by --weights-dir."""
    weights_dir: Path = Path("runs/weights")
    """The learner's weight store, for --checkpoint (config.json, model.json); from the weight
    store, the announcements name it."""
    adapter: bool = True
    """LoRA runs: also write the adapter alone as a PEFT folder, <out>/adapter."""
    trusted_keys: str = ""
    """Comma-separated Ed25519 public keys (PEM) of the learner: from the weight store, only
    announcements it signed are used (as a producer's --weights.trusted-keys); empty: not verified."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)


@dataclass(kw_only=True)
class Policy:
    """A policy version's weights under their published names (LoRA adapters beside the base),
    and what describes it."""

    version: int
    tensors: dict[str, torch.Tensor]
    store: Path
    source: str
    lora_scale: float | None = None


# ---------------------------------------------------------------- where the weights come from

def from_weights(kafka: KafkaConfig, version: int = -1, trusted: dict | None = None) -> Policy:
    """Version `version` (-1: the newest) rebuilt from `sao.weights` and the store its
    announcements name, verified link by link and against its digest (and with `trusted` keys,
    from announcements the learner signed only)."""
    from schemas.weights.chain import WeightsError, local_path, plan, rebuild
    from schemas.weights.announcements import decode_announcement, read_backlog, weights_reader
    from schemas.weights import payload as W

    consumer = weights_reader(kafka)
    try:
        history = read_backlog(consumer, 1 << 30, lambda m: decode_announcement(m, trusted)[0], threading.Event(),
                               0.5)
    finally:
        consumer.close()
    if not history:
        raise ConfigError(f"--version: nothing was ever announced on {kafka.topic(T.WEIGHTS)}")
    target = max(w.version for w in history) if version < 0 else version
    chain = plan([w for w in history if w.version <= target], -1)
    if not chain or chain[-1].version != target:
        known = sorted({w.version for w in history})
        raise ConfigError(f"--version {target}: not reachable from an anchor on {kafka.topic(T.WEIGHTS)} "
                          f"(announced: {known[0]}..{known[-1]}; the store keeps the last anchors only)")
    state, failed, error = rebuild(chain, None)
    if failed is not None:
        raise WeightsError(f"version {target}: {error}")
    scale = state.extra.get("lora_scale")
    return Policy(version=target, tensors={k: W.to_torch(t).clone() for k, t in state.state.items()},
                  store=local_path(chain[-1].store), source=f"sao.weights (digest {chain[-1].digest})",
                  lora_scale=None if scale is None else float(scale))


def from_checkpoint(path: Path, store: Path, version: int = -1) -> Policy:
    """The policy in a learner checkpoint (`path` a `step…` folder or a learner run dir: its
    newest), read from the DCP shards without a process group; `version` must match it if given."""
    import msgpack
    import torch.distributed.checkpoint as dcp

    from learner.lora import published_name

    path = Path(path)
    if not (path / ".metadata").is_file():
        steps = sorted((path / "checkpoints").glob("step*")) if (path / "checkpoints").is_dir() else []
        if not steps:
            raise ConfigError(f"--checkpoint {path}: neither a learner checkpoint (step…/) nor a run dir holding one")
        path = steps[-1]
    data = msgpack.unpackb((path / "learner.msgpack").read_bytes(), raw=False, strict_map_key=False)
    if version >= 0 and data["version"] != version:
        raise ConfigError(f"--version {version}: checkpoint {path} holds version {data['version']}")
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    template = {k.removeprefix("policy."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
                for k, m in meta.items() if k.startswith("policy.")}
    loaded = {"policy": template}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(loaded, checkpoint_id=path, no_dist=True)
    lora = _described(store).get("lora")
    return Policy(version=data["version"], tensors={published_name(k): t for k, t in loaded["policy"].items()},
                  store=store, source=f"checkpoint {path}", lora_scale=lora["alpha"] / lora["rank"] if lora else None)


def _described(store: Path) -> dict:
    """The store's model.json: the learner's `--model.name` (and its LoRA settings)."""
    try:
        return json.loads((Path(store) / "model.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"--weights-dir {store}: no model.json; is it the learner's weight store?") from None


# ---------------------------------------------------------------- the folder

def merged_and_adapters(policy: Policy) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the plain weights a model folder holds, the LoRA adapters alone: {} without LoRA)."""
    from schemas.weights.chain import merged
    from schemas.weights import payload as W

    adapters = {k: t for k, t in policy.tensors.items() if ".lora_A." in k or ".lora_B." in k}
    if not adapters:
        return dict(policy.tensors), {}
    if policy.lora_scale is None:
        raise ConfigError(f"{policy.source}: LoRA adapters without their scale (alpha / rank)")
    plain = merged({k: W.from_torch(t) for k, t in policy.tensors.items()}, policy.lora_scale)
    return {k: W.to_torch(t).clone() for k, t in plain.items()}, adapters


def write(policy: Policy, out: Path, *, adapter: bool = True) -> Path:
    """`policy` as a transformers folder at `out` (atomically), with its tokenizer and, for LoRA,
    the adapter alone in `out/adapter`."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from learner.sft import save
    from schemas.tokenizers import ByteTokenizer, load_tokenizer

    name = _described(policy.store)["name"]
    plain, adapters = merged_and_adapters(policy)
    dtype = next(iter(plain.values())).dtype
    config = AutoConfig.from_pretrained(policy.store, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing = set(model.state_dict()) - set(plain)
    if missing - {"lm_head.weight"} or (missing and not config.tie_word_embeddings):
        raise ConfigError(f"{policy.source}: the weights lack {sorted(missing)[:4]} of the store's architecture")
    model.load_state_dict(plain, strict=False, assign=True)
    model.tie_weights()
    tokenizer = load_tokenizer(name)
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer = tokenizer.to_transformers()

    def extra(folder: Path) -> None:
        gen = GenerationConfig.from_model_config(config)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
            gen.eos_token_id, gen.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        gen.save_pretrained(folder)
        if adapters and adapter:
            _peft_folder(adapters, policy.lora_scale, name, folder / "adapter")
        (folder / "export.json").write_text(json.dumps({
            "version": policy.version, "source": policy.source, "model": name, "dtype": str(dtype).removeprefix("torch."),
            "tokenizer": tokenizer is not None, "lora_merged": bool(adapters), "exported_at": time.time()}, indent=1))

    return save(model, Path(out), extra)


def _peft_folder(adapters: dict[str, torch.Tensor], scale: float, base: str, folder: Path) -> None:
    """The adapters as PEFT writes them (`adapter_config.json`, `adapter_model.safetensors`, names
    under `base_model.model.`), loadable with `PeftModel.from_pretrained(base, folder)`."""
    from safetensors.torch import save_file

    folder.mkdir()
    rank = next(t.shape[0] for k, t in adapters.items() if ".lora_A." in k)
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapters})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": scale * rank, "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True}, indent=1))
    save_file({f"base_model.model.{k}": t.contiguous() for k, t in adapters.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def run(cfg: ExportConfig) -> Path:
    from schemas.signing import load_trusted

    trusted = load_trusted(cfg.trusted_keys, "--trusted-keys") if cfg.trusted_keys else None
    policy = (from_checkpoint(cfg.checkpoint, cfg.weights_dir, cfg.version) if cfg.checkpoint is not None
              else from_weights(cfg.kafka, cfg.version, trusted))
    out = write(policy, cfg.out, adapter=cfg.adapter)
    log.info("exported version %d (%s) to %s", policy.version, policy.source, out)
    print(out, flush=True)
    return out
