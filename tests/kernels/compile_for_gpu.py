"""Compile every Triton launch the backend makes, for real GPU targets, without a GPU.

The interpreter checks the kernels' arithmetic but not that they compile: tl.dot shapes, dtypes
and layouts are only checked by the compiler. This script records the launches that
store_kv/paged_attention would make (pagedserve.kernels.triton_attention._launch is the one launch point),
and those of the quantized GEMM (pagedserve.kernels.triton_quant._launch), then runs Triton's compiler on
each for sm_90 (H100/H200), down to a cubin (about 2 s each).
Run it without TRITON_INTERPRET (test_triton_compile.py starts it in a subprocess).

    python tests/kernels/compile_for_gpu.py  ->  prints "compiled N kernels" (attention), then
                                                 "compiled M kernels of pagedserve.kernels.triton_quant"
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
assert os.environ.get("TRITON_INTERPRET") != "1", "compile with the real compiler, not the interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tests.kernels.kernel_cases import Case  # noqa: E402
from pagedserve.kernels import triton_attention, triton_quant  # noqa: E402
from pagedserve.kernels.quantized import QuantWeight, pack_values  # noqa: E402

TARGETS = [GPUTarget("cuda", 90, 32)]  # add GPUTarget("cuda", 80, 32) for A100s
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
         torch.int32: "i32", torch.int64: "i64"}
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def signature_of(kernel, args, meta):
    signature, constexprs = {}, {}
    for name, value in zip(kernel.arg_names, list(args) + [meta[n] for n in kernel.arg_names[len(args):]]):
        if name in meta:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
    return signature, constexprs


def record_launches():
    launches = []

    def record(kernel, grid, *args, **meta):
        launches.append((kernel, args, meta))

    triton_attention._launch = record
    # (dtype, head_dim, block_size): the default model in bf16; fp16 at the other head_dim and block
    # size; fp32 (IEEE dots); a padded head_dim with a block smaller than a tile.
    configs = [(torch.bfloat16, 64, 16), (torch.float16, 128, 32), (torch.float32, 64, 16),
               (torch.bfloat16, 80, 8)]
    for dtype, head_dim, block_size in configs:
        case = Case([(1, 40), (1, 2000), (37, 50)], num_heads=9, num_kv_heads=3, head_dim=head_dim,
                    block_size=block_size, dtype=dtype)
        triton_attention.store_kv(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
        for splits in (1, 4):
            triton_attention.paged_attention(case.query, case.kv_cache, case.metadata, case.scale,
                                             num_splits=splits)
    # The sliding-window and soft-cap variants (Mistral, Gemma 2), on the default model's shape.
    case = Case([(1, 40), (1, 2000), (37, 50)], num_heads=9, num_kv_heads=3, dtype=torch.bfloat16)
    for splits in (1, 4):
        triton_attention.paged_attention(case.query, case.kv_cache, case.metadata, case.scale,
                                         sliding_window=32, logits_soft_cap=50.0, num_splits=splits)
    return launches


def record_quant_launches():
    """The dequant-GEMM's variants: every M bucket, 4 and 8 bits, the k tiles groups of 32 and
    128 give, split-K decode, bias, per-channel groups, fp16 and fp32 activations."""
    launches = []

    def record(kernel, grid, *args, **meta):
        launches.append((kernel, args, meta))

    def weight(n, k, bits, group_size):
        values = torch.randint(0, 2**bits, (n, k))
        scales = torch.rand(n, k // group_size)
        return triton_quant.pack(QuantWeight(bits, group_size, pack_values(values, bits), scales, -scales),
                                 "cpu")

    triton_quant._launch = record
    # The default model's q|k|v (n 960, k 576) in its GGUF groups of 32, its down projection
    # (n 576, k 1536) in GPTQ-style groups of 128.
    qkv = {bits: weight(960, 576, bits, 32) for bits in (4, 8)}
    down = weight(576, 1536, 4, 128)
    bf16 = torch.bfloat16
    for rows in (1, 33, 300):
        triton_quant.linear(torch.randn(rows, 576, dtype=bf16), qkv[4])
        triton_quant.linear(torch.randn(rows, 1536, dtype=bf16), down)
    for rows in (1, 300):
        triton_quant.linear(torch.randn(rows, 576, dtype=bf16), qkv[8])
        triton_quant.linear(torch.randn(rows, 1536, dtype=torch.float16), down)
    triton_quant.linear(torch.randn(1, 1536, dtype=bf16), down, num_splits=4)
    triton_quant.linear(torch.randn(1, 576, dtype=bf16), qkv[4], torch.randn(960, dtype=bf16))
    triton_quant.linear(torch.randn(1, 1536), down)
    triton_quant.linear(torch.randn(1, 576, dtype=bf16), weight(960, 576, 8, 576))
    return launches


def compile_all(launches, verbose: bool) -> int:
    seen, compiled = set(), 0
    for kernel, args, meta in launches:
        options = {k: meta[k] for k in LAUNCH_OPTIONS if k in meta}
        constexpr_meta = {k: v for k, v in meta.items() if k not in LAUNCH_OPTIONS}
        signature, constexprs = signature_of(kernel, args, constexpr_meta)
        key = (kernel.fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items(), key=str)))
        if key in seen:
            continue
        seen.add(key)
        for target in TARGETS:
            began = time.perf_counter()
            src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
            binary = triton.compile(src, target=target, options=options)
            assert binary.asm.get("cubin"), (kernel.fn.__name__, target)
            compiled += 1
            if verbose:
                print(f"{kernel.fn.__name__} {constexprs} {time.perf_counter() - began:.1f}s", flush=True)
    return compiled


def main(verbose: bool = "-v" in sys.argv) -> None:
    print(f"compiled {compile_all(record_launches(), verbose)} kernels", flush=True)
    print(f"compiled {compile_all(record_quant_launches(), verbose)} kernels of pagedserve.kernels.triton_quant")


if __name__ == "__main__":
    main()
