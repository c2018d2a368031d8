"""Request bodies of the OpenAI-compatible endpoints, validated with pydantic.

Fields we do not implement are either accepted at their neutral value (so stock clients that
always send them keep working) or refused with a message that says what is supported.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationInfo,
                      field_validator, model_validator)

NonNegFloat = Annotated[float, Field(ge=0)]
# Numbers must be JSON numbers: "0.5" and true are refused, not coerced.
Number = StrictFloat
# The largest value the device programs hold in an int32 (top_k travels as one).
INT32_MAX = 2**31 - 1
# Fields of OpenAI's API this server does not implement yet: refused by name when given.
UNSUPPORTED_FIELDS = ("response_format", "tools", "tool_choice", "functions", "function_call",
                      "parallel_tool_calls", "logit_bias", "top_logprobs")


class StrictObject(BaseModel):
    """Unknown fields are refused by name, at any depth (a client must learn the server ignored
    nothing). A field sent as null is absent: OpenAI's optional fields are nullable, meaning
    their default, and stock clients send unset options that way."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(StrictObject):
    include_usage: StrictBool = False


class SamplingFields(StrictObject):
    """What completions and chat completions share."""

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

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value, info: ValidationInfo):
        if not info.data.get("stream"):  # as OpenAI: it would be silently meaningless
            raise ValueError('only allowed with "stream": true')
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4:
            raise ValueError(f"at most 4 strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("an empty string cannot stop anything")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]] = Field(
        description="one prompt: a string or a list of token ids (a one-element list of either is accepted)")
    max_tokens: StrictInt = Field(default=16, ge=1)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    suffix: None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)


class TextPart(StrictObject):
    type: Literal["text"]
    text: StrictStr


class ImagePart(BaseModel):
    """Accepted by the schema only to be refused with a clear message: jfire serves text."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url", "input_image", "image"]


class ChatMessage(StrictObject):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required, as OpenAI has it unless the message carries tool calls, which this server does not take.
    content: StrictStr | list[Union[TextPart, ImagePart]]
    name: StrictStr | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content):
            raise ValueError("image content parts are not supported: jfire serves the text model only "
                             "(a multimodal checkpoint's vision tower is not loaded); send text parts")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description=(
        'a list of {"role", "content", "name"} messages; content is a string or a list of '
        '{"type": "text", "text"} parts'))
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = Field(default=False, description="not supported yet: must be false")
    add_generation_prompt: StrictBool = True
