"""What the weight protocol needs of an inference engine, and nothing else of it.

An in-process engine (the hf and vllm generators, the simulator) is an `Engine`: the follower hands
it a verified state's tensors in memory (`load_state`), so an update reaches the engine's weights
without a file, whatever carried it (an inline delta, a file of the store, a collective broadcast).
An engine in another process that reads the learner's store itself (the http backend in front of a
vLLM server) is a `RemoteEngine`: it is handed the newest announcement's uri instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch


class ArchitectureMismatch(ValueError):
    """Weights that are not this engine's model (other names or shapes): no later version will fit
    either, so the producer must stop rather than sample forever with stale weights."""


class Engine(Protocol):
    @property
    def version(self) -> int:
        """The weight version live (0 = the initial checkpoint)."""

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise ArchitectureMismatch unless these (Hugging Face names → shapes) are this model's."""

    def load_state(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Make the full state `tensors` (Hugging Face names, plain weights) live as `version`, in
        the engine's memory, between two decode steps; returns once it is. Raises, still serving the
        old weights whole, on an older version, another architecture or a failed load. The tensors
        may share memory with the caller's state: the engine copies what it keeps."""


class RemoteEngine(Protocol):
    @property
    def version(self) -> int: ...

    def load_weights(self, path: str, version: int) -> None:
        """Have the engine load the payload at `path` (an announcement's uri) as `version`."""
