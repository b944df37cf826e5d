"""The embedded default model end to end through the offline API."""
import pytest

from pagedserve import LLM, SamplingParams


@pytest.mark.slow
@pytest.mark.parametrize("default_model_format", ["gguf", "float32"])
def test_default_model_knows_the_capital_of_france(default_model_format):
    # As shipped (Q4_1 on the quantized kernels) and converted to float32.
    llm = LLM(num_threads=1, default_model_format=default_model_format)
    assert llm.llm_engine.model_dir.endswith(".gguf") == (default_model_format == "gguf")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert llm.llm_engine.model_name == "SmolLM2-135M-Instruct"
