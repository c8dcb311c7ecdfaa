"""Tokenizers by model name, for every service that turns token ids into text or back.

`ByteTokenizer` is a ChatML tokenizer over raw UTF-8 bytes for the tiny `tiny-llama-bytes` model:
256 byte ids plus four special tokens, no files, no downloads. Real models' tokenizers come from
transformers (imported only when one is asked for): SmolLM2's from its GGUF, or a folder's (or
cached hub model's) own; a folder without tokenizer files is a model over raw token ids, like the
tiny ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from schemas.models import BUILTIN_MODELS, BYTES_MAX_POSITIONS, cached_hub_file, check_model, smollm2_gguf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A folder (or cached hub model) with none of these has no tokenizer: a model over raw ids."""


class ByteTokenizer:
    """UTF-8 bytes (ids 0..255) + `<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, `<|pad|>`."""

    special = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>")
    vocab_size = 256 + len(special)
    eos_token_id = 257  # <|im_end|>

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for k, tok in enumerate(self.special):
                if text.startswith(tok, i):
                    ids.append(256 + k)
                    i += len(tok)
                    break
            else:
                j = min((p for p in (text.find(t, i) for t in self.special) if p >= 0), default=len(text))
                ids += text[i:j].encode()
                i = j
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out, run = [], bytearray()
        for t in ids:
            if t < 256:
                run.append(t)
                continue
            out.append(run.decode(errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append(self.special[t - 256])
        out.append(run.decode(errors="replace"))
        return "".join(out)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return 256 + self.special.index(token) if token in self.special else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False, tools: list[dict] | None = None) -> str | list[int]:
        """ChatML. `tools` are listed in the system turn, and an assistant's `tool_calls` render as
        Hermes-style `<tool_call>{"name": …, "arguments": …}</tool_call>` blocks, the format the
        rollout proxy (producers/serve/proxy.py) parses back out of sampled text."""
        turns = [[m["role"], (m.get("content") or "") + "".join(map(_tool_call, m.get("tool_calls") or ()))]
                 for m in messages]
        if tools:
            listing = _TOOLS_HEADER + "\n".join(json.dumps(t) for t in tools)
            if turns and turns[0][0] == "system":
                turns[0][1] += "\n\n" + listing
            else:
                turns.insert(0, ["system", listing])
        text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text

    def to_transformers(self):
        """The same tokenizer as a transformers `PreTrainedTokenizerFast` (ids, special tokens and
        chat template alike), for a model folder that `transformers` and `vllm serve` load
        (`sao export`): a byte-level BPE with no merges, each byte its own id."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        alphabet = _byte_alphabet()
        tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(self.special))  # ids 256.. in this order
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                       chat_template=CHATML_TEMPLATE, model_max_length=BYTES_MAX_POSITIONS)


_TOOLS_HEADER = 'Tools (call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>):\n'

CHATML_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- if tools -%}{%- set ns.system = '" + _TOOLS_HEADER.replace("\n", "\\n") + "' -%}"
    "{%- for t in tools -%}{%- set ns.system = ns.system + (t | tojson) + ('\\n' if not loop.last else '') -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if tools and messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') -}}"
    "{%- if loop.first and m['role'] == 'system' and tools -%}{{- '\\n\\n' + ns.system -}}{%- endif -%}"
    "{%- for c in m.get('tool_calls') or [] -%}"
    "{%- set args = c['function'].get('arguments', {}) -%}"
    "{{- '<tool_call>{\"name\": ' + (c['function']['name'] | tojson) + ', \"arguments\": '"
    " + (args if args is string else (args | tojson)) + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
"""`ByteTokenizer.apply_chat_template` as a Jinja chat template (what transformers and vLLM
render): the same text for the same messages and tools."""


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte, the alphabet of byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _tool_call(call: dict) -> str:
    """An OpenAI tool call (arguments a JSON string) as the block a model would sample."""
    args = call["function"].get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass  # arguments that are not JSON render as the string they are
    return "<tool_call>" + json.dumps({"name": call["function"]["name"], "arguments": args}) + "</tool_call>"


def load_tokenizer(name: str):
    """The tokenizer paired with model `name`; None for models over raw ids (toy envs)."""
    check_model(name)
    if not has_tokenizer(name):
        return None
    if name == "tiny-llama-bytes":
        return ByteTokenizer()
    from transformers import AutoTokenizer

    path = smollm2_gguf() if name == "smollm2" else Path(name)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def has_tokenizer(name: str) -> bool:
    """Whether model `name` has a tokenizer: the raw-id tiny models have none, a folder or cached
    hub model has one if it holds tokenizer files."""
    path = Path(name)
    if name in ("tiny-llama", "tiny-qwen3-moe"):
        return False
    if name in BUILTIN_MODELS or path.suffix == ".gguf":
        return True
    if path.is_dir():
        return any((path / f).is_file() for f in TOKENIZER_FILES)
    return any(cached_hub_file(name, f) for f in TOKENIZER_FILES)
