"""A BERT encoder (bidirectional attention, no KV cache) for embedding models.

Padding-free: the tokens of every sequence in a batch are packed into one [T] row, so the
projections and the MLP run as one GEMM each over exactly the batch's tokens (q/k/v fused, on the
packed CPU weights). Only attention sees sequence boundaries: each sequence attends over its own
tokens (see `encoder_attention`).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pagedserve.kernels import cpu_features
from pagedserve.replicas.models.layers import Embedding, LayerNorm, Linear, activation

# Tensors of BERT checkpoints that an encoder does not use (the MLM / NSP heads, the [CLS] pooler
# of BertModel, a saved position-ids buffer).
_UNUSED_PREFIXES = ("cls.", "pooler.")
_UNUSED_NAMES = ("embeddings.position_ids",)


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_starts: list[int],
                      scale: float) -> torch.Tensor:
    """q, k, v [T, heads, head_dim] of packed sequences -> [T, heads * head_dim].

    Per sequence, over its own rows (no mask, no padding): scores by one batched GEMM over the
    heads, softmax, then a GEMM with v. At encoder lengths this beats one SDPA call per sequence
    (its flash kernel's blocking does not pay there), which in turn beats one padded SDPA call with
    a key mask and, by far, one call with a block-diagonal mask over the batch.
    """
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))  # [heads, T, head_dim] views
    unused = q.new_empty(1, 1, 1)  # baddbmm's input, ignored with beta=0
    for start, end in zip(seq_starts[:-1], seq_starts[1:]):
        scores = torch.baddbmm(unused, qt[:, start:end], kt[:, start:end].transpose(1, 2),
                               beta=0.0, alpha=scale)
        weights = scores.softmax(-1, dtype=torch.float32).to(v.dtype)  # a no-op in fp32
        out[start:end].transpose(0, 1).copy_(torch.bmm(weights, vt[:, start:end]))
    return out.view(num_tokens, num_heads * head_dim)


class BertLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype, device):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim ** -0.5
        eps = config.layer_norm_eps
        self.qkv_proj = Linear(hidden, 3 * hidden, True, dtype, device)
        self.attention_output = Linear(hidden, hidden, True, dtype, device)
        self.attention_norm = LayerNorm(hidden, eps, dtype, device)
        self.intermediate = Linear(hidden, config.intermediate_size, True, dtype, device)
        self.output = Linear(config.intermediate_size, hidden, True, dtype, device)
        self.output_norm = LayerNorm(hidden, eps, dtype, device)
        self.act = activation(getattr(config, "hidden_act", "gelu"))

    def forward(self, hidden: torch.Tensor, seq_starts: list[int]) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        attention = encoder_attention(q, k, v, seq_starts, self.scale)
        hidden = self.attention_norm(self.attention_output(attention) + hidden)
        mlp = self.output(self.act(self.intermediate(hidden)))
        return self.output_norm(mlp + hidden)


class BertModel(nn.Module):
    """The encoder the embedding runner drives.

    model(input_ids [T], positions [T], seq_starts) -> last hidden states [T, hidden] for the
    packed sequences, where sequence i holds rows seq_starts[i]:seq_starts[i + 1] and positions
    restart at 0 in each.
    """

    def __init__(self, config, dtype: torch.dtype = torch.float32, attention_backend: str = "auto",
                 device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        self.config = config
        self.dtype = dtype
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.max_context_len = config.max_position_embeddings
        eps = config.layer_norm_eps
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size,
                                             dtype, device)
        self.token_type_embeddings = Embedding(config.type_vocab_size, config.hidden_size, dtype,
                                               device)
        self.embeddings_norm = LayerNorm(config.hidden_size, eps, dtype, device)
        self.layers = nn.ModuleList(BertLayer(config, dtype, device)
                                    for _ in range(config.num_hidden_layers))

    def pack_weights(self) -> None:
        """Packs the projections for the native GEMM, except fp32 ones on Intel CPUs, where torch's
        own GEMM (MKL) runs an encoder's whole batches of texts (thousands of rows) faster; on
        other CPUs MKL runs a generic kernel and the native GEMM is the faster
        (bench/embeddings.py times the whole embed)."""
        mkl_fp32 = cpu_features.cpu_vendor() == "GenuineIntel"
        for module in self.modules():
            if isinstance(module, Linear) and (not mkl_fp32 or module.weight.dtype != torch.float32
                                               or getattr(module, "quant", None) is not None):
                module.pack()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                seq_starts: list[int]) -> torch.Tensor:
        # Every token is segment 0, as sentence-transformers encodes a single text.
        hidden = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                  + self.token_type_embeddings.weight[0])
        hidden = self.embeddings_norm(hidden)
        for layer in self.layers:
            hidden = layer(hidden, seq_starts)
        return hidden

    # HF name (after the "bert." prefix) -> (our name, which third of the fused q/k/v rows)
    _RENAMES = {
        "embeddings.word_embeddings": "word_embeddings",
        "embeddings.position_embeddings": "position_embeddings",
        "embeddings.token_type_embeddings": "token_type_embeddings",
        "embeddings.LayerNorm": "embeddings_norm",
        "attention.output.dense": "attention_output",
        "attention.output.LayerNorm": "attention_norm",
        "intermediate.dense": "intermediate",
        "output.dense": "output",
        "output.LayerNorm": "output_norm",
    }
    _QKV = {"query": 0, "key": 1, "value": 2}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (BertModel names, or any BertFor* with its "bert." prefix);
        fails on missing or unknown names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("bert.")
            if name.startswith(_UNUSED_PREFIXES) or name in _UNUSED_NAMES:
                continue
            target_name, rows = self._target(name)
            if target_name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
            param = params[target_name].data
            target = param if rows is None else param[rows]
            if target.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(target_name if rows is None else f"{target_name}[{rows.start}]")
        expected = set()
        for name, param in params.items():
            if ".qkv_proj." in name:
                third = param.shape[0] // 3
                expected.update(f"{name}[{i * third}]" for i in range(3))
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")

    def _target(self, name: str) -> tuple[str, slice | None]:
        layer_prefix = "encoder.layer."
        if not name.startswith(layer_prefix):
            module, _, leaf = name.rpartition(".")
            return f"{self._RENAMES.get(module, module)}.{leaf}", None
        index, _, rest = name[len(layer_prefix):].partition(".")
        module, _, leaf = rest.rpartition(".")
        prefix = f"layers.{index}"
        if module.startswith("attention.self."):
            part = module.rpartition(".")[2]
            if part in self._QKV:
                size = self.hidden_size
                start = self._QKV[part] * size
                return f"{prefix}.qkv_proj.{leaf}", slice(start, start + size)
        return f"{prefix}.{self._RENAMES.get(module, module)}.{leaf}", None
