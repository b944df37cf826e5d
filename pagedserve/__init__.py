"""pagedserve: an OpenAI-compatible LLM server on Ray Serve, and vLLM's offline API.

    from pagedserve import LLM, SamplingParams

The repository's top-level folders are this package's parts: `serve_app/` is
`pagedserve.serve_app` (the Ray Serve application), `replicas/` is `pagedserve.replicas` (one
engine replica), `kernels/` is `pagedserve.kernels`. Installed, they sit inside this package, so
pagedserve adds no top-level import name but its own (Hugging Face's `kernels` stays `kernels`).
"""
import os as _os

_here = _os.path.dirname(__file__)
if not _os.path.isdir(_os.path.join(_here, "replicas")):
    # A checkout (editable or not): the parts are the folders beside this one.
    __path__.append(_os.path.dirname(_here))  # noqa: F821 - the package's own __path__

_EXPORTS = {
    "LLM": "pagedserve.replicas.llm",
    "EngineConfig": "pagedserve.replicas.config",
    "SamplingParams": "pagedserve.replicas.core.sampling_params",
    "LoRARequest": "pagedserve.replicas.core.lora_request",
    "RequestOutput": "pagedserve.replicas.core.outputs",
    "CompletionOutput": "pagedserve.replicas.core.outputs",
    "Logprob": "pagedserve.replicas.core.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name):  # on first use: the command line and the ingress never import torch
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
