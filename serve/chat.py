"""From an OpenAI request to what the engine runs: the chat prompt (tools and tool-call turns
rendered through the model's chat template, or through jfire's documented default tool
prompt when the template takes no tools), its images (fetched, decoded, preprocessed, and
their placeholder ids put into the prompt) and the grammar that constrains the output
(`response_format`, and `tool_choice` "required" or a named function). The grammar is only
described here (`OutputPlan.build_grammar`): building and compiling it is CPU work of up to
seconds that a server does once it has admitted the request, off its event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable

from jfire import grammar as grammars
from jfire import tool_calls
from jfire.errors import JfireError, RequestError
from jfire.request_checks import TextLimit
from jfire.vision.encoder import RequestImage
from jfire.vision.images import ImageLimits, LoadedImage, load_images
from jfire.vision.model import VisionModel
from serve.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ImagePart,
    NamedToolChoice,
    ResponseFormat,
    SamplingFields,
    TextPart,
)


@dataclasses.dataclass
class OutputPlan:
    """How a request's output is constrained and read back."""

    # Builds the llguidance grammar (a PromptError names the field it cannot be built from);
    # None for free text. Compiling it is the engine's request check.
    build_grammar: Callable[[], str] | None = None
    tool_format: tool_calls.ToolCallFormat | None = None  # parse tool calls out of the text
    keep_special_tokens: bool = False  # tool-call markers are special tokens in some formats


async def compiled_grammar(
    pool: concurrent.futures.Executor, plan: OutputPlan, check: Callable[[str], None]
) -> str | None:
    """The plan's grammar, or None: built, then compiled by `check` (the engine's request check,
    which keeps the compiled grammar for each choice's matcher, so submitting finds it compiled),
    in `pool`. The event loop serves everyone meanwhile."""
    build = plan.build_grammar
    if build is None:
        return None

    def build_and_compile() -> str:
        grammar = build()
        check(grammar)
        return grammar

    return await asyncio.get_running_loop().run_in_executor(pool, build_and_compile)


class PromptError(JfireError):
    """A request whose prompt or constraint cannot be built (the message names the field)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """The request's messages as the plain dicts chat templates read."""
    out = []
    for m in body.messages:
        message = {"role": m.role, "content": template_content(m)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def template_content(m: ChatMessage) -> str | list[dict] | None:
    """A message's content as chat templates take it: text as one string (what every template
    reads), and a message with images as HF's multimodal templates expect, its parts in order
    with each image as {"type": "image"}, where the template writes the image's token."""
    if m.content is None:
        return None
    if not isinstance(m.content, list) or not m.images():
        return m.text()
    out: list[dict] = []
    for part in m.content:
        if isinstance(part, ImagePart):
            out.append({"type": "image"})
        elif isinstance(part, TextPart):
            out.append({"type": "text", "text": part.text})
    return out


# -- images --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One image part of a chat request, and the name of the part as the client sent it."""

    url: str
    part: str  # e.g. "messages.1.content.0", as the server names every field

    @property
    def param(self) -> str:
        """The field errors about the image itself (its bytes, its URL) name."""
        return f"{self.part}.image_url.url"


def image_refs(body: ChatCompletionRequest) -> list[ImageRef]:
    """The request's image parts in prompt order (the order the template writes them)."""
    return [
        ImageRef(part.image_url.url, f"messages.{i}.content.{j}")
        for i, m in enumerate(body.messages)
        for j, part in m.images()
    ]


def require_vision(engine, refs: list[ImageRef]) -> VisionModel:
    """The engine's vision model, or a RequestError naming the first image part."""
    if engine.vision is None:
        raise RequestError(
            "image content parts are not supported by this model: it takes no images (a text-only model, or "
            "a checkpoint without its vision tower); send text parts",
            param=refs[0].part,
            code="images_not_supported",
        )
    return engine.vision


async def request_images(engine, body: ChatCompletionRequest, limits: ImageLimits) -> list[RequestImage]:
    """The chat's images, fetched or decoded and preprocessed, in prompt order; [] for a chat
    without any. Every refusal is a RequestError naming the part or its URL; the count is
    checked before anything is fetched."""
    refs = image_refs(body)
    if not refs:
        return []
    vision = require_vision(engine, refs)
    loaded = await load_images([r.url for r in refs], limits, [r.param for r in refs])
    # Resizing and normalising is CPU work: off the event loop, which serves everyone.
    return await asyncio.to_thread(preprocess_images, vision, loaded, refs)


def preprocess_images(vision: VisionModel, loaded: list[LoadedImage], refs: list[ImageRef]) -> list[RequestImage]:
    out = []
    for image, ref in zip(loaded, refs):
        try:
            pixels = vision.preprocess(image.image)
        except (JfireError, ValueError) as e:  # a degenerate picture the processor cannot resize
            raise RequestError(
                f"the image cannot be preprocessed: {e}", param=ref.param, code="invalid_image"
            ) from None
        out.append(RequestImage(content_hash=image.content_hash, pixels=pixels))
    return out


def expand_images(engine, prompt_ids: list[int], images: list[RequestImage]) -> list[int]:
    """The rendered prompt's ids with each image's placeholder ids in place of the one token
    the template wrote for it. The counts differ when a text part holds that token itself or
    a template leaves an image part out: refused, as the images would land in the wrong place."""
    vision: VisionModel = engine.vision  # the images were preprocessed by it (request_images)
    slots = sum(1 for i in prompt_ids if i == vision.template_token_id)
    if slots != len(images):
        raise PromptError(
            f"the rendered prompt holds {slots} image placeholder tokens for the request's {len(images)} images: "
            "a text part holds the model's image token itself, or the chat template leaves an image part out",
            "messages",
        )
    return vision.expand_prompt(prompt_ids, [i.pixels for i in images])


def tool_dicts(body: ChatCompletionRequest) -> list[dict] | None:
    """The tools the model is offered: none with tool_choice "none"."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def render_chat(
    tokenizer, model_type: str | None, body: ChatCompletionRequest, text_limit: TextLimit | None = None
) -> tuple[list[int], OutputPlan]:
    """(prompt ids, output plan) of a chat request. A rendered prompt with more bytes than
    `text_limit` allows is refused (RequestError) before it is tokenized."""
    template = tokenizer.chat_template
    tools = tool_dicts(body)
    messages = chat_messages(body)
    kwargs = {}
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    fmt = tool_calls.format_for(template, model_type) if tools or has_tool_turns else None
    if tools or has_tool_turns:
        messages = tool_calls.prepare_messages(messages, tools, template, fmt)
        if tools and tool_calls.template_takes_tools(template):
            kwargs["tools"] = tools
    # As HF's apply_chat_template(tokenize=True): templates write their own BOS, so none is added.
    text = tokenizer.render_chat(messages, add_generation_prompt=body.add_generation_prompt, **kwargs)
    if text_limit is not None:  # the rendered text, not the messages: a template may leave some out
        text_limit.check(text)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    build = response_grammar_builder(body)
    if tools and tools_constrained(body):
        build = functools.partial(tool_grammar, body, tools, fmt, tokenizer)
    plan = OutputPlan(build, tool_format=fmt if tools else None, keep_special_tokens=tools is not None)
    return prompt_ids, plan


def tools_constrained(body: ChatCompletionRequest) -> bool:
    """Whether the request's tools constrain its output with a grammar: a forced call
    (tool_choice "required" or a named function), or under "auto" a tool that is `strict` or
    `parallel_tool_calls` false."""
    if not body.tools or body.tool_choice == "none":
        return False
    forced = body.tool_choice not in (None, "auto")
    return forced or any(t.function.strict for t in body.tools) or not body.parallel_tool_calls


def tool_grammar(body: ChatCompletionRequest, tools: list[dict], fmt, tokenizer) -> str:
    """The grammar of a request whose tool settings constrain it (`tools_constrained`): a
    forced call, or under "auto" a grammar that leaves text free and constrains a call once
    the model starts one. The markers of a format written in special tokens (Kimi K2's) are
    matched as those tokens, which the model was trained to emit."""
    choice = body.tool_choice
    forced = choice is not None and choice not in ("auto", "none")
    strict = [i for i, t in enumerate(tools) if t["function"].get("strict")]
    only = choice.function.name if isinstance(choice, NamedToolChoice) else None
    enforced = [i for i, t in enumerate(tools) if only in (None, t["function"]["name"])] if forced else strict
    for i in enforced:
        try:
            grammars.check_json_schema(tools[i]["function"].get("parameters") or {"type": "object"})
        except grammars.GrammarError as e:
            raise PromptError(f"tools[{i}].function.parameters: {e}", "tools") from None
    special = fmt.special_markers(tokenizer)
    if forced:
        return fmt.grammar(tools, only=only, parallel=body.parallel_tool_calls and only is None, special=special)
    return fmt.auto_grammar(tools, parallel=body.parallel_tool_calls, special=special)


def response_grammar_builder(body: SamplingFields) -> Callable[[], str] | None:
    """What builds the grammar `response_format` asks for, or None."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    return functools.partial(response_grammar, fmt)


def response_grammar(fmt: ResponseFormat) -> str:
    """The grammar of a `response_format` of type json_object or json_schema. Only written out
    from the schema: compiling it (jfire.grammar.Grammars, in the engine's request check)
    refuses a schema it cannot enforce, in the words check_json_schema uses."""
    try:
        if fmt.type == "json_object":
            return grammars.json_object_grammar()
        return grammars.json_schema_grammar(fmt.json_schema.schema_)
    except grammars.GrammarError as e:
        raise PromptError(f"response_format: {e}", "response_format") from None
