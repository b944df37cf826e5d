"""Compile every Triton launch the backend makes, for real GPU targets, without a GPU.

The interpreter checks the kernels' arithmetic but not that they compile: tl.dot shapes, dtypes
and layouts are only checked by the compiler. This script records the launches that
store_kv/paged_attention would make (kernels.triton_attention._launch is the one launch point),
then runs Triton's compiler on each for sm_90 (H100/H200), down to a cubin (about 2 s each).
Run it without TRITON_INTERPRET (test_triton_compile.py starts it in a subprocess).

    python tests/kernels/compile_for_gpu.py  ->  prints "compiled N kernels"
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
from kernels import triton_attention  # noqa: E402

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


def main(verbose: bool = "-v" in sys.argv) -> None:
    seen, compiled = set(), 0
    for kernel, args, meta in record_launches():
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
    print(f"compiled {compiled} kernels")


if __name__ == "__main__":
    main()
