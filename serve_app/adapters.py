"""AdapterRegistry: the LoRA adapters this ingress replica serves, by name.

The core directory (`serve_app/core_directory.py`) holds the list every ingress replica shares
and gives each adapter its id; the registry keeps this replica's copy of it (refreshed by the
`EngineClient`'s watch of the directory), registers the `lora_modules` adapters the directory
lacks, and carries out vLLM's runtime load and unload: a load is listed, checked by an engine
core, and unlisted again unless the core took it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from pagedserve.replicas.core.lora_request import LoRARequest
from pagedserve.serve_app import errors
from pagedserve.serve_app.errors import OpenAIError

if TYPE_CHECKING:
    from pagedserve.serve_app.engine_client import EngineClient

logger = logging.getLogger(__name__)

LISTED_WAIT_S = 30.0  # the first requests after start wait this long for the directory's list


class AdapterRegistry:
    def __init__(self, directory, static: dict[str, str], retry_after_s: int):
        self.directory = directory  # a handle to the CoreDirectory deployment
        self.static = static  # lora_modules: name -> path
        self.retry_after_s = retry_after_s
        self.served: dict[str, LoRARequest] = {}
        self._listed = asyncio.Event()  # the directory's list has been read once

    async def update(self, listing: dict[str, list]) -> None:
        """The directory's list; the lora_modules adapters it lacks (it just started, or this
        ingress did) are registered there first."""
        for name, path in self.static.items():
            if name not in listing:
                try:
                    listed, _ = await self.directory.register_adapter.remote(name, path)
                except Exception as exc:  # noqa: BLE001 - restarting: the next listing retries
                    logger.debug("core directory unavailable: %r", exc)
                    continue
                if listed is None:
                    logger.error("lora_modules: another adapter is loaded as %r", name)
                else:
                    listing[name] = listed
        self.served = {name: LoRARequest(*listed) for name, listed in listing.items()}
        self._listed.set()

    async def listed(self) -> dict[str, LoRARequest]:
        """The adapters served, once the list is known (only the first requests after start
        wait for it)."""
        if not self._listed.is_set():
            try:
                await asyncio.wait_for(self._listed.wait(), LISTED_WAIT_S)
            except asyncio.TimeoutError:
                raise errors.unavailable("the adapters served are not known yet",
                                         self.retry_after_s) from None
        return self.served

    async def load(self, engines: EngineClient, name: str, path: str) -> LoRARequest:
        """vLLM's runtime load: listed first (the id is the directory's), checked by an engine
        core, unlisted again unless the core took it. A bad adapter is a 400 naming it."""
        listed, created = await self.directory.register_adapter.remote(name, path)
        if listed is None:
            raise errors.bad_request(f"The lora adapter '{name}' has already been loaded from "
                                     "another path: unload it first.", "lora_name")
        lora = LoRARequest(*listed)
        loaded = False
        try:
            error = await engines.load_adapter(lora)
            if error is not None:
                raise errors.bad_request(error, "lora_path")
            loaded = True
        finally:
            if created and not loaded:
                await self.directory.remove_adapter.remote(name)
                self.served.pop(name, None)
        self.served[name] = lora  # here at once; the other ingresses as they hear
        return lora

    async def unload(self, engines: EngineClient, name: str) -> LoRARequest:
        """vLLM's runtime unload: new requests for it get 404; those in flight finish."""
        if name in self.static:
            raise errors.bad_request(f"The lora adapter '{name}' is served from the start "
                                     "(lora_modules): it cannot be unloaded at run time.",
                                     "lora_name")
        listed = await self.directory.remove_adapter.remote(name)
        lora = self.served.pop(name, None) or (LoRARequest(*listed) if listed else None)
        if lora is None:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404,
                              param="lora_name", code="model_not_found")
        engines.unload_adapter(lora)
        return lora
