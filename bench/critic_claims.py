"""The paper's critic claims (docs/algorithm.md §5, §8) on SmolLM2-135M-Instruct, a real pretrained LLM:

1. the value model's gradient norms are far more volatile than the policy's;
2. the volatility comes from its attention layers;
3. freezing attention fixes it, and the critic still learns (explained variance);
4. two critic steps per policy step (K = 2) learn faster than one.

Data: bench/rollouts.py's cached rollouts of the `writing` env by the float32 vLLM engine (hf
where vLLM does not run), scored by the style judge on two criteria: `concise` (the `make run`
task, the most reward spread of the base model) and `lowercase` (the same texts, a reward the
critic must read from the characters). `--steps` × `--batch` rollouts train, `--held-out` more
measure the critic's explained variance every `--eval-every` steps.

Critics, each with K = 2 (and the frozen and full ones with K = 1 too, on `concise`), trained on
the same batches in the same order:
- `frozen attention`: SAO's critic (attention frozen; MLPs, norms, embeddings and head train);
- `attention only`: attention and the head train, everything else frozen: attention's part alone;
- `full`: everything trains (`sao_full_critic`);
- `lora`: rank-8 adapters on the MLPs, the head whole, the rest frozen (`--model.lora-critic`).

With γ = λ = 1 a critic's targets are the rewards, so a critic trains the same whether or not the
policy does; the policy is frozen in every run but one per task, SAO with K = 2 and no warm-up,
whose policy gradient norms are claim 1's reference. Every optimizer step's gradient norm is
recorded before clipping, by parameter kind (the learner's `grad_norm/<model>_<kind>`); a
series' volatility is its coefficient of variation (std ÷ mean) and its largest spike ÷ median,
over the steps after the first `--settle`.

    .venv/bin/python bench/critic_claims.py [--steps 20 --batch 4 --held-out 24 --eval-every 5]
    .venv/bin/python bench/critic_claims.py --replot   # tables and plot from the saved runs

Writes bench/results/critic_claims.{md,png,json}; the raw runs are saved after each one, so a run
stopped early still reports what it finished.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, get_args

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import tyro  # noqa: E402

from bench.report import save_figure  # noqa: E402
from bench.rollouts import smollm2_rollouts  # noqa: E402
from learner.gae import skip_observation_gae  # noqa: E402
from learner.logprobs import collate  # noqa: E402
from learner.models import ModelConfig, build_models, build_policy  # noqa: E402
from learner.parallel import ParallelConfig, init_distributed  # noqa: E402
from learner.update import SAOUpdate, UpdateConfig  # noqa: E402
from learner.value import ValueModel, critic_values, explained_variance, param_kinds, value_moments  # noqa: E402
from schemas.messages import Trajectory  # noqa: E402

RESULTS = REPO / "bench" / "results"
Task = Literal["concise", "lowercase"]
TASKS: tuple[Task, ...] = get_args(Task)
Critic = Literal["frozen attention", "attention only", "full", "lora"]
CRITICS: tuple[Critic, ...] = get_args(Critic)
KINDS = ("attention", "mlp", "norm", "embedding", "value_head")


@dataclass(kw_only=True)
class CriticClaimsConfig:
    """The critic runs; `--replot` reads `out`.json instead."""

    steps: int = 20
    """learner steps per run"""
    batch: int = 4
    """small, so that 20 steps fit the budget"""
    held_out: int = 24
    """rollouts kept out of training, for the critic's explained variance"""
    eval_every: int = 5
    """steps between held-out evaluations"""
    settle: int = 2
    """first steps left out of the volatility"""
    tasks: tuple[Task, ...] = TASKS
    """judge criteria to train on"""
    critics: tuple[Critic, ...] = CRITICS
    """critics to train"""
    lr_policy: float = 5e-5
    """make run's"""
    lr_critic: float = 1e-4
    """make run's"""
    threads: int = 2
    """torch CPU threads"""
    out: Path = RESULTS / "critic_claims"
    """writes OUT.md, OUT.png and the raw runs OUT.json"""
    replot: bool = False
    """tables and plot from the saved runs"""


@dataclass(frozen=True)
class Variant:
    task: str
    critic: str
    k: int
    policy_trains: bool = False

    @property
    def name(self) -> str:
        return f"{self.critic}, K={self.k}" + (" (+ policy)" if self.policy_trains else "")


def variants(tasks: tuple[str, ...]) -> list[Variant]:
    """Every critic with K = 2 on every task; K = 1 for the frozen and the full critic on the first
    task (claim 4 and its control), to fit the budget."""
    return [Variant(task, critic, k, policy_trains=(critic, k) == ("frozen attention", 2))
            for task in tasks for critic in CRITICS for k in (2, 1)
            if k == 2 or (task == tasks[0] and critic in ("frozen attention", "full"))]


def build(v: Variant, source: torch.nn.Module, args: CriticClaimsConfig, device: torch.device) -> SAOUpdate:
    lora = ModelConfig(lora_rank=8, lora_critic=True, lora_targets="gate_proj,up_proj,down_proj").lora \
        if v.critic == "lora" else None
    # float32 critics: the gradient norms compared here are the committed float32 runs'
    policy, critic = build_models(source, True, ParallelConfig(critic_mixed_precision=False), device, lora)
    if v.critic == "attention only":  # attention and the head train (sao_full_critic leaves attention alone)
        for kind, params in param_kinds(critic).items():
            for p in params:
                p.requires_grad_(kind in ("attention", "value_head"))
    algorithm = "sao_full_critic" if v.critic in ("full", "attention only") else "sao"
    return SAOUpdate(policy, critic, UpdateConfig(
        algorithm=algorithm, critic_updates=v.k, warmup_steps=0 if v.policy_trains else 10 ** 9,
        lr_policy=args.lr_policy, lr_critic=args.lr_critic))


@torch.no_grad()
def held_out_ev(critic: ValueModel, trajs: list[Trajectory], batch: int, device: torch.device) -> float:
    """The critic's explained variance of the returns (γ = λ = 1: the rewards) on `trajs`."""
    total = sum(int(t.action_mask.sum()) for t in trajs)
    sums: dict[str, float] = {}
    for i in range(0, len(trajs), batch):
        b = collate(trajs[i:i + batch], device=device)
        values = critic_values(critic, b)
        _, returns = skip_observation_gae(b.rewards, values, b.action_mask, 1.0, 1.0)
        for k, x in value_moments(values, returns, b.action_mask, total).items():
            sums[k] = sums.get(k, 0.0) + float(x)
    return explained_variance(sums)


def one_run(v: Variant, source: torch.nn.Module, train: list[Trajectory], held: list[Trajectory],
            args: CriticClaimsConfig, device: torch.device) -> list[dict[str, float]]:
    torch.manual_seed(0)
    sao = build(v, source, args, device)
    history = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        m = sao.step(train[step * args.batch:(step + 1) * args.batch])
        row = {k: float(x) for k, x in m.items() if k.startswith(("grad_norm/", "loss/", "value/explained_var", "dis/kept"))}
        row["step/s"] = time.perf_counter() - t0
        if (step + 1) % args.eval_every == 0 or step == 0:
            row["heldout/explained_var"] = held_out_ev(sao.critic, held, args.batch, device)
        history.append(row)
        print(f"  {v.task} | {v.name} | step {step}: critic grad {row['grad_norm/critic']:.3g}"
              + (f" policy grad {row['grad_norm/policy']:.3g}" if v.policy_trains else "")
              + (f" held-out EV {row['heldout/explained_var']:+.3f}" if "heldout/explained_var" in row else "")
              + f" ({row['step/s']:.1f} s)", flush=True)
    return history


# ---------------------------------------------------------------------------- measures


def series(history: list[dict], key: str, settle: int) -> list[float]:
    return [h[key] for h in history[settle:] if math.isfinite(h.get(key, math.nan))]


def volatility(xs: list[float]) -> tuple[float, float, float]:
    """(median, coefficient of variation, largest ÷ median) of a gradient-norm series."""
    if len(xs) < 2:
        return math.nan, math.nan, math.nan
    med = statistics.median(xs)
    return med, statistics.stdev(xs) / statistics.fmean(xs), max(xs) / med


def evs(history: list[dict]) -> list[tuple[int, float]]:
    return [(i, h["heldout/explained_var"]) for i, h in enumerate(history) if "heldout/explained_var" in h]


def _f(x: float, digits: int = 2) -> str:
    return "–" if not math.isfinite(x) else f"{x:.{digits}g}" if abs(x) >= 100 or abs(x) < 0.01 else f"{x:.{digits}f}"


def tables(runs: dict[Variant, list[dict]], settle: int) -> str:
    lines = []
    for task in dict.fromkeys(v.task for v in runs):
        mine = {v: h for v, h in runs.items() if v.task == task}
        lines += [f"### `{task}`", "",
                  "| critic | held-out EV: first / last / best | critic grad norm: median / CV / max÷median "
                  "| attention: CV / max÷median | mlp: CV / max÷median | s/step |",
                  "|---|---|---|---|---|---|"]
        for v, h in mine.items():
            e = [x for _, x in evs(h)]
            total = volatility(series(h, "grad_norm/critic", settle))
            att = volatility(series(h, "grad_norm/critic_attention", settle))
            mlp = volatility(series(h, "grad_norm/critic_mlp", settle))
            lines.append(f"| {v.name} | {_f(e[0])} / {_f(e[-1])} / {_f(max(e))} | {_f(total[0], 3)} / "
                         f"{_f(total[1])} / {_f(total[2])} | {_f(att[1])} / {_f(att[2])} | {_f(mlp[1])} / "
                         f"{_f(mlp[2])} | {statistics.fmean(x['step/s'] for x in h):.1f} |")
        lines.append("")
        ref = next((h for v, h in mine.items() if v.policy_trains), None)
        full = next((h for v, h in mine.items() if (v.critic, v.k) == ("full", 2)), None)
        if ref is not None:
            lines += [f"Gradient norms by parameter kind, `{task}` (median / CV / max÷median, steps {settle}–end):", "",
                      "| kind | policy (SAO run) | critic, frozen attention, K=2 | critic, full, K=2 |", "|---|---|---|---|"]
            for kind in ("total",) + KINDS:
                cells = []
                for model, h in (("policy", ref), ("critic", ref), ("critic", full)):
                    key = f"grad_norm/{model}" if kind == "total" else f"grad_norm/{model}_{kind}"
                    med, cv, spike = volatility(series(h, key, settle)) if h is not None else (math.nan,) * 3
                    cells.append("–" if not math.isfinite(med) else f"{_f(med, 3)} / {_f(cv)} / {_f(spike)}")
                lines.append(f"| {kind} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


MARGIN_RATIO, MARGIN_EV = 1.1, 0.05
"""A claim holds when its side is ahead by this much: CVs by a factor, explained variances by a
difference; within it the runs show no clear difference (20 steps of 4 are noisy)."""


def verdict(a: float, b: float, ev: bool) -> str:
    if not (math.isfinite(a) and math.isfinite(b)):
        return "not measured"
    ahead = a - b > MARGIN_EV if ev else a > MARGIN_RATIO * b
    behind = b - a > MARGIN_EV if ev else b > MARGIN_RATIO * a
    return "holds" if ahead else "the opposite holds" if behind else "no clear difference"


def verdicts(runs: dict[Variant, list[dict]], settle: int) -> str:
    """Each claim against the measurements, per task: the figures it rests on, then its verdict."""
    out = []
    for task in dict.fromkeys(v.task for v in runs):
        get = {(v.critic, v.k): h for v, h in runs.items() if v.task == task}
        ref = next((h for v, h in runs.items() if v.task == task and v.policy_trains), None)

        def cv(h, key):
            return volatility(series(h, key, settle))[1] if h is not None else math.nan

        def last_ev(h):
            return evs(h)[-1][1] if h is not None else math.nan

        frozen, full, attn = get.get(("frozen attention", 2)), get.get(("full", 2)), get.get(("attention only", 2))
        checks = [
            ("1. the critic's gradient norm is more volatile than the policy's (CV, full critic vs policy)",
             cv(full, "grad_norm/critic"), cv(ref, "grad_norm/policy"), False),
            ("2. in the full critic, attention's gradient is more volatile than the MLPs' (CV)",
             cv(full, "grad_norm/critic_attention"), cv(full, "grad_norm/critic_mlp"), False),
            ("2'. a critic training attention alone is more volatile than one training all but attention (CV)",
             cv(attn, "grad_norm/critic"), cv(frozen, "grad_norm/critic"), False),
            ("3. freezing attention makes the critic's gradient steadier (CV, full vs frozen)",
             cv(full, "grad_norm/critic"), cv(frozen, "grad_norm/critic"), False),
            ("3'. the frozen-attention critic explains more held-out variance (last EV, frozen vs full)",
             last_ev(frozen), last_ev(full), True),
            ("4. K = 2 explains more held-out variance than K = 1 (last EV, frozen attention)",
             last_ev(frozen), last_ev(get.get(("frozen attention", 1))), True),
        ]
        out += [f"`{task}` (a claim holds when ahead by {MARGIN_RATIO}x in CV or {MARGIN_EV} in EV):", ""]
        out += [f"- {claim}: {_f(a)} vs {_f(b)} → **{verdict(a, b, ev)}**" for claim, a, b, ev in checks]
        out.append("")
    return "\n".join(out)


def plot(runs: dict[Variant, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(v.task for v in runs))
    fig, axes = plt.subplots(len(tasks), 3, figsize=(20, 4.8 * len(tasks)), squeeze=False)
    colors = dict(zip(CRITICS, plt.get_cmap("tab10").colors))
    for row, task in zip(axes, tasks):
        mine = {v: h for v, h in runs.items() if v.task == task}
        for v, h in mine.items():
            style = dict(color=colors[v.critic], ls="-" if v.k == 2 else "--", label=v.name)
            x, y = zip(*evs(h))
            row[0].plot(x, y, marker="o", **style)
            row[1].plot([r["grad_norm/critic"] for r in h], **style)
        ref = next((h for v, h in mine.items() if v.policy_trains), None)
        full = next((h for v, h in mine.items() if (v.critic, v.k) == ("full", 2)), None)
        for (model, h, ls) in (("policy", ref, ":"), ("critic", full, "-")):
            for i, kind in enumerate(KINDS):
                ys = [r.get(f"grad_norm/{model}_{kind}", math.nan) for r in h or []]
                if any(math.isfinite(y) for y in ys):
                    row[2].plot(ys, ls=ls, color=plt.get_cmap("tab10").colors[i], label=f"{model} {kind}")
        row[0].set(title=f"{task}: critic explained variance, held-out", xlabel="step")
        row[0].axhline(0, color="k", lw=0.5)
        row[1].set(title=f"{task}: critic gradient norm (before clipping)", xlabel="step", yscale="log")
        row[2].set(title=f"{task}: gradient norm by kind, full critic (—) and policy (···)", xlabel="step",
                   yscale="log")
        for ax in row:
            ax.legend(fontsize=7)
    save_figure(fig, path, dpi=90)


def report(saved: dict, out: Path) -> str:
    runs = {Variant(**r["variant"]): r["history"] for r in saved["runs"]}
    settle = saved["args"]["settle"]
    text = "\n".join([f"# Critic claims on SmolLM2-135M-Instruct: {saved['head']}", "",
                      f"Command: `{saved['command']}`", "", tables(runs, settle),
                      "## The claims against these runs", "", verdicts(runs, settle)])
    out.with_suffix(".md").write_text(text)
    plot(runs, out.with_suffix(".png"))
    return text


def main() -> None:
    args = tyro.cli(CriticClaimsConfig, description=__doc__)
    raw = args.out.with_suffix(".json")
    if args.replot:
        print(report(json.loads(raw.read_text()), args.out))
        return
    torch.set_num_threads(args.threads)
    _, _, device = init_distributed("cpu")
    source = build_policy(ModelConfig(name="smollm2"))
    n = args.steps * args.batch + args.held_out
    head = (f"{args.steps} steps x {args.batch} cached vLLM-float32 rollouts of the writing env, {args.held_out} "
            f"held out, lr critic {args.lr_critic}, policy {args.lr_policy}, {args.threads} threads "
            f"[{platform.machine()}, {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, load {os.getloadavg()[0]:.1f}, {datetime.date.today()}]")
    saved = {"head": head, "command": " ".join(["python bench/critic_claims.py", *sys.argv[1:]]),
             "args": {"settle": args.settle}, "runs": []}
    t0 = time.perf_counter()
    data = {task: smollm2_rollouts(n, criterion=task) for task in args.tasks}  # read and scored once a task
    for v in variants(args.tasks):
        if v.critic not in args.critics:
            continue
        train, held = data[v.task][:args.steps * args.batch], data[v.task][args.steps * args.batch:]
        saved["runs"].append({"variant": asdict(v), "history": one_run(v, source, train, held, args, device)})
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps(saved))
        print(f"{v.task} | {v.name}: done at {time.perf_counter() - t0:.0f} s", flush=True)
    saved["head"] += f", {time.perf_counter() - t0:.0f} s"
    raw.write_text(json.dumps(saved))
    print(report(saved, args.out))


if __name__ == "__main__":
    main()
