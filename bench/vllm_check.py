"""Does the vLLM CPU engine compute the log-probs of the weights it was given? Greedy continuations
of 3 calc-agent prompts, vLLM's log-probs against a float32 transformers forward of the same weights.

`python bench/vllm_check.py FOLDER`: the engine starts as `sao producer --model learner` starts it
(no weights), then bf16 files as `sao learner` publishes them (both tied names) are swapped in: v0
the folder's weights, v1 a perturbed copy. `--folder`: the engine loads FOLDER itself at v0 (as
`sao producer --model FOLDER --backend vllm` does), then v1 is swapped in.
bench/results/agent_run.md, "Diagnosing the collapse"."""
import asyncio, os, random, sys, tempfile
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from producers.envs import make_env
from producers.envs.chat import Chat
from producers.generate.base import SamplingParams
from producers.generate.vllm import VLLMGenerator
from schemas.tokenizers import load_tokenizer

def main():
    torch.set_num_threads(2)
    start = sys.argv[1]
    tok = load_tokenizer(start)
    env = make_env("calc-agent", tokenizer=tok)
    rng = random.Random(5)
    prompts = [env.prompt_ids(env.sample_task(rng)) for _ in range(3)]
    params = SamplingParams(greedy=True, max_tokens=40, stop_token_ids=Chat(tok).stop_token_ids())
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    fp32 = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    # a trained-looking change: every weight moved by ~1e-3 of its std, then rounded to bf16 as published
    moved = {k: (v + 2e-3 * v.std() * torch.randn(v.shape, generator=g)) for k, v in fp32.items()}
    moved["lm_head.weight"] = moved["model.embed_tokens.weight"]
    bf16 = {k: v.to(torch.bfloat16).contiguous() for k, v in moved.items()}

    def ref(state, prompt, tokens):
        model.load_state_dict({k: v.float() for k, v in state.items()})
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
        return torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]

    gen = VLLMGenerator(start, seed=0) if "--folder" in sys.argv else VLLMGenerator(start, load=False, version=-1, seed=0)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for version, state in ((0, fp32 if "--folder" in sys.argv else {k: v.to(torch.bfloat16).contiguous() for k, v in fp32.items()}), (1, bf16)):
                if version or "--folder" not in sys.argv:
                    save_file({k: v.clone() for k, v in state.items()}, f"{tmp}/v{version}.safetensors")
                    gen.load_weights(f"{tmp}/v{version}.safetensors", version)
                for p in prompts:
                    out = asyncio.run(gen.generate(p, params))
                    toks = out.token_ids.tolist()
                    r = ref(state, p, toks)
                    r0 = ref(fp32, p, toks)
                    print(f"v{version}: {len(toks)} tokens {tok.decode(toks)[:60]!r} max |vllm - hf(same weights)| "
                          f"{(r - torch.from_numpy(out.logprobs)).abs().max():.2e}, vs hf(fp32 v0) "
                          f"{(r0 - torch.from_numpy(out.logprobs)).abs().max():.2e}", flush=True)
    finally:
        gen.close()


if __name__ == '__main__':
    main()
