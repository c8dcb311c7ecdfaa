"""How a step's trajectories become work: a token-balanced share per rank, token-budget micro-batches
within each share, and the step's global counts and metric sums (docs/algorithm.md §3: N is the step's).

Every rank holds the whole step's trajectories (rank 0 broadcasts them), so every rank computes
every rank's plan locally: the shares, the micro-batch counts and the global normalisers need no
collective. Each micro-batch's loss is divided by the step's global counts, so the gradients summed
over micro-batches and ranks (FSDP2 reduces by sum, see `parallelize`) equal the one-shot gradient.

Deliberately absent: splitting a trajectory across micro-batches or ranks (a trajectory longer than
the budget is a micro-batch of its own), and reordering by anything but length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from schemas.messages import Trajectory


def balanced_shares(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Indices per rank: longest first, each onto the rank holding the fewest tokens so far
    (greedy LPT; ties to the lower rank), each share sorted by index."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def micro_batches(lengths: Sequence[int], indices: Sequence[int], max_tokens: int,
                  packed: bool) -> list[list[int]]:
    """`indices` longest first, cut into consecutive groups whose forward costs at most `max_tokens`
    tokens: the sum of lengths when packed, rows × the longest when padded (sorting keeps padding
    small). A trajectory over the budget goes alone; `max_tokens` 0 means one group."""
    out: list[list[int]] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        group = out[-1] if out else None
        if group is not None:
            cost = (sum(lengths[j] for j in group) + lengths[i] if packed
                    else (len(group) + 1) * lengths[group[0]])
            if not max_tokens or cost <= max_tokens:
                group.append(i)
                continue
        out.append([i])
    return out


@dataclass(kw_only=True)
class StepPlan:
    """This rank's part of a step and the step's global counts."""

    micro_batches: list[list[int]]
    """Trajectory indices per micro-batch; empty lists pad this rank up to the busiest rank's count
    (every rank must run as many forwards and backwards, they are FSDP2 collectives)."""
    num_tokens: int
    """N: action tokens in the whole step, masked ones included (docs/algorithm.md §3)."""
    num_seqs: int
    """Trajectories in the whole step (`seq_mean_token_mean` divides by it)."""
    rank_tokens: int
    """Tokens this rank runs forward (its share)."""


def plan_step(trajs: Sequence[Trajectory], rank: int, world: int, max_tokens: int,
              packed: bool) -> StepPlan:
    lengths = [len(t.tokens) for t in trajs]
    plans = [micro_batches(lengths, share, max_tokens, packed)
             for share in balanced_shares(lengths, world)]
    mine = plans[rank] + [[]] * (max(map(len, plans)) - len(plans[rank]))
    return StepPlan(micro_batches=mine, num_seqs=len(trajs),
                    num_tokens=int(sum(np.count_nonzero(t.action_mask) for t in trajs)),
                    rank_tokens=sum(lengths[i] for mb in mine for i in mb))


class StepStats:
    """Metric sums, maxima and minima over this rank's micro-batches, reduced over ranks when read
    (token means arrive already divided by the step's N, so their sums are the step's means)."""

    def __init__(self):
        self.tables: dict[dist.ReduceOp, dict[str, Tensor]] = {
            dist.ReduceOp.SUM: {}, dist.ReduceOp.MAX: {}, dist.ReduceOp.MIN: {}}
        self.sums = self.tables[dist.ReduceOp.SUM]

    def _fold(self, op: dist.ReduceOp, values: dict[str, Tensor]) -> None:
        combine = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum,
                   dist.ReduceOp.MIN: torch.minimum}[op]
        table = self.tables[op]
        for k, v in values.items():
            v = v.detach().float()
            table[k] = combine(table[k], v) if k in table else v

    def add(self, values: dict[str, Tensor]) -> None:
        self._fold(dist.ReduceOp.SUM, values)

    def maximum(self, values: dict[str, Tensor]) -> None:
        self._fold(dist.ReduceOp.MAX, values)

    def minimum(self, values: dict[str, Tensor]) -> None:
        self._fold(dist.ReduceOp.MIN, values)

    def reduce(self) -> dict[str, float]:
        """The step's values on every rank: one all-reduce per kind in use, and a host sync."""
        out = {}
        for op, table in self.tables.items():
            if not table:
                continue
            flat = torch.stack(list(table.values()))
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(flat, op=op)
            out |= dict(zip(table, flat.tolist()))
        return out
