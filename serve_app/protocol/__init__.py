"""The wire protocol: OpenAI request/response objects, field for field, plus vLLM's extras.

Requests reject unknown fields (as OpenAI does) but accept every extra that vLLM accepts and load
generators send (`ignore_eos`, `repetition_penalty`, `top_k`, `min_p`, `min_tokens`,
`stream_options.continuous_usage_stats`, ...). The same models serve HTTP and Ray handles. One
module per endpoint family; everything is importable from here.
"""
from pagedserve.serve_app.protocol.chat import (AssistantMessage, ChatChoice, ChatCompletionRequest,
                                     ChatCompletionResponse, ChatCompletionStreamResponse,
                                     ChatFinishReason, ChatMessage, ChatStreamChoice,
                                     ChoiceLogprobs, DeltaFunctionCall, DeltaMessage,
                                     DeltaToolCall, FunctionCall, TextPart, TokenLogprob, ToolCall,
                                     TopLogprob)
from pagedserve.serve_app.protocol.common import (
    CompletionTokensDetails, PromptTokensDetails, SamplingFields, StreamOptions, Usage, random_id, response_format_params,
)
from pagedserve.serve_app.protocol.completions import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
    CompletionStreamResponse, Prompt,
)
from pagedserve.serve_app.protocol.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedserve.serve_app.protocol.tokenize import (
    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeChatRequest,
    TokenizeCompletionRequest, TokenizeRequest, TokenizeResponse,
)

__all__ = [
    "LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest",
    "AssistantMessage", "ChatChoice", "ChatCompletionRequest", "ChatCompletionResponse",
    "ChatCompletionStreamResponse", "ChatFinishReason", "ChatMessage", "ChatStreamChoice",
    "ChoiceLogprobs", "CompletionChoice", "CompletionLogprobs", "CompletionRequest",
    "CompletionResponse", "CompletionStreamResponse", "CompletionTokensDetails", "DeltaFunctionCall", "DeltaMessage",
    "DeltaToolCall", "DetokenizeRequest", "DetokenizeResponse", "FunctionCall", "ModelCard",
    "ModelList", "Prompt", "PromptTokensDetails", "SamplingFields", "StreamOptions", "TextPart",
    "TokenLogprob", "TokenizeChatRequest", "TokenizeCompletionRequest", "TokenizeRequest",
    "TokenizeResponse", "ToolCall", "TopLogprob", "Usage", "random_id", "response_format_params",
]
