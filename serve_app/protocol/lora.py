"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
from __future__ import annotations

from pydantic import Field

from pagedserve.serve_app.protocol.common import _Request


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM accepts it; the name decides
