import random

import pytest

from producers.envs import make_env
from schemas.tokenizers import ByteTokenizer
from schemas.messages import SchemaError


def test_writing_episode_has_no_built_in_reward():
    tok = ByteTokenizer()
    env = make_env("writing", tokenizer=tok)
    task = env.sample_task(random.Random(0))
    ep = env.episode(task)
    assert task["instruction"] in tok.decode(ep.prompt_ids)
    step = ep.step(tok.encode("Waves fold in, waves fold out.<|im_end|>"))
    assert step.done and step.reward is None


def test_writing_tasks_need_no_tokenizer_to_sample_but_episodes_do():
    env = make_env("writing")
    task = env.sample_task(random.Random(0))
    with pytest.raises(ValueError, match="tokenizer"):
        env.episode(task)
    with pytest.raises(SchemaError, match="task.instruction"):
        make_env("writing", tokenizer=ByteTokenizer()).episode({"instruction": 3})
