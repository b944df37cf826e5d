"""An engine core in a thread of the test, reached by the ingress's own client (`EngineClient`) over
its real connection: the serving path without Ray. A static directory lists the one core.

    async with running_core(EngineConfig(model=...)) as (core, client):
        outputs = await generate(client, "r1", [1, 2, 3], SamplingParams(max_tokens=4))
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pagedserve.replicas.engine import protocol
from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.engine.core_process import CoreProcess
from pagedserve.replicas.core.outputs import RequestOutput
from pagedserve.replicas.core.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.serve_app.engine_client import EngineClient
from pagedserve.serve_app.request_stream import RequestStream
from pagedserve.serve_app.routing.policy import RoutingSettings


class StaticDirectory:
    """The `CoreDirectory` handle's `watch.remote(version)`, listing fixed cores."""

    def __init__(self, entries: dict[str, list]):
        self.entries = entries
        self.watch = self

    async def remote(self, version: int):
        if version == 1:
            await asyncio.sleep(3600)  # nothing changes
        return 1, self.entries, {}


@contextlib.asynccontextmanager
async def running_core(config: EngineConfig, *, engine_class: str | None = None,
                       max_requests: int | None = None, probe_interval_s: float | None = None,
                       max_queued_requests: int = -1, in_process: bool = True
                       ) -> AsyncIterator[tuple[CoreProcess, EngineClient]]:
    start = protocol.Start(config.model_dump(), "127.0.0.1", max_requests, probe_interval_s,
                           engine_class)
    core = await asyncio.to_thread(CoreProcess, start, in_process)
    core.attach()
    client = EngineClient(StaticDirectory({"core": list(core.address)}), RoutingSettings(),
                          max_queued_requests, retry_after_s=1)
    client.no_core_wait_s = 1.0
    client.start()
    try:
        await asyncio.wait_for(client._connected.wait(), 10)
        yield core, client
    finally:
        client.shutdown()
        await asyncio.to_thread(core.shutdown)


def add_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                priority: int = 0) -> protocol.AddRequest:
    params = params or SamplingParams()
    if params.output_kind is RequestOutputKind.CUMULATIVE:  # the wire carries deltas
        params = params.clone(output_kind=RequestOutputKind.DELTA)
    return protocol.AddRequest(request_id, list(prompt_token_ids), params, priority)


async def started(client: EngineClient, request_id: str, prompt_token_ids: list[int],
                  params: SamplingParams | None = None, priority: int = 0) -> RequestStream:
    stream = client.stream(add_request(request_id, prompt_token_ids, params, priority))
    await stream.prime()
    return stream


async def generate(client: EngineClient, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams | None = None, priority: int = 0) -> RequestOutput:
    """The request's whole output: its deltas folded into one."""
    stream = await started(client, request_id, prompt_token_ids, params, priority)
    whole = None
    async for output in stream:
        if whole is None:
            whole = output
        else:
            whole.add(output)
    return whole
