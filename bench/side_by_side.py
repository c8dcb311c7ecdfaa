"""Side by side on calc-agent, in one run each: `make run-agent`'s pipeline streaming one trajectory at
a time (**ours**), the same pipeline behind a group barrier (**sync**), and TRL's `GRPOTrainer`
(**trl**), on the same warm-started model, task, reward, tool and cores, each for the same
wall-clock budget, one after the other. Held-out accuracy against wall-clock seconds for all, and
two tables: ours against sync (trajectories trained per second, seconds to the target, start +
0.15), ours against TRL (seconds each took to reach the same accuracy, and the ratio).

- **ours**: `sao up` with `make run-agent`'s settings (the warm start of `sao warmup --env calc-agent
  --model smollm2 --demos 100 --sft.epochs 1`; one vLLM producer playing `calc-agent` with the
  sandboxed python tool, 8 episodes a learner step, 96 tokens a turn, the SAO learner with
  `make run-agent`'s flags, `sao eval` scoring the 32 held-out problems greedily on its own vLLM
  engine), every `--eval-every` versions instead of 6. At the budget the learner is sent SIGTERM:
  it finishes the step in progress and stops, and the evaluator scores the last version (as at the
  end of any `sao up` run). The accuracies are `sao eval`'s own (RUN_DIR/eval.jsonl); a version's
  time is when the learner published it (learner/metrics.jsonl), v0's the start.
- **sync**: ours with a group barrier, as GRPO trains: the feeder asks for `--num-generations` (4)
  rollouts of each prompt, the learner holds a group until all of it has arrived and trains whole
  groups (`--update.algorithm grpo_dis`: the group-normalised reward as advantage, no critic, the
  same DIS mask against the rollout policy; or, with `--sync-algorithm sao`, ours' own SAO learner,
  so that the barrier is the only difference), and rollouts may run only one step ahead of training
  (`--max-lag-steps 1`: the producer plays the next step's groups while the learner trains, on the
  weights it has). Same producer, evaluator, step size, policy lr and micro-batches as ours.
- **TRL**: `trl.GRPOTrainer` with its own tool calling (`environment_factory`: an environment
  class whose `python` method is the tool, one instance per rollout, reset between them), in
  `.venv-peer` (`make peer-env`: trl's `datasets` wants an older fsspec than ours). The tool runs
  the code in a session of the project's own sandbox, so a rollout's variables persist between its
  calls as in `calc-agent`, and answers with the same text. The prompt is `calc-agent`'s, token for
  token (the chat template given to TRL renders the tools and the tool results as the project does;
  checked on the first 64 prompts at start); replies are parsed as Hermes `<tool_call>` JSON
  (TRL's Qwen3 response template: SmolLM2's has none). Reward: 1 when the final reply's last
  `Answer: N` is the answer (the scorer `calc-agent` uses), 0 otherwise or when the rollout ends
  still calling tools. 8 rollouts a step (2 prompts x `--num-generations` 4, in micro-batches of 2), 96 new tokens a
  turn, at most 7 tool rounds (calc-agent's 8 turns), learning rate `--lr` (ours' policy lr),
  constant; the rest TRL's GRPO defaults (loss `dapo`, no KL, clip 0.2, rewards scaled per
  group) but float32 with gradient checkpointing, as ours trains (make run-agent's activation
  checkpointing). Generation is TRL's transformers path (`model.generate`, batched, on the CPU): TRL's vLLM path needs vllm<=0.31,
  not the CPU build the project uses. Every `--eval-every` steps, and before the first, a callback
  scores the policy on the same 32 held-out problems with the same scorer `sao warmup` uses
  (`sao.warmup.held_out_score`: greedy, hf); both scorers let a held-out episode run
  `--eval-deadline-s` (calc-agent's 300 s is a limit of training episodes, and a loaded machine
  pushed held-out episodes past it in a smoke test). The evaluation pauses training and its time counts in
  the budget, as ours' evaluator shares the cores with training. At the budget the step in
  progress finishes and training stops; the last step is then scored if it was not.

Both clocks start when the side is launched (ours: `sao up` starting its broker and processes;
TRL: the trainer process loading the model), so start-up counts. Reported: accuracy against
seconds, the start (v0) and best of each, and the seconds each took to reach the highest accuracy
both reached above the start, with the ratio TRL ÷ ours (or, plainly, that one or neither rose); where
the two scorers start apart (transformers and vLLM can choose different greedy replies), also the
seconds each took to rise 0.15 above its own start.

    make bench-side-by-side                                   # the three sides, 15 minutes each (~1 h)
    .venv/bin/python bench/side_by_side.py --budget-s 900     # the same
    .venv/bin/python bench/side_by_side.py --sides trl --budget-s 300 --trl-max-steps 2 --eval-every 1  # smoke
    .venv/bin/python bench/side_by_side.py --replot           # md and png from the saved json

Writes bench/results/side_by_side.{md,png,json} (`--out`); raw runs under runs/side-by-side.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import tyro  # noqa: E402

from producers.evaluate.scores import paired_change  # noqa: E402

Side = Literal["ours", "sync", "trl"]


def run_agent_learner_flags() -> str:
    """`make run-agent`'s learner flags (the Makefile's RUN_AGENT_LEARNER_FLAGS, so that ours is what
    it runs) but its policy lr: --lr sets every side's."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    flags = re.search(r"^RUN_AGENT_LEARNER_FLAGS :=(.*)$", text, re.M).group(1)
    return " ".join(re.sub(r"--update\.lr-policy \S+", "", flags).split())


SYNC_GRPO_FLAGS = ("--update.algorithm grpo_dis --update.micro-batch-tokens 1024 --parallel.activation-checkpointing "
                   "--checkpoint-every 3 --no-checkpoint-background")
"""The sync side's with --sync-algorithm grpo_dis: the group baseline in place of the critic (so no
critic warm-up or critic lr), ours' micro-batches and checkpoints."""
TARGET_RISE = 0.15
"""The target of `make run-agent`: held-out accuracy this much above the warm start."""
NAMES = {"ours": "ours", "sync": "sync", "trl": "TRL"}


@dataclass(kw_only=True)
class PeerConfig:
    budget_s: float = 900.0
    """Wall-clock seconds each side trains for (start-up and its evaluations included)."""
    sides: tuple[Side, ...] = ("ours", "sync", "trl")
    """Which sides run, in this order; a side not run keeps its result from --out's json."""
    eval_every: int = 3
    """Score the held-out problems every this many policy updates (and the start, and the last)."""
    eval_tasks: int = 32
    """Held-out problems scored (greedy)."""
    heldout_frac: float = 0.1
    """make run-agent's split."""
    eval_deadline_s: float = 3600.0
    """Wall-clock seconds a held-out episode may take, both scorers (`sao eval --episode-deadline-s`;
    calc-agent's 300 s would score episodes 0 that a loaded machine slowed past it)."""
    max_tokens: int = 96
    """Most new tokens per model turn, both sides."""
    max_turns: int = 8
    """Most model turns per episode (calc-agent's): TRL gets max_turns - 1 tool rounds."""
    batch: int = 8
    """Episodes per policy update, both sides (TRL: batch / num_generations prompts)."""
    num_generations: int = 4
    """The group size of TRL and of the sync side."""
    micro_batch: int = 2
    """TRL's rollouts per forward and backward (per_device_train_batch_size; the `batch` rollouts of
    one generation are one optimizer step, in batch / micro_batch accumulated micro-batches, as
    ours' learner splits a step into micro-batches of 1,024 tokens): fewer pad tokens than one
    batch padded to its longest rollout."""
    lr: float = 5e-6
    """The policy learning rate of every side: ours' and sync's --update.lr-policy, TRL's learning_rate
    (default: make run-agent's)."""
    sync_algorithm: Literal["grpo_dis", "sao"] = "grpo_dis"
    """The sync side's learner: GRPO's group baseline, or SAO's critic behind the same barrier (the
    barrier alone differs from ours)."""
    warm: str = ""
    """The warm-started folder; empty: `sao warmup --env calc-agent --model smollm2 --demos 100
    --sft.epochs 1` (make run-agent's, cached under runs/warmup)."""
    run_dir: Path = Path("runs/side-by-side")
    """Raw runs: ours/ and sync/ (sao up's run dirs), trl/ (the trainer's output and log)."""
    out: Path = Path("bench/results/side_by_side").with_suffix(".md")  # written by the run
    """The table; .json (every figure) and .png (the plot) beside it."""
    peer_python: Path = Path(".venv-peer/bin/python")
    """The interpreter with trl (`make peer-env`)."""
    final_eval_s: float = 300.0
    """Seconds ours' evaluator gets after the learner stops to score the last version (`sao up --final-eval-s`)."""
    ours_steps: int = 0
    """Stop ours and sync after this many learner steps instead of at the budget (0: the budget; for a smoke test)."""
    trl_max_steps: int = 0
    """Stop TRL after this many steps instead of at the budget (0: the budget; for a smoke test)."""
    threads: int = 2
    """Torch threads of the TRL process (ours: the learner 2, every other process 1, as sao up sets)."""
    seed: int = 0
    replot: bool = False
    """Only rewrite the md and png from the json."""
    worker: bool = False
    """Internal: run the TRL side in this process (under --peer-python) and write its json."""
    worker_out: Path = Path("")
    """Internal: where the worker writes its result."""
    command: str = ""
    """The command line the results file names (default: this one)."""


# ---------------------------------------------------------------------------------------------------
# shared


def load() -> dict:
    """Load averages (1, 5, 15 min) and the time, for the record."""
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "at": datetime.datetime.now().isoformat(timespec="seconds")}


def warm_folder(cfg: PeerConfig) -> str:
    if cfg.warm:
        return cfg.warm
    out = subprocess.run([sys.executable, "-m", "sao", "warmup", "--env", "calc-agent", "--model", "smollm2",
                          "--demos", "100", "--sft.epochs", "1"], cwd=REPO, check=True, stdout=subprocess.PIPE,
                         text=True)
    return out.stdout.strip().splitlines()[-1]


def say(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------------------------------------
# ours: sao up


def ours_command(cfg: PeerConfig, warm: str, run_dir: Path, side: Side) -> list[str]:
    barrier = ["--group-size", str(cfg.num_generations), "--max-lag-steps", "1"] if side == "sync" else []
    grpo = side == "sync" and cfg.sync_algorithm == "grpo_dis"
    flags = f"{SYNC_GRPO_FLAGS if grpo else run_agent_learner_flags()} --update.lr-policy {cfg.lr:g}"
    return [sys.executable, "-m", "sao", "up", "--model", warm, "--env", "calc-agent", "--producers", "1", *barrier,
            "--batch-trajectories", str(cfg.batch), "--max-tokens", str(cfg.max_tokens),
            "--steps", str(cfg.ours_steps or 1_000_000), "--eval-every", str(cfg.eval_every),
            "--eval-tasks", str(cfg.eval_tasks), "--eval-samples", "0", "--heldout-frac", str(cfg.heldout_frac),
            "--run-dir", str(run_dir), "--no-dashboard", "--final-eval-s", str(cfg.final_eval_s),
            f"--learner-flags={flags}", f"--eval-flags=--episode-deadline-s {cfg.eval_deadline_s:g}"]


def learner_pids(up_pid: int, min_age_s: float = 0.0) -> list[int]:
    """The `sao learner` child of `sao up` (psutil: the supervisor restarts it under a new pid),
    running for `min_age_s` at least (a learner just started has no SIGTERM handler yet)."""
    import psutil

    try:
        children = psutil.Process(up_pid).children()
    except psutil.NoSuchProcess:
        return []
    pids = []
    for c in children:
        try:
            argv = c.cmdline()
        except psutil.Error:
            continue
        if argv[1:4] == ["-m", "sao", "learner"] and time.time() - c.create_time() >= min_age_s:
            pids.append(c.pid)
    return pids


def run_ours(cfg: PeerConfig, warm: str, side: Side) -> dict:
    """One `sao up` run: ours, or ours behind the group barrier (sync)."""
    from sao.report import load_evaluations, load_steps

    run_dir = cfg.run_dir / side
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = ours_command(cfg, warm, run_dir, side)
    before = load()
    say(f"{side}: {shlex.join(cmd[1:])}")
    t0 = time.time()
    stopped_at = None
    with open(cfg.run_dir / f"{side}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=None if cfg.ours_steps else cfg.budget_s)
        except subprocess.TimeoutExpired:
            stopped_at = time.time() - t0
            say(f"{side}: budget reached at {stopped_at:.0f} s: SIGTERM to the learner (it finishes its step)")
            signalled: set[int] = set()
            deadline = time.time() + cfg.final_eval_s + 600
            while proc.poll() is None and time.time() < deadline:
                # a learner the supervisor restarts (after a crash or an OOM kill) is told to stop too
                for pid in set(learner_pids(proc.pid, min_age_s=60)) - signalled:
                    say(f"{side}: SIGTERM to learner {pid}")
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
                    signalled.add(pid)
                time.sleep(2)
            if proc.poll() is None:
                say(f"{side}: sao up did not end; SIGTERM to it")
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    wall = time.time() - t0
    after = load()
    steps = load_steps(run_dir)
    published = {0: 0.0}
    for s in steps:
        published.setdefault(int(s["weights/version"]), s["time"] - t0)
    points = []
    for e in load_evaluations(run_dir):
        v = int(e["version"])
        points.append({"update": v, "seconds": published.get(v), "accuracy": e["greedy/mean"],
                       "turns": e.get("episode/turns"), "eval_s": e.get("seconds"), "scored_at": e["time"] - t0,
                       "figures": {k: x for k, x in e.items() if "/" in k}, "tasks": e.get("tasks")})
    return {"side": side, "command": shlex.join(["sao", *cmd[3:]]), "started": before["at"],
            "load_before": before["loadavg"], "load_after": after["loadavg"], "budget_s": cfg.budget_s,
            "stopped_at_s": stopped_at, "wall_s": wall, "exit": proc.returncode,
            "backend": "vLLM CPU build (producer and evaluator, float32), the project's learner on torch (float32 "
                       f"policy), {'sao' if side == 'ours' else cfg.sync_algorithm}",
            "steps": [{"step": int(s["step/index"]), "seconds": s["time"] - t0, "version": int(s["weights/version"]),
                       "reward": s["reward/mean"], "turns": s.get("episode/turns"),
                       "trajectories": s.get("batch/trajectories")} for s in steps],
            "points": points, "updates": max(published),
            "events": [line for c in json.loads((run_dir / "processes.json").read_text())["processes"].values()
                       for line in c["events"]] if (run_dir / "processes.json").exists() else []}


# ---------------------------------------------------------------------------------------------------
# TRL (runs under .venv-peer)


def chat_template(default_system: str) -> str:
    """A ChatML template that renders tools, tool calls and tool results as producers/envs/tools.py
    does for SmolLM2 (whose own template has no tools): the tools listed as a Hermes block after the
    system prompt, a call as `<tool_call>{json}</tool_call>`, one user turn of `<tool_response>`
    blocks for a reply's results. TRL renders prompts and tool results through it."""
    from producers.envs.tools import HERMES_SYSTEM

    head, tail = (s.replace("{{", "{").replace("}}", "}") for s in HERMES_SYSTEM.split("{tools}"))
    lit = json.dumps  # a Jinja string literal: JSON's escapes are Jinja's
    return (
        "{%- set ns = namespace(listing='') -%}"
        "{%- if tools -%}{%- set ns.listing = " + lit(head) + " -%}"
        "{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}"
        "{%- set ns.listing = ns.listing + ({'type': 'function', 'function': {'name': f.name, "
        "'description': f.description, 'parameters': f.parameters}} | tojson(separators=(',', ':')))"
        " + ('\\n' if not loop.last else '') -%}"
        "{%- endfor -%}{%- set ns.listing = ns.listing + " + lit(tail) + " -%}{%- endif -%}"
        "{%- if messages[0]['role'] != 'system' -%}"
        "{{- '<|im_start|>system\\n' + (ns.listing if tools else " + lit(default_system) + ") + '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}"
        "{{- '<|im_start|>system\\n' + m['content'] + ('\\n\\n' + ns.listing if tools else '') + '<|im_end|>\\n' -}}"
        "{%- elif m['role'] == 'tool' -%}"
        "{%- if loop.previtem is not defined or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user\\n' -}}"
        "{%- else -%}{{- '\\n' -}}{%- endif -%}"
        "{{- '<tool_response>\\n' + m['content'] + '\\n</tool_response>' -}}"
        "{%- if loop.nextitem is not defined or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- elif m['role'] == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' + (m['content'] or '') -}}"
        "{%- for c in m.get('tool_calls') or [] -%}{%- set f = c.function if c.function is defined else c -%}"
        "{{- '<tool_call>' + ({'name': f.name, 'arguments': (f.arguments if f.arguments is mapping else "
        "(f.arguments | string))} | tojson) + '</tool_call>' -}}"
        "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def final_reply_reward(completions, answer, **_) -> list[float]:
    """calc-agent's reward: 1.0 when the final reply's last `Answer: N` is the answer; 0.0 otherwise,
    and when the rollout ended still calling tools (calc-agent's `max_turns`)."""
    from producers.envs.math import extract_answer

    rewards = []
    for messages, a in zip(completions, answer):
        last = messages[-1] if messages else {}
        done = last.get("role") == "assistant" and not last.get("tool_calls")
        rewards.append(1.0 if done and extract_answer(last.get("content") or "") == a else 0.0)
    return rewards


def trl_worker(cfg: PeerConfig) -> None:
    t0 = time.time()
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from producers.demos import training_tasks
    from producers.envs import make_env
    from producers.sandbox import Sandbox, SandboxConfig, format_result
    from producers.session import PythonSession
    from sao.warmup import WarmupConfig, held_out_score
    from schemas.tokenizers import load_tokenizer

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    warm = cfg.warm
    out_dir = cfg.run_dir / "trl"
    sandbox = Sandbox(SandboxConfig())
    scorer_tokenizer = load_tokenizer(warm)  # the project's, untouched: the scorer's and the env's
    env = make_env("calc-agent", tokenizer=scorer_tokenizer, sandbox=sandbox, deadline_s=cfg.eval_deadline_s)

    tokenizer = load_tokenizer(warm)  # TRL's: the template above, <|im_end|> as EOS, a pad token
    tokenizer.chat_template = chat_template("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.padding_side = "<|im_end|>", "<|endoftext|>", "left"
    tokenizer.response_template = qwen3_template  # Hermes <tool_call> JSON between <|im_start|>assistant and <|im_end|>

    sessions: list[PythonSession] = []

    class CalcTool:
        """One rollout's python tool: a session of the project's sandbox, new at every reset."""

        def __init__(self):
            self.session = None

        def reset(self, **_) -> None:
            if self.session is not None:
                self.session.close()
            self.session = PythonSession(sandbox)
            sessions.append(self.session)

        def python(self, code: str) -> str:
            """Run Python; variables persist between calls.

            Args:
                code: Python code; print the result.
            """
            return format_result(self.session.run(code))  # failures too: the model sees what calc-agent shows

    import producers
    say(f"TRL worker: project modules from {Path(producers.__file__).parent.parent}, trl {trl.__version__}")
    tasks = list(training_tasks(env, 4000, cfg.heldout_frac, cfg.seed + 1))
    dataset = Dataset.from_list([{"prompt": env.messages(t), "answer": t["answer"]} for t in tasks])
    probe = CalcTool()
    for t in tasks[:64]:  # the prompt TRL renders is calc-agent's, token for token
        ids = tokenizer.apply_chat_template(conversation=[env.messages(t)], tools=[probe.python],
                                            add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0]
        if list(ids) != env.prompt_ids(t):
            raise SystemExit(f"TRL's prompt differs from calc-agent's:\n{tokenizer.decode(ids)!r}\n"
                             f"{scorer_tokenizer.decode(env.prompt_ids(t))!r}")

    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    model.generation_config.eos_token_id = [2, 1]  # calc-agent's stop tokens: <|im_end|>, and the tokenizer's EOS
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    wcfg = WarmupConfig(env="calc-agent", model=warm, eval_tasks=cfg.eval_tasks, max_tokens=cfg.max_tokens,
                        heldout_frac=cfg.heldout_frac, seed=0)  # seed 0: the tasks sao warmup and sao eval score
    points: list[dict] = []
    steps: list[dict] = []

    def evaluate(update: int, seconds: float) -> None:
        e0 = time.time()
        f = held_out_score(wcfg, model, env, scorer_tokenizer)
        tasks = f.pop("tasks")
        points.append({"update": update, "seconds": seconds, "accuracy": f["greedy/mean"],
                       "turns": f.get("episode/turns"), "eval_s": time.time() - e0, "scored_at": time.time() - t0,
                       "figures": f, "tasks": tasks})
        say(f"TRL EVAL step {update} at {seconds:.0f} s: greedy/mean {f['greedy/mean']:.3f} turns "
            f"{f.get('episode/turns', float('nan')):.2f} ({time.time() - e0:.0f} s)")
        model.train()

    class Budget(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                steps.append({"step": state.global_step, "seconds": time.time() - t0, "reward": logs["reward"],
                              "tool_calls": logs.get("tools/call_frequency"),
                              "completion_tokens": logs.get("completions/mean_length")})
                say(f"TRL STEP {state.global_step} at {time.time() - t0:.0f} s: reward {logs['reward']:.3f} "
                    f"tool calls {logs.get('tools/call_frequency', float('nan')):.2f} completion tokens "
                    f"{logs.get('completions/mean_length', float('nan')):.0f}")

        def on_step_end(self, args, state, control, **kw):
            seconds = time.time() - t0
            over = seconds >= cfg.budget_s
            if state.global_step % cfg.eval_every == 0 and not over:
                evaluate(state.global_step, seconds)
            if over or time.time() - t0 >= cfg.budget_s:
                control.should_training_stop = True

    args = GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=cfg.micro_batch,
        gradient_accumulation_steps=cfg.batch // cfg.micro_batch, steps_per_generation=cfg.batch // cfg.micro_batch,
        num_generations=cfg.num_generations, max_steps=cfg.trl_max_steps or 1_000_000, learning_rate=cfg.lr,
        lr_scheduler_type="constant", warmup_steps=0, max_completion_length=cfg.max_turns * cfg.max_tokens + 256,
        generation_kwargs={"max_new_tokens": cfg.max_tokens}, max_tool_calling_iterations=cfg.max_turns - 1,
        temperature=1.0, use_cpu=True, bf16=False, gradient_checkpointing=True, logging_steps=1,
        save_strategy="no", report_to="none", seed=cfg.seed, disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=final_reply_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, environment_factory=CalcTool, callbacks=[Budget()])
    evaluate(0, 0.0)  # v0 is the warm folder, there from the start (as ours' v0)
    before_train = time.time() - t0
    try:
        trainer.train()
        stopped_at = time.time() - t0
        last = trainer.state.global_step
        if not points or points[-1]["update"] != last:  # the last step, scored after the budget as ours' is
            evaluate(last, stopped_at)
    finally:
        for s in sessions:
            s.close()
    result = {"side": "trl", "trl": trl.__version__, "torch": torch.__version__, "budget_s": cfg.budget_s,
              "stopped_at_s": stopped_at, "wall_s": time.time() - t0, "setup_s": before_train,
              "backend": "transformers model.generate (TRL's default, no vLLM), float32, on the CPU",
              "steps": steps, "points": points, "updates": last,
              "log_history": trainer.state.log_history}
    cfg.worker_out.parent.mkdir(parents=True, exist_ok=True)
    cfg.worker_out.write_text(json.dumps(result, indent=1, default=str))


def run_trl(cfg: PeerConfig, warm: str) -> dict:
    out = cfg.run_dir / "trl" / "result.json"
    out.unlink(missing_ok=True)
    args = [str(cfg.peer_python), str(Path(__file__).resolve()), "--worker", "--worker-out", str(out),
            "--warm", warm, "--budget-s", str(cfg.budget_s), "--eval-every", str(cfg.eval_every),
            "--eval-tasks", str(cfg.eval_tasks), "--heldout-frac", str(cfg.heldout_frac),
            "--eval-deadline-s", str(cfg.eval_deadline_s), "--max-tokens", str(cfg.max_tokens), "--max-turns", str(cfg.max_turns), "--batch", str(cfg.batch),
            "--num-generations", str(cfg.num_generations), "--micro-batch", str(cfg.micro_batch), "--lr", str(cfg.lr), "--run-dir", str(cfg.run_dir),
            "--trl-max-steps", str(cfg.trl_max_steps), "--threads", str(cfg.threads), "--seed", str(cfg.seed)]
    before = load()
    say(f"TRL: {shlex.join(args)}")
    t0 = time.time()
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(cfg.threads))
    with open(cfg.run_dir / "trl.log", "w") as log:
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if line.startswith(("TRL ", "Traceback")) or "Error" in line:
                print(line, end="", flush=True)
        proc.wait()
    if proc.returncode or not out.exists():
        raise SystemExit(f"the TRL side failed (exit {proc.returncode}); see {cfg.run_dir / 'trl.log'}")
    result = json.loads(out.read_text())
    after = load()
    return result | {"command": shlex.join(["python", "bench/side_by_side.py", *args[2:]]), "started": before["at"],
                     "load_before": before["loadavg"], "load_after": after["loadavg"], "wall_s": time.time() - t0}


# ---------------------------------------------------------------------------------------------------
# the comparison


def reach(points: list[dict], level: float) -> float | None:
    """Seconds at which a policy first scored `level` or more (the time its weights existed)."""
    hits = [p["seconds"] for p in points if p["accuracy"] >= level - 1e-9 and p["seconds"] is not None]
    return min(hits) if hits else None


def to_target(points: list[dict]) -> tuple[float, float | None]:
    """The target (the first point's accuracy + TARGET_RISE) and the seconds at which it was reached."""
    target = points[0]["accuracy"] + TARGET_RISE
    return target, reach(points, target)


def cutoff(r: dict) -> float:
    """When the side's training was due to stop: the end of the step in progress at the budget (its
    first step ending at or after it); points of later weights are shown but not compared."""
    late = [s["seconds"] for s in r["steps"] if s["seconds"] >= r["budget_s"]]
    return min(late) if late else float("inf")


def compared(r: dict) -> list[dict]:
    return [p for p in r["points"] if p["seconds"] is not None and p["seconds"] <= cutoff(r) + 1e-6]


def comparison(data: dict, x: Side, y: Side) -> list[str]:
    """The verdict lines for two sides: start, best, and the seconds each took to the highest
    accuracy both reached above the start, with the ratio y ÷ x."""
    rx, ry = data["sides"].get(x), data["sides"].get(y)
    nx, ny = NAMES[x], NAMES[y]
    if not (rx and ry and rx["points"] and ry["points"]):
        return [f"{nx} and {ny}: not both have run, no comparison."]
    px, py = compared(rx), compared(ry)
    start_x, start_y = px[0]["accuracy"], py[0]["accuracy"]
    start = max(start_x, start_y)
    best_x, best_y = max(p["accuracy"] for p in px), max(p["accuracy"] for p in py)
    lines = [f"Start (v0, the same warm folder): {nx} {start_x:.3f}, {ny} {start_y:.3f}. "
             f"Best: {nx} {best_x:.3f}, {ny} {best_y:.3f}."]
    level = min(best_x, best_y)
    if best_x <= start and best_y <= start:
        lines.append(f"**Neither {nx} nor {ny} rose above the start ({start:.3f}) within {rx['budget_s']:.0f} s**: "
                     "no time to a higher accuracy to compare.")
    elif level <= start:
        who, other, pts = (nx, ny, px) if best_x > start else (ny, nx, py)
        best = max(best_x, best_y)
        lines.append(f"**Only {who} rose above the start**: {best:.3f} at {reach(pts, best):.0f} s; {other} never "
                     f"scored above {start:.3f} within the budget, so there is no ratio of times.")
    else:
        t_x, t_y = reach(px, level), reach(py, level)
        lines.append(f"**Both reached {level:.3f}** (the highest accuracy both reached above the start): {nx} at "
                     f"{t_x:.0f} s, {ny} at {t_y:.0f} s; **{ny} ÷ {nx} = {t_y / t_x:.2f}**.")
    return lines + own_targets(px, py, nx, ny)


def own_targets(px: list[dict], py: list[dict], nx: str, ny: str) -> list[str]:
    """Seconds each side took to rise TARGET_RISE above its own start. The common level above
    compares the same accuracy; where the starts differ (TRL's scorer generates with transformers,
    ours' with vLLM, and a greedy reply can differ between the two), this compares the same gain."""
    if px[0]["accuracy"] == py[0]["accuracy"]:
        return []
    (target_x, t_x), (target_y, t_y) = to_target(px), to_target(py)
    said = "; ".join(f"{n} {target:.3f} " + ("not reached" if t is None else f"at {t:.0f} s")
                     for n, target, t in ((nx, target_x, t_x), (ny, target_y, t_y)))
    ratio = f"; **{ny} ÷ {nx} = {t_y / t_x:.2f}**" if t_x is not None and t_y is not None else ""
    return [f"The starts differ, so each against its own: start + {TARGET_RISE:g}: {said}{ratio}."]


def throughput(r: dict) -> tuple[int, float | None]:
    """Trajectories trained up to the cutoff, and per second between the first step and the last (the
    start-up and the critic warm-up's first step left out; both sides pay them)."""
    steps = [s for s in r["steps"] if s["seconds"] <= cutoff(r) + 1e-6]
    n = sum(s.get("trajectories") or 0 for s in steps)
    if len(steps) < 2:
        return n, None
    return n, sum(s.get("trajectories") or 0 for s in steps[1:]) / (steps[-1]["seconds"] - steps[0]["seconds"])


def sync_table(data: dict) -> list[str]:
    """Ours against sync: trajectories trained per second and seconds to the target accuracy."""
    rows = ["| side | trajectories trained | trajectories per second | policy updates | held-out at start → best "
            f"| target (start + {TARGET_RISE:g}) | seconds to the target |", "| --- | --- | --- | --- | --- | --- | --- |"]
    rates = {}
    for side in ("ours", "sync"):
        r = data["sides"].get(side)
        if not r or not r["points"]:
            continue
        pts = compared(r)
        n, rate = throughput(r)
        rates[side] = rate
        target, hit = to_target(pts)
        rows.append(f"| {side} | {n} | {'–' if rate is None else f'{rate:.4f}'} | {max(p['update'] for p in pts)} | "
                    f"{pts[0]['accuracy']:.3f} → {max(p['accuracy'] for p in pts):.3f} | {target:.3f} | "
                    f"{'not reached' if hit is None else f'{hit:.0f}'} |")
    if rates.get("ours") and rates.get("sync"):
        rows += ["", f"Trajectories trained per second, ours ÷ sync: **{rates['ours'] / rates['sync']:.2f}**."]
    return rows


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import save_figure

    fig, ax = plt.subplots(figsize=(7, 4))
    for side, label, color in (("ours", "ours (sao up: SAO, streaming, vLLM producer)", "tab:blue"),
                               ("sync", f"sync (sao up: groups of 4, barrier, "
                                        f"{data['config'].get('sync_algorithm', 'grpo_dis')})", "tab:green"),
                               ("trl", "TRL GRPOTrainer (transformers generate)", "tab:orange")):
        r = data["sides"].get(side)
        if not r:
            continue
        pts = [p for p in r["points"] if p["seconds"] is not None]
        ax.step([p["seconds"] for p in pts], [p["accuracy"] for p in pts], where="post", color=color, label=label,
                marker="o")
        for p in pts:
            ax.annotate(str(p["update"]), (p["seconds"], p["accuracy"]), textcoords="offset points", xytext=(3, 4),
                        fontsize=7, color=color)
    ax.axvline(data["config"]["budget_s"], color="grey", ls=":", lw=1)
    ax.set_xlabel("wall-clock seconds since the side started (labels: policy updates)")
    ax.set_ylabel(f"held-out greedy accuracy ({data['config']['eval_tasks']} problems)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("calc-agent, SmolLM2-135M warm start, 2 CPU cores")
    ax.legend(fontsize=8, loc="upper left")
    save_figure(fig, path, dpi=90)


def markdown(data: dict) -> str:
    cfg, sides = data["config"], data["sides"]
    m = data["machine"]
    lines = [f"# Side by side on calc-agent: streaming, a group barrier, and TRL's GRPOTrainer ({cfg['budget_s']:.0f} s "
             "each)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, no GPU; {m['platform']}. "
             f"Date: {data['date']}. trl {sides.get('trl', {}).get('trl', '?')}, torch {m['torch']}, transformers "
             f"{m['transformers']}. Commit {data.get('commit', '?')}. Warm start: `{cfg['warm']}` "
             f"({data.get('warmup', '')}).", "",
             f"Command: `{data['command']}`", ""]
    for side, name in NAMES.items():
        r = sides.get(side)
        if not r:
            continue
        lines += [f"- {name}: `{r['command']}`", f"  - generation: {r['backend']}",
                  f"  - started {r['started']}, load average {r['load_before']} before, {r['load_after']} after; "
                  f"stopped at {r['stopped_at_s'] or 0:.0f} s, {r['updates']} policy updates, "
                  f"{r['wall_s']:.0f} s in all (the last evaluation included)"]
        if r.get("events"):
            lines.append(f"  - sao up's supervisor: {'; '.join(r['events'])}")
    lines += ["", "## Held-out accuracy against wall-clock seconds", "",
              "A point's seconds are when its weights existed (ours: the learner published the version; TRL: the "
              "optimizer step ended), from the side's start; `scored at` is when its evaluation ended.", "",
              "A point marked *past the budget* is of weights made after the step in progress at the budget "
              "ended (a learner that did not stop when told): shown, not compared.", "",
              "`against update 0`: the held-out problems this version solves and update 0 did not (+), those update 0 "
              "solved and it does not (−), and the exact sign test's p-value of that split: the chance of one at "
              "least as lopsided if training had changed nothing (producers/evaluate/scores.py).", "",
              "| side | policy updates | seconds | held-out greedy | against update 0 | turns | evaluation took (s) | "
              "scored at (s) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for side, name in NAMES.items():
        r = sides.get(side) or {"points": [], "steps": [], "budget_s": 0}
        kept = compared(r)
        for p in r["points"]:
            name_ = name if p in kept else f"{name}, *past the budget*"
            secs = "–" if p["seconds"] is None else f"{p['seconds']:.0f}"
            turns = "–" if p.get("turns") is None else f"{p['turns']:.2f}"
            ev = "–" if p.get("eval_s") is None else f"{p['eval_s']:.0f}"
            lines.append(f"| {name_} | {p['update']} | {secs} | {p['accuracy']:.3f} | {against(r['points'][0], p)} | "
                         f"{turns} | {ev} | {p['scored_at']:.0f} |")
    lines += ["", "## Streaming against a group barrier (ours, sync)", "",
              "Trajectories per second: those trained after the first step, over the seconds from the first step "
              "to the last before the budget's cutoff.", "", *sync_table(data), "", *comparison(data, "ours", "sync"),
              "", "## Against the peer (ours, TRL)", "", *comparison(data, "ours", "trl"), ""]
    for side, name in NAMES.items():
        r = sides.get(side)
        if r and r["steps"]:
            rewards = ", ".join(f"{s['reward']:.3f}" for s in r["steps"])
            lines.append(f"Training reward per step, {name} ({len(r['steps'])} steps): {rewards}.")
    notes = Path(cfg["out"]).stem + "_notes" + Path(cfg["out"]).suffix  # written beside it after the run
    lines += ["", f"![accuracy against seconds]({Path(cfg['out']).with_suffix('.png').name})", "",
              f"Notes on this run: [{notes}]({notes}).", ""]
    return "\n".join(lines)


def against(first: dict, p: dict) -> str:
    """`+gained −lost (p …)` of point p against the side's first, task by task; – where either has
    no per-task scores (results from before they were recorded) or p is the first."""
    if p is first or not first.get("tasks") or not p.get("tasks"):
        return "–"
    c = paired_change(first["tasks"], p["tasks"])
    return f"+{c['gained']} −{c['lost']} (p {c['p']:.2f})"


def machine() -> dict:
    import torch
    import transformers

    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), platform.processor())
    flags = next((x.split(":", 1)[1].split() for x in info if x.startswith("flags")), [])
    if "avx512_bf16" in flags:
        cpu += " (AVX-512 BF16)"
    mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30)
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": mem, "torch": torch.__version__,
            "transformers": transformers.__version__,
            "platform": f"{platform.machine()}, {torch.backends.cpu.get_cpu_capability()}"}


def write(data: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    out.write_text(markdown(data))
    plot(data, out.with_suffix(".png"))
    say(f"wrote {out}, {out.with_suffix('.json')}, {out.with_suffix('.png')}")


def main(cfg: PeerConfig) -> None:
    if cfg.worker:
        return trl_worker(cfg)
    saved = json.loads(cfg.out.with_suffix(".json").read_text()) if cfg.out.with_suffix(".json").exists() else None
    if cfg.replot:
        return write(saved, cfg.out)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if "trl" in cfg.sides and not cfg.peer_python.exists():
        raise SystemExit(f"{cfg.peer_python} not found: `make peer-env` builds it")
    warm = warm_folder(cfg)
    say(f"warm start: {warm}")
    record = Path(warm, "warmup.json")
    warmup = json.loads(record.read_text())["summary"] if record.exists() else "not a sao warmup folder"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    data = {"command": cfg.command or shlex.join(["python", "bench/side_by_side.py", *sys.argv[1:]]),
            "commit": commit.strip() or os.environ.get("PEER_COMMIT", "?"),
            "date": datetime.date.today().isoformat(), "machine": machine(), "warmup": f"sao warmup: {warmup}",
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()} | {"warm": warm},
            "sides": dict((saved or {}).get("sides", {}))}
    for side in cfg.sides:
        data["sides"][side] = run_trl(cfg, warm) if side == "trl" else run_ours(cfg, warm, side)
        r = data["sides"][side]
        say(f"{side}: " + ", ".join(f"update {p['update']} at {p['seconds'] or 0:.0f} s: {p['accuracy']:.3f}"
                                    for p in r["points"]) + f" ({r['wall_s']:.0f} s in all)")
        write(data, cfg.out)  # after each side: a later failure keeps what finished
    for line in [*sync_table(data), *comparison(data, "ours", "sync"), *comparison(data, "ours", "trl")]:
        say(line)


if __name__ == "__main__":
    main(tyro.cli(PeerConfig))
