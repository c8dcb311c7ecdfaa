import torch

from learner.models import tiny_llama as learner_tiny_llama
from producers.envs.chat import ByteTokenizer
from producers.models import TINY_LLAMA, TINY_LLAMA_BYTES, load_model, load_tokenizer


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_llama_is_bit_identical_to_the_learners_for_the_same_seed():
    assert _same(load_model("tiny-llama", seed=3), learner_tiny_llama(seed=3))
    assert _same(load_model("tiny-llama-bytes", seed=3),
                 learner_tiny_llama(vocab_size=TINY_LLAMA_BYTES["vocab_size"],
                                    max_positions=TINY_LLAMA_BYTES["max_positions"], seed=3))
    assert not _same(load_model("tiny-llama", seed=3), load_model("tiny-llama", seed=4))


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
