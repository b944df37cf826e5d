"""The model runner's persistent input batch (vLLM's InputBatch idea, kept small).

Host buffers are allocated once, sized by max_num_seqs, max_num_batched_tokens and the blocks one
sequence can hold. A sequence owns a row of the block-table buffer while it is in the batch: the
row is written when it joins, after that only its new blocks are appended, and the row is reused
once the sequence is released or preempted. Each step the Python loop touches every scheduled
sequence once (row, start, length, new token ids); positions, the slot mapping, query starts,
sequence lengths and the batch's block tables are whole-array numpy ops.

On CUDA the host buffers are pinned and copied into preallocated device buffers without blocking.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.replicas.core.scheduler import ScheduledSeq
from pagedserve.replicas.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs: views of the batch's buffers, valid until the next prepare()."""
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64: hidden-state rows that sample, each sequence's in turn
    sampling_seqs: list[Sequence]  # scheduled sequences that sample this step, in schedule order
    query_start_loc: np.ndarray  # [batch + 1] host copy, for slicing one sequence's rows
    # Aligned with sampling_seqs where any has drafts to verify (each then has 1 + its drafts'
    # rows in logits_indices), else None (one row each).
    spec_token_ids: list[list[int]] | None = None


class _Buffer:
    """A host tensor with its numpy view and, on CUDA, the device tensor it is copied into."""
    __slots__ = ("host", "array", "device")

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=on_cuda)  # pinned: the copy is async
        self.array = self.host.numpy()
        self.device = torch.empty(size, dtype=dtype, device=device) if on_cuda else None

    def to_device(self, n: int) -> torch.Tensor:
        if self.device is None:  # CPU: the model reads the host buffer (from_numpy: the cheap view)
            return torch.from_numpy(self.array[:n])
        return self.device[:n].copy_(self.host[:n], non_blocking=True)


class InputBatch:
    """prepare(scheduled) -> StepInputs each step; release(seq_id) when a sequence leaves."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device):
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        # Per row: blocks written, the seq.block_table list they were copied from, its sequence.
        self.row_num_blocks = [0] * max_num_seqs
        self._tables: list[list[int] | None] = [None] * max_num_seqs
        self._seqs: list[Sequence | None] = [None] * max_num_seqs
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out row 0 first
        self.input_ids = _Buffer(max_num_batched_tokens, torch.int64, device)
        self.positions = _Buffer(max_num_batched_tokens, torch.int64, device)
        self.slot_mapping = _Buffer(max_num_batched_tokens, torch.int64, device)
        self.query_start_loc = _Buffer(max_num_seqs + 1, torch.int32, device)
        self.seq_lens = _Buffer(max_num_seqs, torch.int32, device)
        self.block_tables = _Buffer(max_num_seqs * max_blocks_per_seq, torch.int32, device)
        self.logits_indices = _Buffer(max(max_num_seqs, max_num_batched_tokens), torch.int64, device)
        self._arange = np.arange(max_num_batched_tokens)
        # The last step's copies still read the pinned buffers until this event has passed.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def release(self, seq_id: int) -> None:
        """Free a finished, aborted or preempted sequence's row (a no-op for unknown ids)."""
        row = self.row_of.pop(seq_id, None)
        if row is None:
            return
        self.block_table[row, :self.row_num_blocks[row]] = 0  # the padding of a batch's tables is 0
        self.row_num_blocks[row] = 0
        self._tables[row] = None
        self._seqs[row] = None
        self._free_rows.append(row)

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        if self._copied is not None:
            self._copied.synchronize()
        starts = [item.start for item in scheduled]
        query_lens = [item.num_new_tokens for item in scheduled]
        rows, token_ids, sampling_seqs, sampling_items, drafts = [], [], [], [], []
        num_drafts = 0
        width = 1
        for i, item in enumerate(scheduled):
            seq = item.seq
            row = self.row_of.get(seq.seq_id)
            if row is None:
                row = self._add(seq)
            table = seq.block_table
            if table is not self._tables[row] or len(table) != self.row_num_blocks[row]:
                self._write_blocks(row, table)
            if len(table) > width:
                width = len(table)
            rows.append(row)
            spec = item.spec_token_ids
            if spec:
                token_ids += seq.token_ids[item.start:]
                token_ids += spec
                num_drafts += len(spec)
            else:
                token_ids += seq.token_ids[item.start:item.start + item.num_new_tokens]
            if item.samples:
                sampling_seqs.append(seq)
                sampling_items.append(i)
                drafts.append(spec)

        num_seqs, bs = len(rows), self.block_size
        rows_np, starts_np = np.array(rows, dtype=np.int64), np.array(starts, dtype=np.int64)
        lens_np = np.array(query_lens, dtype=np.int64)
        query_start_loc = self.query_start_loc.array[:num_seqs + 1]
        query_start_loc[0] = 0
        lens_np.cumsum(out=query_start_loc[1:])
        num_tokens = int(query_start_loc[num_seqs])
        if num_tokens > len(self._arange):
            raise ValueError(f"{num_tokens} tokens in one step: past max_num_batched_tokens")
        seq_lens = self.seq_lens.array[:num_seqs]
        np.add(starts_np, lens_np, out=seq_lens)

        # Token t of sequence i sits at position starts[i] + t - query_start_loc[i]; its slot is
        # its block's id (gathered from the rows) * block_size + its offset in the block.
        positions = self.positions.array[:num_tokens]
        np.add((starts_np - query_start_loc[:num_seqs]).repeat(lens_np), self._arange[:num_tokens],
               out=positions)
        slots = self.slot_mapping.array[:num_tokens]
        np.multiply(self.block_table[rows_np.repeat(lens_np), positions // bs], bs, out=slots,
                    dtype=np.int64)
        slots += positions % bs
        self.input_ids.array[:num_tokens] = token_ids
        tables = self.block_tables.array[:num_seqs * width].reshape(num_seqs, width)
        self.block_table[:, :width].take(rows_np, axis=0, out=tables)
        num_logits = len(sampling_items) + num_drafts
        logits_indices = self.logits_indices.array[:num_logits]
        if num_drafts:  # a sequence's last token and its drafts: the last 1 + k rows of its run
            logits_indices[:] = [index for i, spec in zip(sampling_items, drafts)
                                 for index in range(query_start_loc[i + 1] - 1 - len(spec),
                                                    query_start_loc[i + 1])]
        else:
            np.subtract(query_start_loc[np.array(sampling_items, dtype=np.int64) + 1], 1,
                        out=logits_indices)

        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping.to_device(num_tokens),
            query_start_loc=self.query_start_loc.to_device(num_seqs + 1),
            seq_lens=self.seq_lens.to_device(num_seqs),
            block_tables=self.block_tables.to_device(num_seqs * width).view(num_seqs, width),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens.tolist(),
            query_start_loc_cpu=query_start_loc.tolist(),
        )
        step = StepInputs(self.input_ids.to_device(num_tokens), self.positions.to_device(num_tokens),
                          metadata, self.logits_indices.to_device(num_logits),
                          sampling_seqs, query_start_loc, drafts if num_drafts else None)
        if self._copied is not None:
            self._copied.record()
        return step

    def _add(self, seq: Sequence) -> int:
        if not self._free_rows:
            self._reclaim()
        row = self._free_rows.pop()
        self.row_of[seq.seq_id] = row
        self._seqs[row] = seq
        return row

    def _reclaim(self) -> None:
        """Free the rows of sequences that left the running set without release(): the normal
        path is release(), this keeps one missed call from failing every later step."""
        for seq in list(filter(None, self._seqs)):
            if seq.status is not SequenceStatus.RUNNING:
                self.release(seq.seq_id)
        if not self._free_rows:
            raise RuntimeError("more running sequences than the input batch has rows (max_num_seqs)")

    def _write_blocks(self, row: int, table: list[int]) -> None:
        """Append the blocks the sequence gained; rewrite the row when its table was replaced
        (BlockManager.free() gives a preempted sequence a new, empty list)."""
        if len(table) > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {len(table)} blocks is past the input batch's "
                             f"{self.max_blocks_per_seq} per sequence")
        written = self.row_num_blocks[row]
        if table is not self._tables[row] or len(table) < written:
            self.block_table[row, :written] = 0
            written = 0
            self._tables[row] = table
        self.block_table[row, written:len(table)] = table[written:]
        self.row_num_blocks[row] = len(table)
