from hypothesis import given, strategies as st

from producers.envs.chat import Chat
from schemas.tokenizers import ByteTokenizer

tok = ByteTokenizer()


@given(st.text())
def test_byte_tokenizer_round_trips_text(text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_parses_special_tokens():
    assert tok.encode("a<|im_end|>") == [97, 257]
    assert tok.decode([97, 257], skip_special_tokens=True) == "a"


def test_observation_follows_the_stop_token_without_repeating_it():
    chat = Chat(tok)
    assert chat.stop_token_ids() == (257,)
    stopped = tok.decode(chat.observation_ids(tok.encode("x<|im_end|>"), "out"))
    assert stopped == "\n<|im_start|>user\nout<|im_end|>\n<|im_start|>assistant\n"
    cut = tok.decode(chat.observation_ids(tok.encode("x<"), "out"))  # length-cut turn is closed
    assert cut == "<|im_end|>\n<|im_start|>user\nout<|im_end|>\n<|im_start|>assistant\n"


def test_multi_turn_ids_equal_the_template_of_the_whole_conversation():
    chat = Chat(tok)
    msgs = [{"role": "user", "content": "q"}]
    ids = chat.prompt_ids(msgs) + tok.encode("a1<|im_end|>")
    ids += chat.observation_ids(tok.encode("a1<|im_end|>"), "o1")
    full = msgs + [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "o1"}]
    assert ids == chat.prompt_ids(full)
