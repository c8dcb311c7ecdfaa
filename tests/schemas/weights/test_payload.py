"""The weight-update payload codec: exact anchors and deltas, strict and bounded decoding."""

from __future__ import annotations

import json
import struct

import cramjam
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load

from schemas.messages import SchemaError
from schemas.weights import payload as W


def bf16(*values: float) -> W.Tensor:
    return W.from_torch(torch.tensor(values, dtype=torch.bfloat16))


def roundtrip(payload: W.Payload, base: W.State | None) -> W.State:
    decoded, views = W.decode(payload.to_bytes())
    return W.apply(decoded, views, base)


def test_a_delta_by_hand():
    """One of 64 bf16 elements moves (3.0 -> 3.5); 1.0 + 1e-3 rounds back to 1.0 in bf16, so it is
    not sent; a 4-element tensor that moves travels whole (zstd's frames outweigh 8 bytes)."""
    values = [1.0] * 64
    values[2] = 3.0
    old = {"a": bf16(*values), "b": bf16(1.0, 1.0), "c": bf16(1, 2, 3, 4)}
    values[2] = 3.5
    new = {"a": bf16(*values), "b": W.from_torch(torch.tensor([1.0 + 1e-3, 1.0]).bfloat16()), "c": bf16(1, 2, 3, 5)}
    payload, result = W.delta(new, old, base=7)
    assert payload.base == 7 and [s[3] for s in payload.tensors.values()] == ["xor", "same", "whole"]
    views = dict((n, d) for n, _, _, d in payload.entries)
    mask = np.frombuffer(bytes(cramjam.zstd.decompress(views["a:mask"].tobytes())), np.uint8)
    assert mask.tolist() == [0b00100000] + [0] * 7  # element 2 of 64
    xor = np.frombuffer(bytes(cramjam.zstd.decompress(views["a:xor"].tobytes())), np.uint16)
    assert xor.tolist() == [0x4060 ^ 0x4040]  # bf16 bits of 3.5 and 3.0: one mantissa bit apart
    assert result["b"] is old["b"]  # unchanged: the old tensor, its checksum not recomputed
    got = roundtrip(payload, old)
    assert W.to_torch(got["a"]).tolist() == values and W.digest(got) == W.digest(result)


def test_an_anchor_is_a_safetensors_file_any_reader_opens():
    state = {"w": W.from_torch(torch.randn(3, 4)), "i": W.from_torch(torch.arange(5)), "h": bf16(0.5)}
    data = W.anchor(state, extra={"lora_scale": 2.0}).to_bytes()
    loaded = load(data)
    assert all(torch.equal(loaded[k], W.to_torch(t)) for k, t in state.items())
    decoded, views = W.decode(data)
    assert decoded.extra == {"lora_scale": 2.0} and W.digest(W.apply(decoded, views, None)) == W.digest(state)


states = st.integers(0, 2**32 - 1).map(lambda seed: np.random.default_rng(seed))


@settings(max_examples=60, deadline=None)
@given(states, st.floats(0, 1), st.sampled_from([torch.bfloat16, torch.float32, torch.float16]))
def test_apply_of_a_delta_gives_the_new_state_bit_for_bit(rng, frac, dtype):
    old, new = {}, {}
    for i, n in enumerate(rng.integers(0, 3000, 4)):
        x = torch.from_numpy(rng.normal(size=int(n))).to(dtype)
        y = x.clone()
        moved = torch.from_numpy(rng.random(int(n)) < frac)
        y[moved] += torch.from_numpy(rng.normal(size=int(moved.sum()))).to(dtype)
        old[f"t{i}"], new[f"t{i}"] = W.from_torch(x), W.from_torch(y)
    new["grown"] = W.from_torch(torch.zeros(3, dtype=dtype))  # a tensor the base lacks travels whole
    payload, result = W.delta(new, old, base=1)
    got = roundtrip(payload, old)
    assert list(got) == list(new) and W.digest(got) == W.digest(new) == W.digest(result)
    assert all(np.array_equal(got[k].bits, new[k].bits) for k in new)
    assert payload.num_bytes <= W.anchor(new).num_bytes + len(payload.header)  # never much worse than whole


def test_a_delta_onto_another_base_names_the_first_tensor_that_does_not_verify():
    old = {"a": bf16(*range(64)), "b": bf16(*range(64))}
    payload, _ = W.delta({"a": bf16(*range(63), 99), "b": bf16(*range(63), 98)}, old, base=1)
    with pytest.raises(SchemaError) as e:
        roundtrip(payload, {"a": bf16(7, *range(1, 64)), "b": old["b"]})
    assert e.value.field == "a" and "checksum" in str(e.value)
    with pytest.raises(SchemaError, match="base holds no"):
        roundtrip(payload, {"a": bf16(*range(63)), "b": old["b"]})
    with pytest.raises(SchemaError, match="needs that version"):
        roundtrip(payload, None)


BASE = {"a": bf16(*range(64)), "b": bf16(1, 2)}


def _tampered(edit) -> bytes:
    """A delta (tensor a: one element moved, xor-encoded; b unchanged), its header and bytes edited."""
    payload, _ = W.delta({"a": bf16(*range(5), 99, *range(6, 64)), "b": bf16(1, 2)}, BASE, 3)
    assert [s[3] for s in payload.tensors.values()] == ["xor", "same"]
    data = payload.to_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    body = data[8 + size:]
    header, body = edit(header, body)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _meta(header: dict) -> dict:
    return json.loads(header["__metadata__"]["sao"])


def _with_meta(header: dict, meta: dict) -> dict:
    return header | {"__metadata__": {"sao": json.dumps(meta)}}


@pytest.mark.parametrize("edit, field", [
    (lambda h, b: (h, b[:-1]), "a:xor"),  # truncated: the last entry runs past the end
    (lambda h, b: ({k: v for k, v in h.items() if k != "a:mask"}, b), "a:mask"),  # missing entry
    (lambda h, b: (h | {"c": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}, b), "c"),  # stray
    (lambda h, b: (h | {"a:mask": h["a:mask"] | {"dtype": "X9"}}, b), "a:mask"),
    (lambda h, b: (_with_meta(h, _meta(h) | {"base": "3"}), b), "payload"),
    (lambda h, b: ({k: v for k, v in h.items() if k != "__metadata__"}, b), "payload"),  # no sao metadata
    (lambda h, b: (_with_meta(h, _meta(h) | {"tensors": _meta(h)["tensors"] | {"b": ["BF16", [2], "0", "same"]}}),
                   b), "b"),
])
def test_malformed_payloads_are_refused_naming_the_entry(edit, field):
    with pytest.raises(SchemaError) as e:
        W.decode(_tampered(edit))
    assert e.value.field == field


def test_decompression_is_bounded_by_the_tensor_size():
    """A mask stream that inflates past ceil(n/8) bytes (a zip bomb, or another tensor's) is refused."""
    bomb = np.frombuffer(bytes(cramjam.zstd.compress(b"\0" * (1 << 20))), np.uint8)

    def swap_mask(header, body):
        (lo, m), (_, end) = header["a:mask"]["data_offsets"], header["a:xor"]["data_offsets"]
        n = len(bomb)
        header["a:mask"] |= {"shape": [n], "data_offsets": [0, n]}
        header["a:xor"] |= {"data_offsets": [n, n + end - m]}
        return header, bomb.tobytes() + body[m:end]

    data = _tampered(swap_mask)
    decoded, views = W.decode(data)
    with pytest.raises(SchemaError) as e:
        W.apply(decoded, views, BASE)
    assert e.value.field == "a:mask"
