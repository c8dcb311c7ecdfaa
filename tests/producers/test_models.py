import torch

from learner.models import ModelConfig, build_policy, tiny_llama as learner_tiny_llama
from schemas.tokenizers import ByteTokenizer
from producers.models import load_model
from schemas.catalogue import TINY_LLAMA, TINY_LLAMA_BYTES
from schemas.tokenizers import load_tokenizer


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_llama_is_bit_identical_to_the_learners_for_the_same_seed():
    assert _same(load_model("tiny-llama", seed=3), learner_tiny_llama(seed=3))
    assert _same(load_model("tiny-llama-bytes", seed=3),
                 learner_tiny_llama(vocab_size=TINY_LLAMA_BYTES["vocab_size"],
                                    max_positions=TINY_LLAMA_BYTES["max_positions"], seed=3))
    assert not _same(load_model("tiny-llama", seed=3), load_model("tiny-llama", seed=4))
    # the learner builds the producers' text-env tiny model by the same name
    assert _same(load_model("tiny-llama-bytes", seed=3), build_policy(ModelConfig(name="tiny-llama-bytes", seed=3)))


def test_tiny_models_and_their_tokenizers():
    assert load_model("tiny-llama").config.vocab_size == TINY_LLAMA["vocab_size"]
    assert load_tokenizer("tiny-llama") is None  # toy envs speak token ids
    tok = load_tokenizer("tiny-llama-bytes")
    assert isinstance(tok, ByteTokenizer)
    assert load_model("tiny-llama-bytes").config.vocab_size == tok.vocab_size


def test_building_a_model_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    load_model("tiny-llama", seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_smollm2_plays_a_math_episode_with_chat_template_stop_token_and_exact_logprobs():
    """The one test that loads the real model (~20 s): GGUF de-quantized offline, ChatML prompt,
    <|im_end|> as the stop token, log-probs the learner's recomputation reproduces."""
    from learner.logprobs import collate, token_logprobs
    from producers.envs import make_env
    from producers.envs.chat import Chat
    import asyncio

    from producers.episode import TrajectoryIds, run_episode
    from producers.generate.base import SamplingParams
    from producers.generate.hf import HFGenerator

    tok, model = load_tokenizer("smollm2"), load_model("smollm2")
    chat = Chat(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in chat.stop_token_ids()
    env = make_env("math", tokenizer=tok)
    task = {"question": "What is 2 + 3?", "answer": 5}
    params = SamplingParams(temperature=0.7, max_tokens=40, stop_token_ids=chat.stop_token_ids(), seed=0)
    traj = asyncio.run(run_episode(env.episode(task), HFGenerator(model, seed=0), params,
                       TrajectoryIds(id="t", prompt_id="p", env="math", producer_id="test")))
    prompt = tok.decode(traj.tokens[:traj.prompt_len].tolist())
    assert prompt.startswith("<|im_start|>system") and "What is 2 + 3?" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert traj.finish_reason == "length" or int(traj.tokens[-1]) in chat.stop_token_ids()
    batch = collate([traj])
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=0.7)
    acted = batch.action_mask
    assert float((logp[acted] - batch.logp_rollout[acted]).abs().max()) < 1e-4


def test_the_byte_tokenizer_as_a_transformers_tokenizer_gives_the_same_ids_and_chat_text():
    """What `sao export` writes for tiny-llama-bytes: transformers and vLLM render the same ChatML,
    tool listings and tool-call blocks, and encode them to the same ids."""
    import json

    byte = ByteTokenizer()
    fast = byte.to_transformers()
    tools = [{"type": "function", "function": {"name": "python", "description": "run code",
                                               "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}}
    as_string = {"type": "function", "function": {"name": "python", "arguments": json.dumps({"code": "x = 'é'"})}}
    chats = [([{"role": "user", "content": "héllo 7+8?"}], None),
             ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}], tools),
             ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "content": "1\n"}], tools),
             ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "ok", "tool_calls": [as_string]}], None)]
    for messages, listed in chats:
        for prompt in (True, False):
            text = byte.apply_chat_template(messages, add_generation_prompt=prompt, tools=listed)
            assert fast.apply_chat_template(messages, add_generation_prompt=prompt, tools=listed, tokenize=False) == text
            ids = fast.encode(text, add_special_tokens=False)
            assert ids == byte.encode(text) and fast.decode(ids) == text
    assert (len(fast), fast.eos_token_id, fast.pad_token_id) == (byte.vocab_size, byte.eos_token_id, 259)
