"""`python -m llama_cpp.server`, run inside the llama.cpp virtual environment, with one change: it
accepts any `x-request-id` header.

The server's request-id middleware (starlette-context's RequestIdPlugin) answers 400 with an
empty body to a request id that is not a UUID, and `vllm bench serve` sends `bench-<hex>-<n>`
on every request. Only that check is skipped; the arguments are those of `llama_cpp.server`:

    <llama.cpp venv>/bin/python bench/peers/llamacpp_server.py --model X.gguf --n_threads N ...
"""
import runpy

from starlette_context.plugins.base import PluginUUIDBase

PluginUUIDBase.validate_uuid = lambda self, value: None

if __name__ == "__main__":
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
