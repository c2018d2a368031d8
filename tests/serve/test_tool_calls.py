"""jfire.tool_calls: each family's tool-call format read back from the strings the real models
write (the examples of vLLM's parser tests and the models' chat templates), streaming equal to
whole-text parsing however the text is split, grammars that llguidance accepts and that admit
exactly the calls the tool schemas allow (checked with the default model's real tokenizer), and
prompts rendered by the default model's real chat template."""

from __future__ import annotations

import json
import random
import re

import llguidance
import pytest

from jfire.tool_calls import FORMATS, format_for, prepare_messages, template_takes_tools

HERMES, LLAMA3, LLAMA4, KIMI = (FORMATS[n] for n in ("hermes", "llama3_json", "llama4_pythonic", "kimi_k2"))

# (format, model output, expected content, expected calls as (name, arguments))
WELL_FORMED = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"})]),
    (HERMES, 'Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>\n',
     "Let me check both.", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "Europe/Paris"})]),
    # Qwen 3 thinks first; the arguments hold non-ASCII text and JSON that looks like framing.
    (HERMES, '<think>\nThe user wants a search.\n</think>\n\n<tool_call>\n{"name": "internet_search", "arguments": '
             '{"question": "5MW燃气轮机 {设计} </tool_call>", "filters": [{"k": "\\"x\\""}]}}\n</tool_call>',
     "<think>\nThe user wants a search.\n</think>",
     [("internet_search", {"question": "5MW燃气轮机 {设计} </tool_call>", "filters": [{"k": '"x"'}]})]),
    (HERMES, "Paris is sunny today.", "Paris is sunny today.", []),
    (LLAMA3, '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
     "", [("searchTool", {"query": "test query", "limit": 10})]),
    (LLAMA3, '<|python_tag|>{"name": "searchTool", "parameters": {"query": "test1"}}; '
             '{"name": "getOpenIncidentsTool", "parameters": {}}; '
             '{"name": "searchTool", "parameters": {"query": "test {value} [complex]"}}',
     "", [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
          ("searchTool", {"query": "test {value} [complex]"})]),
    (LLAMA3, 'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
     "Here is the result: Would you like to know more?", [("getOpenIncidentsTool", {})]),
    (LLAMA3, "This is just some text without any tool calls", "This is just some text without any tool calls", []),
    (LLAMA4, "[get_weather(city='LA', metric='C')]", "", [("get_weather", {"city": "LA", "metric": "C"})]),
    (LLAMA4, "<|python_start|>[get_weather(city='LA', metric='C'), register_user(name='Doe', age=9)]<|python_end|>",
     "", [("get_weather", {"city": "LA", "metric": "C"}), ("register_user", {"name": "Doe", "age": 9})]),
    (LLAMA4, "[register_user(name='Doe', age=9, address={'city': 'LA', 'state': 'CA'}, role=None, passed_test=True, "
             "aliases=['John', 'Johnny'], score=-1.5), get_weather(), do_something_cool(steps=[])]",
     "", [("register_user", {"name": "Doe", "age": 9, "address": {"city": "LA", "state": "CA"}, "role": None,
                             "passed_test": True, "aliases": ["John", "Johnny"], "score": -1.5}),
          ("get_weather", {}), ("do_something_cool", {"steps": []})]),
    (LLAMA4, r"""[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"', note="a, b) c]")]""",
     "", [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"', "note": "a, b) c]"})]),
    (LLAMA4, "How can I help you today? [1]", "How can I help you today? [1]", []),
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           '{"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|>',
     "", [("get_weather", {"city": "Beijing"})]),
    (KIMI, "Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.cas_find:3<|tool_call_argument_begin|>"
           '{"pattern": "**/*.conf"}<|tool_call_end|><|tool_call_begin|>functions.read_file:4'
           '<|tool_call_argument_begin|>{"path": "a.py", "n": 3}<|tool_call_end|><|tool_calls_section_end|>',
     "Let me look.", [("cas_find", {"pattern": "**/*.conf"}), ("read_file", {"path": "a.py", "n": 3})]),
    (KIMI, "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
]

MALFORMED = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>'),  # bad JSON
    (HERMES, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # unterminated
    (HERMES, '<tool_call>\n{"function": "get_weather", "args": {}}\n</tool_call>'),  # unknown structure
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'),
    (LLAMA3, '{"name": "invalidTool", "parameters": {invalid json}'),
    (LLAMA3, '{"name": "f", "parameters": {"a": 1}'),
    (LLAMA3, "use {x} here, or {\"key\": 1}"),
    (LLAMA4, "[get_weather(city='LA', metric=)]"),  # syntax error
    (LLAMA4, "[get_weather('LA')]"),  # positional argument
    (LLAMA4, "[get_weather(city=some_variable)]"),  # not a literal
    (LLAMA4, "[get_weather(city='LA'"),
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           "{bad}<|tool_call_end|><|tool_calls_section_end|>"),
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather<|tool_call_argument_begin|>{}"),
]


def _ids(cases):
    return [f"{case[0].name}-{i}" for i, case in enumerate(cases)]


def _collect(events):
    """What a client assembles from streaming events: (content, [(id, name, arguments)])."""
    content, calls = "", {}
    for event in events:
        assert set(event) in ({"content"}, {"index", "id", "type", "function"}, {"index", "function"}), event
        if "content" in event:
            content += event["content"]
        elif "id" in event:
            assert event["index"] == len(calls) and event["type"] == "function"
            calls[event["index"]] = [event["id"], event["function"]["name"], event["function"]["arguments"]]
        else:
            calls[event["index"]][2] += event["function"]["arguments"]
    return content, [tuple(call) for call in calls.values()]


def _stream(fmt, pieces, cut=False):
    parser = fmt.stream_parser()
    events = [e for piece in pieces for e in parser.feed(piece)]
    return events + parser.finish(cut=cut)


def _call(name, **arguments):
    return {"id": f"functions.{name}:0", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _random_pieces(text, rng, n):
    cuts = sorted(rng.sample(range(1, len(text)), min(n, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("fmt,text,content,expected", WELL_FORMED, ids=_ids(WELL_FORMED))
def test_parse_reads_real_model_output(fmt, text, content, expected):
    got_content, calls = fmt.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    for call in calls:
        if fmt is KIMI:
            assert re.fullmatch(rf"functions\.{call.name}:\d+", call.id)
        else:
            assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)


@pytest.mark.parametrize("fmt,text", MALFORMED, ids=_ids(MALFORMED))
def test_malformed_calls_stay_content(fmt, text):
    assert fmt.parse(text) == (text, [])
    # Streaming never raises on them either, however they arrive.
    for pieces in ([text], list(text)):
        _stream(fmt, pieces)


@pytest.mark.parametrize("fmt,text,content,expected", WELL_FORMED, ids=_ids(WELL_FORMED))
def test_streaming_equals_parse_however_the_text_is_split(fmt, text, content, expected):
    content, calls = fmt.parse(text)
    want = (content, [(c.name, c.arguments) for c in calls])
    rng = random.Random(0)
    splits = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    splits += [_random_pieces(text, rng, rng.randint(2, 12)) for _ in range(50)]
    for pieces in splits:
        got_content, got_calls = _collect(_stream(fmt, pieces))
        assert (got_content, [(name, args) for _, name, args in got_calls]) == want, pieces


@pytest.mark.parametrize("fmt,text", [
    (HERMES, "Use <tool_calls> or <tool_call/> tags, or <b>bold</b>."),
    (LLAMA3, 'A JSON example: {"name": "Bob", "age": 3}; and {"name": 5}.'),
    (LLAMA4, "See [1], [link](x), [f(x)] and [print(42)]."),  # no `name(` followed by `)` or `keyword=`
    (KIMI, "<|tool_calls_section_begin|> nothing <|tool_calls_section_end|>"),
])
def test_text_that_only_looks_like_a_call_streams_as_content(fmt, text):
    assert fmt.parse(text) == (text, [])
    for pieces in ([text], list(text)):
        assert _collect(_stream(fmt, pieces)) == (text, [])


def test_a_malformed_call_after_good_ones_leaves_them_calls():
    good = "<|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    bad = ("<|tool_call_begin|>functions.b:1<|tool_call_argument_begin|>{nope}<|tool_call_end|>"
           "<|tool_calls_section_end|>")
    content, calls = KIMI.parse("<|tool_calls_section_begin|>" + good + bad)
    assert content == bad and [(c.name, c.arguments) for c in calls] == [("a", "{}")]


def test_streaming_keeps_a_call_whose_name_went_out():
    """Output that ends inside a call's arguments without being cut (a stop): the stream already
    sent the name and has to keep it a call, with the arguments so far; parse() of the same
    text, which sees the whole, keeps it as content."""
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert HERMES.parse(text) == (text, [])
    content, calls = _collect(_stream(HERMES, list(text)))
    assert content == "Checking." and [call[1:] for call in calls] == [("get_weather", '{"city": "Pa')]


CUT_CALLS = [  # output cut by max_tokens inside a call: (format, text, content, [(name, arguments as written)])
    (HERMES, 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     "Checking.", [("get_weather", '{"city": "Pa')]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 7}}\n</tool_',
     "", [("get_weather", '{"city": "Oslo", "days": 7}')]),
    (HERMES, '<tool_call>\n{"name": "get_', '<tool_call>\n{"name": "get_', []),  # no name yet: as written
    (LLAMA4, "[get_weather(city='Paris', days=", "", [("get_weather", '{"city": "Paris"')]),
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           '{"city": "Bei', "", [("get_weather", '{"city": "Bei')]),
]


@pytest.mark.parametrize("fmt,text,content,expected", CUT_CALLS, ids=_ids(CUT_CALLS))
def test_a_call_cut_by_max_tokens_stays_a_call_as_written_in_both_modes(fmt, text, content, expected):
    """Whole and streamed responses agree: the call is kept with its arguments as far as the
    model wrote them (never closed or completed for it), and what is left of its block is not
    content."""
    got_content, calls = fmt.parse(text, cut=True)
    assert (got_content, [(c.name, c.arguments) for c in calls]) == (content, expected)
    for pieces in ([text], list(text)):
        got_content, calls = _collect(_stream(fmt, pieces, cut=True))
        assert (got_content, [call[1:] for call in calls]) == (content, expected), pieces


def test_streaming_sends_content_and_the_name_before_the_call_is_complete():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
            '\n</tool_call>')
    parser = HERMES.stream_parser()
    cut = text.index('"city"') + 4
    events = parser.feed(text[:cut])
    assert events[0] == {"content": "Let me check."}
    assert events[1]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(e["function"]["arguments"] for e in events[2:]) == '{"cit'
    later = parser.feed(text[cut:]) + parser.finish()
    assert "".join(e["function"]["arguments"] for e in later) == 'y": "Paris", "days": 3}'


def test_text_that_may_begin_a_call_is_held_back_until_decided():
    parser = HERMES.stream_parser()
    assert parser.feed("Sure <tool_") == [{"content": "Sure"}]
    assert parser.feed("box> is") == [{"content": " <tool_box> is"}]
    assert parser.finish() == []
    parser = LLAMA4.stream_parser()
    assert parser.feed("See [") == [{"content": "See"}]
    assert parser.feed("1]") == [{"content": " [1]"}]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_rendered_calls_parse_back(fmt):
    calls = [_call("get_weather", city="Paris", days=2), _call("get_time", tz="UTC", dst=True, x=None, at=[1.5, "a"])]
    content, parsed = fmt.parse(fmt.render_calls(calls))
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---- grammars ------------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["tz"], "additionalProperties": False}}},
]


def _valid(name, args):
    """The test schemas checked by hand (an independent check of what the grammar admits)."""
    if name == "get_time":
        return args.keys() == {"tz"} and args["tz"] in ("UTC", "CET")
    return (name == "get_weather" and {"city", "days"} <= args.keys() <= {"city", "unit", "days"}
            and isinstance(args["city"], str) and len(args["city"]) <= 12
            and args.get("unit", "celsius") in ("celsius", "fahrenheit")
            and type(args["days"]) is int and 1 <= args["days"] <= 7)


ACCEPTED = [[_call("get_weather", city="Paris", days=3)],
            [_call("get_weather", city="Oslo", unit="fahrenheit", days=7)],
            [_call("get_time", tz="CET")]]
REJECTED = [[_call("get_weather", city="Paris", days=8)],  # above the maximum
            [_call("get_weather", city="Paris", days=0)],  # below the minimum
            [_call("get_weather", city="Paris", days=2.5)],  # not an integer
            [_call("get_weather", city="Paris", unit="kelvin", days=1)],  # not in the enum
            [_call("get_weather", city="Paris")],  # a required property missing
            [_call("get_weather", city="Paris", days=1, wind=True)],  # additionalProperties false
            [_call("get_weather", city="Paris and all of its suburbs", days=1)],  # maxLength
            [_call("get_forecast", city="Paris", days=1)]]  # no such tool


@pytest.fixture(scope="module")
def default_tokenizer():
    from jfire.checkpoint.load import load_config_and_tokenizer

    cfg, tok = load_config_and_tokenizer("default")[:2]
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=cfg.vocab_size, eos_token=sorted(tok.eos_ids)[0])
    return tok, lltok


def _matches(lltok, tok, grammar, text):
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_grammar_is_valid_lark_for_llguidance(fmt):
    for kwargs in ({}, {"parallel": False}, {"only": "get_time"}):
        grammar = llguidance.LLMatcher.grammar_from_lark(fmt.grammar(TOOLS, **kwargs))
        assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    with pytest.raises(ValueError, match="no tool named"):
        fmt.grammar(TOOLS, only="get_forecast")


@pytest.mark.parametrize("fmt", [f for f in FORMATS.values() if f.markers], ids=lambda f: f.name)
def test_markers_that_are_special_tokens_are_written_as_those_tokens(fmt, default_tokenizer):
    """Given the markers' ids (as a tokenizer whose specials they are gives them), a grammar
    matches each marker as its one token, never its spelling; without them, as text."""
    special = {m: 1000 + i for i, m in enumerate(fmt.markers)}
    for grammar in (fmt.grammar(TOOLS, special=special), fmt.auto_grammar(TOOLS, special=special)):
        assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""
        assert not any(json.dumps(marker) in grammar for marker in special)
        assert f"<[{special[fmt.trigger]}]>" in grammar
    assert json.dumps(fmt.trigger) in fmt.grammar(TOOLS)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_grammar_admits_exactly_the_calls_the_schemas_allow(fmt, default_tokenizer):
    tok, lltok = default_tokenizer
    grammar = fmt.grammar(TOOLS)
    for calls in ACCEPTED:
        assert _matches(lltok, tok, grammar, fmt.render_calls(calls)), fmt.render_calls(calls)
    assert _matches(lltok, tok, grammar, fmt.render_calls(ACCEPTED[0] + ACCEPTED[2]))  # parallel
    for calls in REJECTED:
        assert not _matches(lltok, tok, grammar, fmt.render_calls(calls)), fmt.render_calls(calls)
    assert not _matches(lltok, tok, fmt.grammar(TOOLS, parallel=False), fmt.render_calls(ACCEPTED[0] + ACCEPTED[2]))
    assert not _matches(lltok, tok, fmt.grammar(TOOLS, only="get_time"), fmt.render_calls(ACCEPTED[0]))
    assert _matches(lltok, tok, fmt.grammar(TOOLS, only="get_time"), fmt.render_calls(ACCEPTED[2]))


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_text_generated_under_the_grammar_parses_into_valid_calls(fmt, default_tokenizer):
    """A random walk over the tokens the grammar allows (as a sampler would take), biased to end
    strings soon; what comes out parses back into calls that satisfy the schemas."""
    tok, lltok = default_tokenizer
    grammar = llguidance.LLMatcher.grammar_from_lark(fmt.grammar(TOOLS))
    # Single characters spell any text; a few multi-character pieces keep walks short.
    pieces = {}
    for s in [*map(chr, range(32, 127)), "\n", "celsius", "fahrenheit", "UTC", "CET", "get", "weather", "time"]:
        if len(ids := tok.encode(s, add_special_tokens=False)) == 1:
            pieces[ids[0]] = s
    closers = [t for t, s in pieces.items() if s in ('"', "}", "]", ")", ", ")]
    rng = random.Random(1)
    for _ in range(6):
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        tokens = []
        while not matcher.is_accepting():
            assert len(tokens) < 400 and not matcher.is_error(), (tok.decode(tokens), matcher.get_error())
            mask = matcher.compute_logit_bias()
            # Where the grammar forces text, llguidance allows only its canonical tokens.
            allowed = [t for t in pieces if mask[t]] or [t for t in range(len(mask)) if mask[t]]
            closing = [t for t in closers if mask[t]]
            token = rng.choice(closing if closing and rng.random() < 0.3 else allowed)
            assert matcher.consume_token(token)
            tokens.append(token)
        content, calls = fmt.parse(tok.decode(tokens, skip_special_tokens=False))
        assert content == "" and calls
        for call in calls:
            assert _valid(call.name, json.loads(call.arguments)), call


# ---- choosing the format, rendering prompts ------------------------------------------------------

@pytest.mark.parametrize("template,model_type,expected", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{{ tool_call | tojson }}\n</tool_call>",
     None, "hermes"),
    ("{{- '<|python_tag|>' + tool_call.name }}{% if message.role == 'ipython' %}", None, "llama3_json"),
    ("{%- if message.role == 'ipython' %}<|header_start|>ipython<|header_end|>", "llama", "llama3_json"),
    ("you MUST put it in the format of [func_name1(params_name1=params_value1, ...)]", None, "llama4_pythonic"),
    ("{{- '<|python_start|>' }}{% if message.role == 'ipython' %}", None, "llama4_pythonic"),
    ("<|tool_calls_section_begin|>{%- for tool_call in message.tool_calls -%}<|tool_call_begin|>", None, "kimi_k2"),
    ("{% for message in messages %}{{ message.content }}{% endfor %}", "llama4_text", "llama4_pythonic"),
    ("{% for message in messages %}{{ message.content }}{% endfor %}", "kimi_k2", "kimi_k2"),
    ("{% for message in messages %}{{ message.content }}{% endfor %}", "qwen3", "hermes"),
    (None, None, "hermes"),
])
def test_format_for_reads_the_template_then_the_model_type(template, model_type, expected):
    assert format_for(template, model_type).name == expected


def test_template_takes_tools():
    assert template_takes_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_takes_tools("{% for message in messages %}{{ message.content }}{% endfor %}")
    assert not template_takes_tools(None)


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris for 3 days?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": '{"forecast": "sunny", "high_c": 24}'},
    {"role": "tool", "tool_call_id": "call_def", "content": "second result"},
]


def test_prepare_messages_for_the_default_models_template(default_tokenizer):
    tok, _ = default_tokenizer
    assert not template_takes_tools(tok.chat_template)
    fmt = format_for(tok.chat_template)
    text = tok.render_chat(prepare_messages(CONVERSATION, TOOLS, tok.chat_template, fmt))
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '{"type": "function", "function": {"name": "get_weather"' in text  # the tool's signature
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert ('<|im_start|>tool\n<tool_response>\n{"forecast": "sunny", "high_c": 24}\n</tool_response>\n'
            '<tool_response>\nsecond result\n</tool_response><|im_end|>') in text
    assert "None" not in text and "undefined" not in text.lower()
    # A system message keeps its text, the tool prompt after it.
    system = {"role": "system", "content": "Be brief."}
    with_system = prepare_messages([system, *CONVERSATION], TOOLS, tok.chat_template, fmt)
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools\n") and len(with_system) == 4


def test_prepare_messages_for_a_template_that_refuses_unknown_roles():
    template = "{% if message.role not in ['user', 'assistant'] %}{{ raise_exception('roles!') }}{% endif %}"
    prepared = prepare_messages(CONVERSATION, None, template, HERMES)
    assert [m["role"] for m in prepared] == ["user", "assistant", "user"]
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in prepared)


def test_prepare_messages_for_a_template_with_tool_support():
    template = "{% for t in tools %}{{ t | tojson }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    prepared = prepare_messages(CONVERSATION, TOOLS, template, HERMES)
    assert prepared[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 3}
    assert [m for i, m in enumerate(prepared) if i != 1] == [m for i, m in enumerate(CONVERSATION) if i != 1]
    assert CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'  # not mutated


# Markers as text here (the default tokenizer has none of them as special tokens); as special
# tokens through the server: tests/serve/test_tool_constraints.py.
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_auto_grammar_leaves_text_free_and_constrains_the_calls_it_must(fmt, default_tokenizer):
    """tool_choice "auto" with a strict tool or parallel_tool_calls false: free text, a call
    where the model writes the format's opener, the strict tool's arguments held to its schema
    and the other tool's free, and without parallel calls one call that ends the output."""
    tok, lltok = default_tokenizer
    weather, time_tool = (dict(t, function=dict(t["function"])) for t in TOOLS)
    weather["function"]["strict"] = True
    tools = [weather, time_tool]
    good, free = ACCEPTED[0], [_call("get_time", zone=1)]  # get_time is not strict: any arguments
    prose = "It is sunny in Paris, I think."
    for parallel in (True, False):
        grammar = fmt.auto_grammar(tools, parallel=parallel)
        assert _matches(lltok, tok, grammar, prose)
        assert _matches(lltok, tok, grammar, fmt.render_calls(good))
        assert _matches(lltok, tok, grammar, fmt.render_calls(free))
        for calls in REJECTED[:-1]:  # the strict tool's schema holds
            assert not _matches(lltok, tok, grammar, fmt.render_calls(calls)), fmt.render_calls(calls)
        assert _matches(lltok, tok, grammar, fmt.render_calls(good + free)) == parallel
        assert _matches(lltok, tok, grammar, fmt.render_calls(good) + "\n" + fmt.render_calls(free)) == parallel
    if fmt is HERMES:  # text before a call is free; once the opener is written, a call follows
        grammar = fmt.auto_grammar(tools, parallel=False)
        assert _matches(lltok, tok, grammar, "Let me look that up.\n" + fmt.render_calls(good))
        assert not _matches(lltok, tok, grammar, "Let me look that up.\n<tool_call>\nno call after all")
