"""learner/sft.py's folder: a tied model's weights are written once, under the input embedding's
name, as transformers writes them, so an engine that builds the head from the embedding (vLLM)
gets the trained weights; transformers loads the folder back to the same model."""

from __future__ import annotations

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from learner.sft import save
from schemas.catalogue import tiny_llama


def test_a_tied_model_is_written_under_its_embeddings_name_and_loads_back_the_same(tmp_path):
    model = tiny_llama(seed=3)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    with torch.no_grad():  # trained weights, not the seed's: a reload from scratch would differ
        model.model.embed_tokens.weight.add_(0.1)
    folder = save(model, tmp_path / "warm")
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)


def test_an_untied_model_keeps_both_matrices(tmp_path):
    model = tiny_llama(seed=4)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    folder = save(model, tmp_path / "warm")
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(f.keys())
