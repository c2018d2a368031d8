"""A request's grammar costs the server one compile, made in its grammar pool (never on the
event loop), and only once the waiting queue has room for the request: here the app runs over
the real request checks and grammars (a byte-level tokenizer), counting llguidance's compiles.
No model: the stand-in engine answers each choice at once."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import llguidance
import pytest
from fastapi.testclient import TestClient

import jfire.grammar as grammar_module
from jfire.errors import QueueFull, RequestError
from jfire.grammar import Grammars, json_schema_grammar
from jfire.request_checks import RequestChecks
from jfire.requests import RequestOutput
from jfire.tokenizer import Tokenizer
from serve.app import ServerState, create_app
from tests.tiny_models import save_byte_tokenizer

QUEUE = 16
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class QueueEngine:
    """What the app sees of an engine, over real RequestChecks: submitting checks the request,
    asks the queue and builds the choice's matcher, as jfire.engine.Engine.submit does."""

    vocab_size = max_model_len = 256
    model_type = vision = error = on_fatal = None

    def __init__(self, tokenizer: Tokenizer, waiting: int):
        self.tokenizer, self.waiting = tokenizer, waiting
        grammars = Grammars(tokenizer, self.vocab_size, {0})
        self.checks = RequestChecks(self.vocab_size, self.max_model_len, grammars, True, queue=self.queue)
        self.matchers: list = []

    def queue(self) -> tuple[int, int]:
        return self.waiting, QUEUE

    def is_ready(self):
        return True

    def health(self):
        return 200, {"status": "ok"}

    def stats(self):
        return {}

    def validate(self, prompt_ids, sampling):
        self.checks.check(prompt_ids, sampling)

    def submit(self, prompt_ids, sampling, *, request_id, on_output, affinity=None, after=None):
        self.validate(prompt_ids, sampling)
        self.checks.admit()
        self.matchers.append(self.checks.grammars.matcher(sampling.grammar))
        on_output(RequestOutput(request_id, [1], "", finished=True, finish_reason="stop", completion_tokens=1))

    def cancel(self, request_id):
        pass


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(save_byte_tokenizer(tmp_path_factory.mktemp("bytes")))


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """The name of the thread each llguidance matcher was compiled on, in order."""
    threads: list[str] = []

    class CountingMatcher:
        grammar_from_json_schema = staticmethod(llguidance.LLMatcher.grammar_from_json_schema)
        validate_grammar = staticmethod(llguidance.LLMatcher.validate_grammar)

        def __new__(cls, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return llguidance.LLMatcher(*args, **kwargs)

    counting = SimpleNamespace(LLMatcher=CountingMatcher, LLTokenizer=llguidance.LLTokenizer)
    monkeypatch.setattr(grammar_module, "llguidance", counting)
    return threads


def post(engine: QueueEngine, n: int, schema=SCHEMA):
    state = ServerState(engine=engine, model_name="m", access_log=False)
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "n": n,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    with TestClient(create_app(state)) as client:
        return client.post("/v1/completions", json=body)


def test_sixteen_choices_compile_their_grammar_once_in_the_grammar_pool(tokenizer, compiles):
    engine = QueueEngine(tokenizer, waiting=0)
    r = post(engine, n=16)
    assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text
    assert len(compiles) == 1 and compiles[0].startswith("jfire-grammar"), compiles
    # Each choice got a matcher of its own, at the start of the grammar.
    first, second = engine.matchers[0], engine.matchers[1]
    assert first.consume_tokens(tokenizer.encode('{"a": 1', add_special_tokens=False))
    assert not second.is_error() and second.consume_tokens(tokenizer.encode('{"a"', add_special_tokens=False))


def test_a_full_queue_answers_429_before_anything_compiles(tokenizer, compiles):
    r = post(QueueEngine(tokenizer, waiting=QUEUE), n=1)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    r = post(QueueEngine(tokenizer, waiting=QUEUE - 6), n=8)
    assert r.status_code == 429 and "room for 6 of this request's 8 choices" in r.json()["error"]["message"]
    assert compiles == []


def test_a_schema_the_grammar_cannot_enforce_is_refused_by_its_one_compile(tokenizer, compiles):
    r = post(QueueEngine(tokenizer, waiting=0), n=4, schema={"type": "object", "not": {"required": ["a"]}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert error["message"].startswith('response_format: the JSON schema uses "not", which jfire cannot enforce')
    assert len(compiles) == 1


def test_grammars_compile_each_grammar_once_and_keep_the_latest(tokenizer, compiles):
    grammars = Grammars(tokenizer, 256, {0}, keep=2)
    one, two, three = (json_schema_grammar({**SCHEMA, "title": t}) for t in ("one", "two", "three"))
    grammars.validate(one)
    for _ in range(8):
        grammars.matcher(one)
    assert len(compiles) == 1
    grammars.validate(two)
    grammars.validate(three)  # keeps two and three
    grammars.matcher(three)
    grammars.matcher(one)  # compiled again
    assert len(compiles) == 4


def test_a_request_with_more_choices_than_the_queue_holds_can_never_run(tokenizer):
    checks = QueueEngine(tokenizer, waiting=0).checks
    with pytest.raises(RequestError, match="ask for at most 16") as e:
        checks.admit(17)
    assert e.value.param == "n"
    checks.admit(16)
    with pytest.raises(QueueFull):
        QueueEngine(tokenizer, waiting=QUEUE).checks.admit(1)
