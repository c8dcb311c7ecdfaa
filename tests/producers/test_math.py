import random

import pytest
from hypothesis import given, strategies as st

from producers.envs import make_env
from schemas.tokenizers import ByteTokenizer
from producers.envs.math import evaluate, extract_answer, sample_problem, score
from schemas.messages import SchemaError


def test_evaluate_applies_multiplication_before_addition():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([10, 2, 3], ["-", "-"]) == 5
    assert evaluate([3, 4, 5], ["*", "-"]) == 7
    assert evaluate([7], []) == 7


@given(st.lists(st.integers(1, 999), min_size=1, max_size=5), st.data())
def test_evaluate_matches_python_arithmetic(nums, data):
    ops = data.draw(st.lists(st.sampled_from("+-*"), min_size=len(nums) - 1, max_size=len(nums) - 1))
    expr = " ".join(f"{x} {op}" for x, op in zip(nums, ops)) + f" {nums[-1]}"
    assert evaluate(nums, ops) == eval(expr)  # our own generated string of integers and + - *


@pytest.mark.parametrize("text, expected", [
    ("so it is 40 + 2. Answer: 42", 42),
    ("The answer is -7.", -7),
    ("\\boxed{1,234}", 1234),
    ("Answer: 3, no wait. Answer: 5", 5),
    ("I think 42", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@given(st.integers(0, 2**32))
def test_generated_answers_verify_exactly(seed):
    task = sample_problem(random.Random(seed), 50)
    assert score(f"work... Answer: {task['answer']}", task["answer"]) == 1.0
    assert score(f"Answer: {task['answer'] + 1}", task["answer"]) == 0.0
    assert score(str(task["answer"]), task["answer"]) == 0.0  # the format is part of the task


def test_episode_is_single_turn_with_the_question_in_a_chat_prompt():
    tok = ByteTokenizer()
    env = make_env("math", tokenizer=tok)
    task = env.sample_task(random.Random(1))
    ep = env.episode(task)
    prompt = tok.decode(ep.prompt_ids)
    assert task["question"] in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert ep.max_turns == 1
    step = ep.step(tok.encode(f"Answer: {task['answer']}<|im_end|>"))
    assert step.done and step.reward == 1.0
    assert env.episode(task).step(tok.encode("Answer: -1")).reward == 0.0


@pytest.mark.parametrize("task", [{}, {"question": "", "answer": 1}, {"question": "q", "answer": "1"},
                                  {"question": "q", "answer": True}])
def test_invalid_task_raises_schema_error(task):
    with pytest.raises(SchemaError, match="task"):
        make_env("math", tokenizer=ByteTokenizer()).episode(task)
