"""Request bodies of the OpenAI-compatible endpoints, validated with pydantic.

Fields we do not implement are either accepted at their neutral value (so stock clients that
always send them keep working) or refused with a message that says what is supported.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jfire.sampling import MAX_CACHE_SALT_CHARS
from jfire.stop_strings import MAX_STOP_BYTES, MAX_STOP_CHARS, MAX_STOPS, stop_limit_error

NonNegFloat = Annotated[float, Field(ge=0)]
# Numbers must be JSON numbers: "0.5" and true are refused, not coerced.
Number = StrictFloat
# The largest value the device programs hold in an int32 (top_k travels as one).
INT32_MAX = 2**31 - 1
# Fields of OpenAI's API this server does not implement: refused by name when given, by the
# schema (`functions` / `function_call` are the deprecated forms of `tools` / `tool_choice`).
UNSUPPORTED_FIELDS = ("functions", "function_call", "logit_bias")
MAX_CHOICES = 16  # n
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's limit)
DATA_URL_EXAMPLE = "data:image/png;base64,..."


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


class JSONSchemaFormat(StrictObject):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    schema_: dict | StrictBool = Field(default=True, alias="schema")
    strict: StrictBool = False


class ResponseFormat(StrictObject):
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema: required with type "json_schema" and only allowed with it')
        return self


class FunctionDefinition(StrictObject):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool = False


class Tool(StrictObject):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictObject):
    name: StrictStr


class NamedToolChoice(StrictObject):
    type: Literal["function"]
    function: NamedFunction


class SamplingFields(StrictObject):
    """What completions and chat completions share."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0, le=2)
    top_p: Number = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(
        default=0, ge=0, le=INT32_MAX, description="jfire extension: keep the k most likely tokens (0 = off)"
    )
    ignore_eos: StrictBool = Field(default=False, description="jfire extension: keep generating past EOS")
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES, description=f"choices to generate, 1 to {MAX_CHOICES}")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = Field(
        default=None,
        description=(
            f"a string or a list of up to {MAX_STOPS} strings, each of at most {MAX_STOP_CHARS} characters "
            f"and {MAX_STOP_BYTES} bytes in all"
        ),
    )
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**32)
    presence_penalty: Number = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: Number = Field(
        default=1.0,
        gt=0,
        le=10,
        description=("jfire extension: divides the logits of tokens already in the prompt or output (1 = off)"),
    )
    min_tokens: StrictInt = Field(default=0, ge=0, description="jfire extension: no EOS before this many tokens")
    stop_token_ids: list[StrictInt] | None = Field(
        default=None, max_length=64, description="jfire extension: token ids that end the output"
    )
    response_format: ResponseFormat | None = None
    return_token_ids: StrictBool = Field(
        default=False,
        description="extension (as vLLM's): each choice's token_ids and the response's prompt_token_ids",
    )
    user: StrictStr | None = None
    cache_salt: StrictStr | None = Field(
        default=None,
        description=(
            "extension (as vLLM's): prompts reuse cached prefixes only of prompts with the same salt, "
            f"1 to {MAX_CACHE_SALT_CHARS} characters"
        ),
    )
    # Accepted by the schema only to be refused by name (see UNSUPPORTED_FIELDS).
    functions: object = None
    function_call: object = None
    logit_bias: object = None

    @field_validator(*UNSUPPORTED_FIELDS)
    @classmethod
    def _unsupported(cls, value):
        # Runs only for a field that was given (null is absent, and defaults are not validated).
        raise ValueError("not supported by this server; omit the field")

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
        too_much = stop_limit_error(stops)
        if too_much is not None:
            raise ValueError(too_much)
        if any(s == "" for s in stops):
            raise ValueError("an empty string cannot stop anything")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, value):
        if not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
            raise ValueError(f"a salt is 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(value)}")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]] = Field(
        description="one prompt: a string or a list of token ids (a one-element list of either is accepted)"
    )
    max_tokens: StrictInt = Field(default=16, ge=1)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)


class TextPart(StrictObject):
    type: Literal["text"]
    text: StrictStr


class ImageURL(StrictObject):
    url: StrictStr = Field(description="a data: URL (data:image/png;base64,...) or an http(s) URL")
    # Accepted for OpenAI's clients; each model's own image processor decides the resolution
    # (Llama 4's tiles, Kimi K2.5's patch budget), so it changes nothing here.
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(StrictObject):
    """OpenAI's image content part: {"type": "image_url", "image_url": {"url", "detail"}}."""

    type: Literal["image_url"]
    image_url: ImageURL


class OtherImagePart(BaseModel):
    """Image parts in other APIs' shapes, accepted by the schema only to be refused with the
    shape this endpoint takes (a client mixing up OpenAI's APIs learns what to send)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["input_image", "image"]

    @model_validator(mode="after")
    def _refused(self):
        what = {
            "input_image": 'the Responses API\'s "input_image" parts are not taken by chat completions',
            "image": '"image" parts (the form chat templates read) are not taken by the API',
        }[self.type]
        raise ValueError(f'{what}; send {{"type": "image_url", "image_url": {{"url": "{DATA_URL_EXAMPLE}"}}}}')


# The part's "type" picks its model, so a bad part is reported against its own shape only.
ContentPart = Annotated[TextPart | ImagePart | OtherImagePart, Field(discriminator="type")]


class FunctionCall(StrictObject):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCallMessage(StrictObject):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictObject):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required, as OpenAI has it, unless an assistant message carries tool calls.
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _combinations(self):
        if self.images() and self.role != "user":  # as OpenAI: only users send images
            raise ValueError(f"content: image parts go in user messages only (this message's role is {self.role!r})")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry them")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only tool messages carry one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[tuple[int, ImagePart]]:
        """(index in content, part) of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(j, part) for j, part in enumerate(self.content) if isinstance(part, ImagePart)]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(
        min_length=1,
        description=(
            'a list of {"role", "content", "name"} messages; content is a string or a list of '
            '{"type": "text", "text"} parts and, in user messages to a model that takes images, '
            '{"type": "image_url", "image_url": {"url"}} parts'
        ),
    )
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS, description=f"0 to {MAX_TOP_LOGPROBS}, with logprobs: true"
    )
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description=('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}, with tools'),
    )
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _combinations(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools share a name")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice: names {choice.function.name!r}, which is not among the tools ({', '.join(names)})"
            )
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format: cannot be combined with a tool_choice that forces a call")
        # Under "auto" these constrain the calls with a grammar of their own (serve/chat.py).
        constrained = choice != "none" and (
            not self.parallel_tool_calls or any(t.function.strict for t in self.tools or [])
        )
        if constrained and self.tools and self.response_format is not None and self.response_format.type != "text":
            raise ValueError(
                "response_format: cannot be combined with strict tools or parallel_tool_calls: false, "
                "which constrain the output to their own calls"
            )
        return self
