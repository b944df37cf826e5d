"""Which LoRA adapter a request runs with: vLLM's `LoRARequest`, and the adapter's identity in
the prefix cache."""
from __future__ import annotations

import msgspec

from pagedserve.replicas.core.block_hash import ROOT_HASH


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """An adapter by name, id and path (a PEFT directory: adapter_config.json and
    adapter_model.safetensors). The id is its identity everywhere: the engine's adapter cache,
    its slot, and its requests' KV blocks. Give one id one set of weights: an id loaded again
    from changed files would find the old weights' KV blocks in the prefix cache."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id}")

    # vLLM's LoRARequest has these aliases too: code written for it reads them.
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def adapter_root_hash(lora_int_id: int | None) -> int:
    """The parent hash of a prompt's first block: the base model's blocks chain from ROOT_HASH,
    an adapter's from its own root, so no two adapters (nor an adapter and the base) ever share
    a KV block, and the router's block hashes stay exact per adapter."""
    if not lora_int_id:
        return ROOT_HASH
    return hash((ROOT_HASH, 0x4C6F5241, lora_int_id))  # a tuple of ints hashes alike everywhere
