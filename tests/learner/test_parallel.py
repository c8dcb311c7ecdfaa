"""Data parallelism on real gloo ranks: 2 ranks with the step split equal 1 rank with the whole
step, each rank runs about half the tokens, and sharded checkpoints resume on another world size."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.checkpoint import Checkpointer
from learner.microbatch import balanced_shares, micro_batches
from learner.models import ModelConfig, build_models, build_policy
from learner.parallel import ParallelConfig, decoder_blocks, gather_buckets, init_distributed
from learner.update import SAOUpdate, UpdateConfig
from sao.broker import free_port
from schemas.process import native_bf16


def _rollouts():
    from tests.learner.service_util import rollouts
    return rollouts(12, seed=5)


def _worker(rank: int, world: int, port: int, out: str, steps: tuple[int, int], resume: str,
            gather_once: bool | None) -> None:
    """Train steps [first, last) of 4 trajectories each, optionally from a checkpoint, then save
    the full policy (rank 0), this rank's token counter, and a checkpoint."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    _, _, device = init_distributed("cpu")
    cfg = UpdateConfig(algorithm="sao", warmup_steps=0, lr_policy=1e-3, lr_critic=1e-3,
                       micro_batch_tokens=32)
    source = build_policy(ModelConfig()) if rank == 0 else None
    exact = ParallelConfig(gather_once=gather_once, critic_mixed_precision=False)  # float32 on any CPU
    policy, critic = build_models(source, cfg.settings.uses_critic, exact, device)
    update = SAOUpdate(policy, critic, cfg)
    ckpt = Checkpointer(Path(out) / "checkpoints")
    if resume:
        path = Path(resume)
        update.load_state_dict(Checkpointer.load(path, update.state_dict(optimizers=Checkpointer.saved_keys(path))))
    trajs = _rollouts()
    for i in range(*steps):
        update.step(trajs[4 * i: 4 * i + 4])
    ckpt.save(update.step_count, update.state_dict())
    ckpt.wait()
    full = {name: t for bucket in gather_buckets(policy, torch.float32, bucket_bytes=4096) for name, t in bucket}
    if rank == 0:
        torch.save(full, Path(out) / "policy.pt")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"tokens": update.rank_tokens}))
    dist.destroy_process_group()


def train(out: Path, world: int, steps=(0, 3), resume: Path | None = None, gather_once: bool | None = None):
    """SAO steps of 4 trajectories, micro-batches of at most 32 tokens, on `world` gloo ranks."""
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(world, free_port(), str(out), steps, str(resume or ""), gather_once),
             nprocs=world, join=True)
    tokens = [json.loads((out / f"rank{r}.json").read_text())["tokens"] for r in range(world)]
    return torch.load(out / "policy.pt", weights_only=True), tokens


def assert_same(a, b, tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=tol, rtol=tol, msg=k)


def test_token_balanced_shares_and_budgeted_micro_batches():
    lengths = [10, 3, 7, 7, 2, 9]
    shares = balanced_shares(lengths, 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= max(lengths)
    assert micro_batches(lengths, range(6), 14, packed=True) == [[0], [5], [2, 3], [1, 4]]
    assert micro_batches(lengths, range(6), 18, packed=True) == [[0], [5, 2], [3, 1, 4]]
    # padded, a row costs the group's longest: 7, 3, 2 would cost 3 × 7 = 21
    assert micro_batches(lengths, range(6), 18, packed=False) == [[0], [5, 2], [3, 1], [4]]
    assert micro_batches(lengths, range(6), 5, packed=True) == [[0], [5], [2], [3], [1, 4]]
    assert micro_batches(lengths, range(6), 0, packed=False) == [[0, 5, 2, 3, 1, 4]]


@pytest.mark.parametrize("gather_once", [True, False], ids=["gathered-per-step", "resharded-per-micro-batch"])
def test_two_ranks_with_the_step_split_equal_one_rank_with_the_whole_step(tmp_path, gather_once):
    """Both ways of accumulating over micro-batches: the CPU default (parameters gathered and
    gradients reduced once per step) and the CUDA default (per micro-batch)."""
    one, (tokens1,) = train(tmp_path / "1", 1, gather_once=not gather_once)
    two, tokens2 = train(tmp_path / "2", 2, gather_once=gather_once)
    assert_same(two, one, 1e-5)
    assert sum(tokens2) == tokens1
    assert all(abs(t - tokens1 / 2) <= 0.15 * tokens1 for t in tokens2), tokens2  # about half each
    from learner.models import tiny_llama
    assert not all(torch.equal(one[k], v) for k, v in tiny_llama(seed=0).state_dict().items())


def test_a_checkpoint_of_two_ranks_resumes_on_one(tmp_path):
    whole, _ = train(tmp_path / "whole", 1, steps=(0, 3))
    train(tmp_path / "first", 2, steps=(0, 2))
    saved = sorted((tmp_path / "first" / "checkpoints").glob("step*"))
    assert [p.name for p in saved] == ["step00000002"]
    resumed, _ = train(tmp_path / "rest", 1, steps=(2, 3), resume=saved[-1])
    assert_same(resumed, whole, 1e-5)


def test_bf16_parameters_keep_float32_master_weights_and_train_like_float32():
    """The CUDA default, here on CPU: bf16 forward and backward (the critic's value head in fp32),
    fp32 sharded weights, optimizer and published weights."""
    init_distributed("cpu")
    try:
        trajs = _rollouts()[:4]
        metrics = {}
        for bf16 in (False, True):
            source = build_policy(ModelConfig())
            parallel = ParallelConfig(mixed_precision=bf16, critic_mixed_precision=bf16)
            update = SAOUpdate(*build_models(source, True, parallel, torch.device("cpu")),
                               UpdateConfig(warmup_steps=0, micro_batch_tokens=32))
            metrics[bf16] = update.step(trajs)
            assert {p.dtype for p in update.policy.parameters()} == {torch.float32}
            assert {t.dtype for b in gather_buckets(update.policy, torch.float32) for _, t in b} == {torch.float32}
        assert metrics[True]["step/skipped"] == 0
        for key in ("loss/policy", "loss/value", "dis/kept_frac", "policy/entropy"):
            assert metrics[True][key] == pytest.approx(metrics[False][key], rel=2e-2, abs=1e-3), key
    finally:
        dist.destroy_process_group()


def test_on_cpu_the_policy_computes_in_float32_and_the_critic_in_bf16_where_the_cpu_has_it():
    """The defaults: exact ratios on CPU (a float32 policy, as the float32 engine), the critic, whose
    values enter no ratio, in bf16 on a CPU with native bf16; on cuda both in bf16 unless told."""
    assert ParallelConfig().bf16() is False and ParallelConfig().bf16(critic=True) is native_bf16()
    assert ParallelConfig(device="cuda").bf16() and ParallelConfig(device="cuda").bf16(critic=True)
    assert not ParallelConfig(device="cuda", mixed_precision=False).bf16(critic=True)
    assert not ParallelConfig(critic_mixed_precision=False).bf16(critic=True)
    init_distributed("cpu")
    try:
        policy, critic = build_models(build_policy(ModelConfig()), True, ParallelConfig(), torch.device("cpu"))
        assert {p.dtype for p in critic.parameters()} == {torch.float32}  # sharded master weights
        computed = {}

        def note(name):
            def hook(module, inputs, out):  # returns None: the output passes unchanged
                computed[name] = (out[0] if isinstance(out, tuple) else out).dtype
            return hook
        for name, model in (("policy", policy), ("critic", critic)):
            decoder_blocks(model)[0].register_forward_hook(note(name))
        batch = {"input_ids": torch.tensor([[1, 2, 3]])}
        policy(**batch), critic(**batch)
        assert computed == {"policy": torch.float32, "critic": torch.bfloat16 if native_bf16() else torch.float32}
    finally:
        dist.destroy_process_group()


def test_one_fsdp2_rank_trains_exactly_like_the_plain_modules():
    """The sharded, meta-built path and the plain one agree, LM head included (its weight is read
    after the forward, outside FSDP2's hooks)."""
    from learner.models import tiny_llama
    from learner.value import ValueModel
    trajs = _rollouts()[:4]
    cfg = UpdateConfig(warmup_steps=0, lr_policy=1e-3, lr_critic=1e-3, micro_batch_tokens=32)
    plain = tiny_llama(seed=0)
    plain_critic = ValueModel.from_policy(plain)
    SAOUpdate(plain, plain_critic, cfg).step(trajs)
    init_distributed("cpu")
    try:
        update = SAOUpdate(*build_models(tiny_llama(seed=0), True, ParallelConfig(critic_mixed_precision=False),
                                         torch.device("cpu")), cfg)
        update.step(trajs)
        policy, critic = ({name: t for bucket in gather_buckets(model, torch.float32) for name, t in bucket}
                          for model in (update.policy, update.critic))
    finally:
        dist.destroy_process_group()
    assert_same(policy, plain.state_dict(), 0)
    assert_same(critic, plain_critic.state_dict(), 0)  # initialised from the policy, zero head
    assert not torch.equal(plain.lm_head.weight, tiny_llama(seed=0).lm_head.weight)


def test_activation_checkpointing_recomputes_a_block_in_backward_with_the_same_gradients():
    from learner.parallel import recompute_in_backward

    torch.manual_seed(0)
    block, calls = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()), []
    block[0].register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(3, 4)
    block(x).sum().backward()
    plain = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    recompute_in_backward(block)
    calls.clear()
    block(x).sum().backward()
    assert len(calls) == 2  # once forward, once again in backward
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, block.parameters()))
