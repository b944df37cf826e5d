"""Mixtral: the Llama decoder with a sparse mixture-of-experts MLP.

Routing as transformers does it: softmax over the router logits in float32, the top k experts
per token, their weights renormalised to sum to 1. The (token, expert) pairs are sorted by expert,
so every expert's tokens are one block of rows; on the native CPU GEMM all experts' blocks go
through one grouped GEMM per projection (kernels/native_linear.grouped_linear: one call per layer,
the threads split experts' panels), elsewhere each expert runs one GEMM pair over its block (a loop
over experts, never over tokens). The weighted outputs are scattered back with one index_add.

Under tensor parallelism (as vLLM): every rank holds every expert's share of the intermediate
rows (w1/w3 column-parallel, w2 row-parallel, as Llama's gate/up and down), the router whole, and
the block's partial sums are all-reduced once, after the experts' outputs are combined.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import cpu_linear, native_linear
from pagedserve.replicas.models.causal_lm import split_rows
from pagedserve.replicas.models.layers import Linear
from pagedserve.replicas.models.llama import LlamaForCausalLM
from pagedserve.replicas.models.mlp import GatedMLP
from pagedserve.replicas.parallel import state as parallel_state


class SparseMoE(nn.Module):
    takes_lora = False  # the experts see the step's rows regrouped by expert (replicas/lora/targets.py)

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, act: str,
                 dtype: torch.dtype, device):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.tp = parallel_state.current()
        self.gate = Linear(hidden_size, num_experts, False, dtype, device)
        # Each expert holds this rank's share, built unsharded so that it runs no all-reduce of its own.
        share = intermediate_size // self.tp.world_size
        with parallel_state.building(parallel_state.SINGLE):
            self.experts = nn.ModuleList(GatedMLP(hidden_size, share, act, dtype, device)
                                         for _ in range(num_experts))
        self.grouped: tuple[torch.Tensor, torch.Tensor] | None = None  # (gate_up, down) stacks

    def combine_packed(self) -> None:
        """Once every expert's projections are packed: on the native fp32 GEMM, stack them into
        one weight per projection for the grouped GEMM; each expert keeps a view of its part."""
        projections = [(e.gate_up_proj, e.down_proj) for e in self.experts]
        if not all(p.packed is not None and p.packed.kind == "native" for pair in projections for p in pair):
            return
        stacks = []
        for which in range(2):
            stack = torch.stack([pair[which].packed.tensor for pair in projections])
            for pair, part in zip(projections, stack):
                pair[which].packed = cpu_linear.PackedWeight("native", part, pair[which].packed.out_features)
            stacks.append(stack)
        self.grouped = (stacks[0], stacks[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k] each
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts)
        tokens = order // self.top_k
        grouped = x.index_select(0, tokens)
        if self.grouped is not None:
            offsets = torch.zeros(self.num_experts + 1, dtype=torch.int64)
            torch.cumsum(counts, 0, out=offsets[1:])
            first = self.experts[0]
            hidden = native_linear.grouped_linear(grouped, self.grouped[0], offsets, 2 * first.intermediate_size)
            out = native_linear.grouped_linear(first.act_and_mul(hidden), self.grouped[1], offsets, x.shape[-1])
        else:
            outputs, start = [], 0
            for expert, count in zip(self.experts, counts.tolist()):  # one host sync
                if count:
                    outputs.append(expert(grouped[start:start + count]))
                    start += count
            out = torch.cat(outputs)
        weighted = out * weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, tokens, weighted.to(x.dtype))
        return out if self.tp.world_size == 1 else self.tp.all_reduce(out)


class MixtralForCausalLM(LlamaForCausalLM):
    # Our expert projection -> Mixtral's expert weights (w1 gate, w3 up, w2 down); Llama's
    # checkpoint_shard splits them as gate/up and down, and leaves the router whole.
    EXPERT = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
    # Quantized experts run one GEMM pair each (the grouped GEMM is for dense fp32 stacks).
    supports_quantized_tensor_parallel = True

    def build_mlp(self, config, layer: int) -> nn.Module:
        return SparseMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                         config.num_experts_per_tok, config.hidden_act, self.dtype, self.device)

    def checkpoint_sources(self, name: str) -> list[tuple[str, slice | None]]:
        if ".mlp." not in name:
            return super().checkpoint_sources(name)
        name = name.replace(".mlp.", ".block_sparse_moe.")
        parts = name.split(".")
        if parts[-2] not in self.EXPERT:
            return [(name, None)]  # the router
        prefix = ".".join(parts[:-2])
        names = [f"{prefix}.{hf}.{parts[-1]}" for hf in self.EXPERT[parts[-2]]]
        if len(names) == 1:
            return [(names[0], None)]
        return split_rows([self.config.intermediate_size // self.tp.world_size] * 2, names)
