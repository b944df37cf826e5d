"""LoRAManager: the engine's adapters. It loads them off the engine loop (a request whose
adapter is not in memory waits while it loads), keeps up to max_cpu_loras in memory (least
recently used dropped first, never one a live request holds), and before each step puts the
step's adapters in slots (least recently used slot replaced) and tells every projection each
row's slot.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pagedserve.replicas.core.lora_request import LoRARequest
from pagedserve.replicas.lora.adapter import LoRAAdapter, read_adapter
from pagedserve.replicas.lora.slots import LoRASlots, LoRAStep
from pagedserve.replicas.lora.targets import LoRATargets

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int,
                 max_cpu_loras: int | None, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.dtype = dtype
        self.targets = LoRATargets(model)
        self.step = LoRAStep()
        self.slots: dict[str, LoRASlots] = {}
        for name, parts in self.targets.parts.items():
            linear = model.get_submodule(name)
            linear.lora = self.slots[name] = LoRASlots(self.step, parts, linear.in_features,
                                                       max_loras, max_rank, dtype, device)
        for module in model.modules():  # models that run their projections' kernels together
            if hasattr(module, "attach_lora"):
                module.attach_lora(self.step)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # in memory, LRU first
        self.loading: dict[int, Future] = {}
        self.users: dict[int, int] = {}  # adapter id -> live requests holding it
        self.removed: set[int] = set()  # unloaded while held: dropped when the last holder ends
        self.slot_ids: list[int | None] = [None] * max_loras
        self.slot_used: list[int] = [0] * max_loras  # the step that last used it: LRU
        self.num_steps = 0
        self.num_loads = self.num_evictions = self.num_slot_loads = 0
        self.device = device
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        logger.info("LoRA: %d slots of rank %d on %d projections (%.2f GiB)", max_loras, max_rank,
                    len(self.slots), sum(s.num_bytes for s in self.slots.values()) / 2**30)

    # -- in memory ------------------------------------------------------------------------------
    def load(self, lora: LoRARequest) -> Future:
        """The adapter, read and checked off the engine loop; a Future of the LoRAAdapter (its
        exception: an AdapterError saying why it cannot serve). One read per adapter at a time:
        requests that arrive while it is read share it."""
        lora_id = lora.lora_int_id
        self.removed.discard(lora_id)  # asked for again
        adapter = self.adapters.get(lora_id)
        if adapter is not None and adapter.lora == lora:
            self.adapters.move_to_end(lora_id)
            done: Future = Future()
            done.set_result(adapter)
            return done
        future = self.loading.get(lora_id)
        if future is None or (future.done() and future.exception() is not None):
            future = self._executor.submit(read_adapter, lora, self.targets, self.max_rank, self.dtype)
            self.loading[lora_id] = future
        return future

    def admit(self, future: Future, hold: bool = False) -> LoRAAdapter:
        """A finished load (engine thread): the adapter joins those in memory, held by the
        caller's request if `hold` (before anything is evicted for it). Raises its error."""
        try:
            adapter = future.result()
        finally:
            self.discard(future)
        lora_id = adapter.lora.lora_int_id
        if self.adapters.get(lora_id) is not adapter:
            self.num_loads += 1
            self.adapters[lora_id] = adapter
            self._unload_slot(lora_id)  # an older copy under the same id
        self.adapters.move_to_end(lora_id)
        if hold:
            self.acquire(lora_id)
        self._evict(keep=lora_id)
        return adapter

    def discard(self, future: Future) -> None:
        """A load nobody waits for any more (its requests were aborted): no longer shared."""
        for lora_id, loading in list(self.loading.items()):
            if loading is future:
                del self.loading[lora_id]

    def acquire(self, lora_id: int) -> None:
        self.users[lora_id] = self.users.get(lora_id, 0) + 1

    def release(self, lora_id: int) -> None:
        left = self.users.get(lora_id, 0) - 1
        if left > 0:
            self.users[lora_id] = left
            return
        self.users.pop(lora_id, None)
        if lora_id in self.removed:
            self.remove(lora_id)
        self._evict()

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (it was unloaded): now, or once the requests holding it end."""
        if lora_id in self.users:
            self.removed.add(lora_id)
            return False
        self.removed.discard(lora_id)
        if self.adapters.pop(lora_id, None) is None:
            return False
        self._unload_slot(lora_id)
        return True

    def _evict(self, keep: int | None = None) -> None:
        for lora_id in list(self.adapters):
            if len(self.adapters) <= self.max_cpu_loras:
                return
            if lora_id not in self.users and lora_id != keep:
                del self.adapters[lora_id]
                self._unload_slot(lora_id)
                self.num_evictions += 1

    # -- in slots -------------------------------------------------------------------------------
    def prepare(self, lora_ids: list[int], num_tokens: list[int]) -> None:
        """Before a step: lora_ids[i] (0: the base model) for the step's i-th sequence, which runs
        num_tokens[i] rows. Puts every adapter of the step in a slot and sets the rows' slots."""
        self.num_steps += 1
        if not any(lora_ids):
            self.step.token_slots = None
            return
        slot_of: dict[int, int] = {}
        for lora_id in lora_ids:
            if lora_id and lora_id not in slot_of:
                slot_of[lora_id] = self._slot_for(lora_id, slot_of)
        slots = np.array([slot_of[i] if i else -1 for i in lora_ids], dtype=np.int32)
        token_slots = torch.from_numpy(slots.repeat(num_tokens))
        if self.device.type != "cpu":
            token_slots = token_slots.to(self.device, non_blocking=True)
        self.step.token_slots = token_slots

    def _slot_for(self, lora_id: int, taken: dict[int, int]) -> int:
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
        else:
            busy = set(taken.values())
            free = [s for s in range(self.max_loras) if s not in busy]
            if not free:
                raise RuntimeError(f"a step holds more than max_loras={self.max_loras} adapters")
            slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self.slot_used[s]))
            self._fill(slot, self.adapters[lora_id])
        self.slot_used[slot] = self.num_steps
        return slot

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        for name, slots in self.slots.items():
            slots.clear(slot)
            for part, (a, b_t) in adapter.weights.get(name, {}).items():
                slots.set(slot, part, a, b_t)
        self.slot_ids[slot] = adapter.lora.lora_int_id
        self.num_slot_loads += 1

    def _unload_slot(self, lora_id: int) -> None:
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
            for slots in self.slots.values():
                slots.clear(slot)
            self.slot_ids[slot] = None

    def stats(self) -> dict:
        resident = [a.lora for a in self.adapters.values() if a.lora.lora_int_id not in self.removed]
        return {"lora_resident": [lora.lora_name for lora in resident],
                "lora_resident_ids": [lora.lora_int_id for lora in resident],
                "lora_num_resident": len(self.adapters),
                "lora_loads": self.num_loads, "lora_evictions": self.num_evictions,
                "lora_slot_loads": self.num_slot_loads}

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
