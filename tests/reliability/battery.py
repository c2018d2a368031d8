"""The battery of malformed and hostile requests for tests/reliability/test_serve_faults.py:
for every field of both endpoints, values of the wrong type, integers and floats at their
boundaries, non-finite numbers and bad text, plus whole-body faults (invalid UTF-8, deep
nesting, bodies over the limit, wrong content types). Each case carries its one right answer,
from a small per-field rule written from what the OpenAI API accepts and the limits this
server documents."""

from __future__ import annotations

import dataclasses
import json
import math

import httpx

from tests import limits

# The server the battery is written for: `jfire serve` of the default model with the tests'
# limits (tests/limits.py) and --max-body-mb 1.
CONTEXT = limits.CONTEXT
BODY_LIMIT = 1 << 20
VOCAB = 49152  # the default model's vocabulary

@dataclasses.dataclass
class Case:
    name: str
    path: str
    body: bytes | None  # None: sent chunked, without a Content-Length
    status: int  # the one right answer: 200, or the 4xx
    param: str | None = None  # the field a 400 must name (itself or a part of it)
    words: str = ""  # what a refusal's message must say
    content_type: str | None = "application/json"
    method: str = "POST"


WRONG_TYPES = ['"x"', "true", "[]", "{}", "null", "[1]"]
INTEGERS = ["-1", "0", "1", str(2**31 - 1), str(2**31), str(2**32), str(2**63), str(2**64), str(-2**63 - 1),
            str(10**30)]
FLOATS = ["NaN", "Infinity", "-Infinity", "1e308", "-0.0", "0.5"]  # raw JSON tokens, as Python's json writes them
SOME_NUMBERS = ["1", "0.5", "NaN"]  # for fields that are not numbers: wrong types too
# For numbers taken at one value only (their neutral one, or n=1).
FEW_NUMBERS = ["-1", "0", "1", "2", str(2**63), "-0.0", "0.5", "NaN", "Infinity"]
# Lone surrogates, which only JSON's \u escapes can carry, and a valid pair (an emoji).
SURROGATES = [r'"a\ud800b"', r'"\udc00"', r'"\ud83d\ude00"']


def integer(v) -> bool:
    return type(v) is int


def number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def boolean(v) -> bool:
    return type(v) is bool


def text(v) -> bool:
    """A string of valid Unicode (no lone surrogate)."""
    if type(v) is not str:
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def optional(valid):
    # OpenAI's optional fields are nullable: null means the default.
    return lambda v: v is None or valid(v)


def fields(v: dict) -> set:
    return {k for k, x in v.items() if x is not None}


def token_ids(v) -> bool:
    return type(v) is list and len(v) > 0 and all(integer(i) and 0 <= i < VOCAB for i in v)


def valid_prompt(v) -> bool:
    """One prompt: non-empty text or token ids, or a one-element list of either."""
    one = lambda p: (text(p) and p != "") or token_ids(p)  # "" is no tokens at all
    return one(v) or (type(v) is list and len(v) == 1 and one(v[0]))


def valid_stop(v) -> bool:
    stops = [v] if type(v) is str else v
    return (type(stops) is list and len(stops) <= 16 and all(text(s) and 0 < len(s) <= 1024 for s in stops)
            and sum(len(s.encode()) for s in stops) <= 16 << 10)  # jfire/stop_strings.py's limits


# The roles tried here. `tool` is left out: it needs a tool_call_id (tests/serve/test_agent_api.py
# sends real tool turns).
ROLES = {"system", "developer", "user", "assistant"}


def valid_part(v) -> bool:
    # Image parts are refused by this server, which serves text models only.
    return type(v) is dict and fields(v) == {"type", "text"} and v["type"] == "text" and text(v["text"])


def valid_content(v) -> bool:
    return text(v) or (type(v) is list and all(valid_part(p) for p in v))  # OpenAI takes [] as no text


def valid_message(v) -> bool:
    return (type(v) is dict and {"role", "content"} <= fields(v) <= {"role", "content", "name"}
            and type(v["role"]) is str and v["role"] in ROLES and valid_content(v["content"])
            and optional(text)(v.get("name")))


def valid_messages(v) -> bool:
    return type(v) is list and len(v) > 0 and all(valid_message(m) for m in v)


MAX_VALID_N = 2  # the largest valid n among the values tried
OPENAI_OBJECTS = ["1", '"x"', "null", '{"type": "json_object"}']
ROOM = CONTEXT - 56  # max_tokens the short base prompts (chat's template included) leave room for
MAX_TOKENS = optional(lambda v: integer(v) and 1 <= v <= ROOM)
# field: (values besides the wrong types, which values are valid). Numbers with a range get
# every boundary.
SHARED = {
    "model": (SOME_NUMBERS + SURROGATES, lambda v: v == "default"),
    "max_tokens": (INTEGERS + FLOATS, MAX_TOKENS),
    "temperature": (INTEGERS + FLOATS, optional(lambda v: number(v) and 0 <= v <= 2)),
    "top_p": (INTEGERS + FLOATS, optional(lambda v: number(v) and 0 < v <= 1)),
    "top_k": (INTEGERS + FLOATS, optional(lambda v: integer(v) and 0 <= v <= 2**31 - 1)),  # an int32 on the device
    "seed": (INTEGERS + FLOATS, optional(lambda v: integer(v) and 0 <= v < 2**32)),
    # n counts against the waiting queue (a choice is an engine request): the battery's valid
    # n stay small (MAX_VALID_N); 16 is the schema's bound.
    "n": (FEW_NUMBERS + ["17"], optional(lambda v: integer(v) and 1 <= v <= 16)),
    "presence_penalty": (FEW_NUMBERS + ["-2", "-2.5", "2.5"], optional(lambda v: number(v) and -2 <= v <= 2)),
    "frequency_penalty": (FEW_NUMBERS + ["-2", "-2.5", "2.5"], optional(lambda v: number(v) and -2 <= v <= 2)),
    "repetition_penalty": (FEW_NUMBERS + ["10", "10.5"], optional(lambda v: number(v) and 0 < v <= 10)),
    "response_format": (OPENAI_OBJECTS + ['{"type": "text"}', '{"type": "json_schema"}'],
                        lambda v: v is None or v in ({"type": "json_object"}, {"type": "text"})),
    "stream": (SOME_NUMBERS, optional(boolean)),
    # Only with "stream": true, which the base bodies do not set.
    "stream_options": (SOME_NUMBERS + ['{"include_usage": true}'], lambda v: v is None),
    "stop": (SOME_NUMBERS + SURROGATES + ['""', '[""]', '["a", "b", "c", "d", "e"]', json.dumps(list("abcdefghijklmnopq")),
              json.dumps("x" * 1025), r'["\n", "."]', r'["\ud800"]'],
             optional(valid_stop)),
    "user": (SOME_NUMBERS + SURROGATES, optional(text)),
    "ignore_eos": (SOME_NUMBERS, optional(boolean)),
}
COMPLETIONS = {
    **SHARED,
    "prompt": (SOME_NUMBERS + SURROGATES + ['""', "[-1]", f"[{VOCAB}]", "[1.5]", "[true]", '["a", "b"]', "[[1]]",
                                             "[[1], [2]]", '["a"]', "[[]]", r'["\ud800"]'], valid_prompt),
    "logprobs": (FEW_NUMBERS + ["5", "6"], optional(lambda v: integer(v) and 0 <= v <= 5)),
    "echo": (SOME_NUMBERS, optional(boolean)),
    # Chat's: refused by name here.
    "tools": (OPENAI_OBJECTS, lambda v: v is None),
    "tool_choice": (OPENAI_OBJECTS, lambda v: v is None),
    "best_of": (FEW_NUMBERS, optional(lambda v: integer(v) and v == 1)),
    "suffix": (SOME_NUMBERS, lambda v: v is None),
}
# Both endpoints validate the shared fields alike: completions tries every boundary, chat the
# wrong types and the text faults (and every max_tokens boundary: chat counts its own prompt).
CHAT = {
    **{name: ([v for v in values if v not in INTEGERS + FLOATS], valid) for name, (values, valid) in SHARED.items()},
    "max_tokens": SHARED["max_tokens"],
    "messages": (SOME_NUMBERS + ['[{"role": "user", "content": "hi"}]', "[1]", "[null]", '["hi"]', "[[]]", "[{}]"],
                 valid_messages),
    "max_completion_tokens": (INTEGERS + FLOATS, MAX_TOKENS),
    "logprobs": (SOME_NUMBERS, optional(boolean)),
    "tools": (OPENAI_OBJECTS + ["[]"], lambda v: v is None or v == []),
    "tool_choice": (OPENAI_OBJECTS + ['"none"', '"auto"'], lambda v: v in (None, "none")),  # "auto" needs tools
    "add_generation_prompt": (SOME_NUMBERS, optional(boolean)),
}
# Each part of the one chat message, in place of its valid value.
MESSAGE = {
    "role": (SOME_NUMBERS + ['"system"', '"developer"', '"assistant"', '"wizard"', '"function"', '""', '"USER"'],
             lambda v: type(v) is str and v in ROLES),
    "content": (SOME_NUMBERS + SURROGATES + [
        '""', '[{"type": "text", "text": "hi"}]', '[{"type": "text"}]', '[{"type": "text", "text": 5}]',
        '[{"type": "audio", "text": "hi"}]', '[{"type": "image_url", "image_url": {"url": "data:,"}}]', '["hi"]',
        '[{"text": "hi"}]', '[{"type": "text", "text": "hi", "extra": 1}]', r'[{"type": "text", "text": "\ud800"}]',
        '[{"type": "text", "text": "hi", "cache_control": null}]'], valid_content),
    "name": (SOME_NUMBERS + SURROGATES + ['"bob"'], optional(text)),
    # Only assistant messages carry tool calls, and only tool messages a tool_call_id.
    "tool_calls": (["[]", '[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]'],
                   lambda v: v is None),
    "tool_call_id": (['"c"'], lambda v: v is None),
    "made_up_field": (["1"], lambda v: v is None),
}
# Fields OpenAI has and this server does not implement, and one nobody has: refused by name
# unless null.
UNKNOWN = {name: (OPENAI_OBJECTS, lambda v: v is None) for name in ("logit_bias", "functions", "made_up_option")}

BASES = {
    "/v1/completions": {"model": "default", "prompt": "hi", "max_tokens": 1, "temperature": 0},
    "/v1/chat/completions": {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                             "temperature": 0},
}
MARK = "\x00value\x00"


def with_value(base: dict, path: list, raw: str) -> bytes:
    """The base body with the raw JSON text `raw` at `path` (raw: NaN and \\ud800 survive)."""
    body = json.loads(json.dumps(base))
    *parents, last = path
    node = body
    for key in parents:
        node = node[key]
    node[last] = MARK
    return json.dumps(body).replace(json.dumps(MARK), raw).encode()


def field_cases() -> list[Case]:
    cases = []
    tables = [("/v1/completions", COMPLETIONS, []), ("/v1/completions", UNKNOWN, []),
              ("/v1/chat/completions", CHAT, []), ("/v1/chat/completions", UNKNOWN, []),
              ("/v1/chat/completions", MESSAGE, ["messages", 0])]
    for path, table, where in tables:
        for name, (values, valid) in table.items():
            for raw in dict.fromkeys(values if table is UNKNOWN else WRONG_TYPES + values):
                param = "messages" if where else name
                ok = valid(json.loads(raw))
                cases.append(Case(f"{path} {'.'.join(map(str, [*where, name]))}={raw}", path,
                                  with_value(BASES[path], [*where, name], raw), 200 if ok else 400, param))
    return cases


def body_cases() -> list[Case]:
    comp, chat = "/v1/completions", "/v1/chat/completions"

    def body(path: str, **fields) -> bytes:
        return json.dumps({**BASES[path], **fields}).encode()

    def padded(size: int) -> bytes:  # the base body, spaces added to `size` bytes
        good = body(comp)
        return good[:-1] + b" " * (size - len(good)) + b"}"

    cases = []
    for name, raw in [("a lone continuation byte", b"\x80"), ("0xff", b"\xff"), ("an overlong '/'", b"\xc0\xaf"),
                      ("a UTF-8-encoded surrogate", b"\xed\xa0\x80"), ("a truncated sequence", b"\xe2\x82"),
                      ("a code point past U+10FFFF", b"\xf4\x90\x80\x80")]:
        cases += [
            Case(f"invalid UTF-8 in a prompt: {name}", comp, body(comp, prompt="a@z").replace(b"@", raw), 400),
            Case(f"invalid UTF-8 in a message: {name}", chat,
                 body(chat, messages=[{"role": "user", "content": "a@z"}]).replace(b"@", raw), 400),
            Case(f"invalid UTF-8 in a key: {name}", comp, body(comp, **{"@": 1}).replace(b"@", raw), 400),
        ]
    deep = 100_000
    nested = b"[" * deep + b"]" * deep
    cases += [
        Case(f"{deep} nested [", comp, b"[" * deep, 400),
        Case(f"{deep} nested [ ]", comp, nested, 400),
        Case(f"a prompt nested {deep} deep", comp, b'{"model": "default", "prompt": ' + nested + b"}", 400),
        Case(f"messages nested {deep} deep", chat, b'{"model": "default", "messages": ' + nested + b"}", 400),
        Case(f"objects nested {deep // 2} deep", comp, b'{"a": ' * (deep // 2) + b"1" + b"}" * (deep // 2), 400),
        Case("a body over the limit", comp, body(comp, prompt="a" * (2 * BODY_LIMIT)), 413),
        Case("a body one byte over the limit", comp, padded(BODY_LIMIT + 1), 413),
        Case("a body at the limit", comp, padded(BODY_LIMIT), 200),
        Case("a prompt of 100000 words, under the body limit", comp, body(comp, prompt="word " * 100_000), 400,
             "prompt"),
        Case("a prompt of 100000 token ids", comp, body(comp, prompt=[1] * 100_000), 400, "prompt"),
        Case("a prompt one token short of the context", comp, body(comp, prompt=[1] * (CONTEXT - 1)), 200),
        Case("a prompt that fills the context", comp, body(comp, prompt=[1] * CONTEXT), 400, "prompt"),
        Case("a chat message of 50000 words", chat,
             body(chat, messages=[{"role": "user", "content": "word " * 50_000}]), 400, "messages"),
        Case("20000 messages, under the body limit", chat,
             body(chat, messages=[{"role": "user", "content": "hi"}] * 20_000), 400, "messages"),
        Case("a message that is not an object", chat, body(chat, messages=["hi"]), 400, "messages",
             "messages.0 must be a JSON object"),
        Case("an empty body", comp, b"", 400),
        Case("not JSON", comp, b"not json", 400),
        Case("truncated JSON", comp, body(comp)[:20], 400),
        Case("JSON with trailing garbage", comp, body(comp) + b" {}", 400),
        Case("JSON then a NUL byte", comp, body(comp) + b"\x00", 400),
        Case("a JSON array", comp, b"[]", 400),
        Case("a JSON string", comp, b'"hi"', 400),
        Case("a JSON number", comp, b"5", 400),
        Case("JSON null", comp, b"null", 400),
        Case("an empty object", comp, b"{}", 400, "model"),
        Case("an empty chat object", chat, b"{}", 400, "model"),
        Case("a NUL character in the prompt", comp, body(comp, prompt="a\x00b"), 200),
        Case("a chunked body without a length", comp, None, 411),
        Case("GET on a POST endpoint", comp, b"", 405, method="GET"),
        Case("an unknown path", "/v1/nothing", body(comp), 404),
        Case("JSON with a UTF-8 charset", comp, body(comp), 200, content_type="application/json; charset=utf-8"),
    ]
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "application/xml"):
        cases.append(Case(f"JSON sent as {content_type}", comp, body(comp), 400, words="Content-Type: application/json",
                          content_type=content_type))
    return cases


def error_problem(r: httpx.Response, case: Case) -> str | None:
    """What is wrong with a refusal: not OpenAI's error shape, or not naming the field."""
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an error in OpenAI's shape: {r.text[:200]}"
    shaped = (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
              and isinstance(error["message"], str) and error["message"] != ""
              and all(isinstance(error[k], (str, type(None))) for k in ("type", "param", "code")))
    if not shaped:
        return f"not OpenAI's error shape: {error}"
    if case.param and not (error["param"] == case.param or str(error["param"]).startswith(case.param + ".")):
        return f"the error does not name {case.param!r}: {error}"
    if case.words not in error["message"]:
        return f"the message does not say {case.words!r}: {error}"
    return None
