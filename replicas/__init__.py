"""Everything that runs inside one engine replica, and the offline `LLM` API."""
from replicas.config import EngineConfig
from replicas.outputs import CompletionOutput, Logprob, RequestOutput
from replicas.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name):  # importing the package must not pull torch into the control plane
    if name == "LLM":
        from replicas.llm import LLM
        return LLM
    raise AttributeError(name)
