"""Request bodies of the OpenAI-compatible endpoints, validated with pydantic.

Fields we do not implement are either accepted at their neutral value (so stock clients that
always send them keep working) or refused with a message that says what is supported.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

NonNegFloat = Annotated[float, Field(ge=0)]
# Numbers must be JSON numbers: "0.5" and true are refused, not coerced.
Number = StrictFloat
# The largest value the device programs hold in an int32 (top_k travels as one).
INT32_MAX = 2**31 - 1
# Fields of OpenAI's API this server does not implement yet: refused by name when given.
UNSUPPORTED_FIELDS = ("response_format", "tools", "tool_choice", "functions", "function_call",
                      "parallel_tool_calls", "logit_bias", "top_logprobs")


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    # Unknown fields are refused by name (a client must learn the server ignored nothing); one
    # sent as null is taken as absent, as stock clients send unset options that way.
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0, le=2)
    top_p: Number = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=0, le=INT32_MAX,
                             description="jfire extension: keep the k most likely tokens (0 = off)")
    ignore_eos: StrictBool = Field(default=False, description="jfire extension: keep generating past EOS")
    n: StrictInt = Field(default=1, ge=1, le=1, description="only n=1 is supported")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = Field(default=None, description="a string or a list of up to 4 strings")
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**32)
    presence_penalty: Number = Field(default=0.0, description="not supported: must be 0")
    frequency_penalty: Number = Field(default=0.0, description="not supported: must be 0")
    user: StrictStr | None = None
    # Accepted by the schema only to be refused by name (see UNSUPPORTED_FIELDS).
    response_format: object = None
    tools: object = None
    tool_choice: object = None
    functions: object = None
    function_call: object = None
    parallel_tool_calls: object = None
    logit_bias: object = None
    top_logprobs: object = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data

    @model_validator(mode="after")
    def _check_stop(self):
        stops = self.stop_list()
        if len(stops) > 4:
            raise ValueError("stop takes at most 4 strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]] = Field(
        description="one prompt: a string or a list of token ids (a one-element list of either is accepted)")
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    suffix: None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ImagePart(BaseModel):
    """Accepted by the schema only to be refused with a clear message: jfire serves text."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url", "input_image", "image"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[Union[TextPart, ImagePart]] | None = None
    name: StrictStr | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content):
            raise ValueError("image content parts are not supported: jfire serves the text model only "
                             "(a multimodal checkpoint's vision tower is not loaded); send text parts")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = Field(default=False, description="not supported for chat: must be false")
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _no_chat_logprobs(self):
        if self.logprobs:
            raise ValueError("logprobs are supported on /v1/completions only")
        return self
