"""Replays coding-agent sessions: prefix-cache hit ratio and TTFT per turn, in both deployments.

    .venv/bin/python scripts/bench_agent_trace.py [--modes colocated,disaggregated] [--sessions 4]
        [--turns 20] [--seed 0] [--port P] [--output bench-agent-trace.json] [--engine-args "..."]

The trace (the same for a given --seed): --sessions concurrent sessions, started 0.5 s apart,
each --turns chat requests. Every session has the same system prompt and the same dozen tool
definitions (about 2,000 tokens together). Turn 1 is a user task; each later turn appends what
an agent loop would: the assistant message that called a tool (scripted, not the model's
output), the tool's result (140 to 240 tokens of file contents, test output, grep hits...,
different per session and turn) and a user message, about 290 tokens a turn, so that the 20th
turn's prompt is about 7.6k tokens of the 8,192-token context (at most 8.0k for seeds 0-29).
Each request sends the whole conversation with `tools`, tool_choice "auto", max_tokens 8 and
temperature 0, streamed with usage: TTFT is the time to the first chunk after the role chunk,
and usage.prompt_tokens_details.cached_tokens is what the prefix cache served.

It starts each deployment itself, one after the other (logs in /tmp/jfire-agent-trace-MODE.log):
  colocated:      `jfire serve` (one process, one page pool);
  speculative:    the same with `--speculative suffix` (use --max-tokens 64 or so: with 8 tokens a
                  turn there is little to draft); it reports the draft tokens kept and the
                  decode tokens/s, which every mode reports;
  disaggregated:  `jfire launch meshes/local-2p1d.toml` (two prefill groups, one decode group);
                  every request carries `x-session-affinity: <session id>`, so a session's turns
                  all go to the same prefill group, whose prefix cache holds the session
                  (--affinity turn: a new key every turn, so a session's turns spread over the
                  groups; --affinity none: no key. The frontend routes by prefix first, unless
                  --engine-args has the launch flag --no-prefix-routing).
For each it prints per turn the median TTFT over sessions and the mean prompt and cached tokens,
then the run's prefix-cache hit ratio (cached / prompt tokens; goal >= 90%) and the last turn's
median TTFT over the second's (goal <= 2: a long session's turn costs about what a short one's
does), and writes everything to --output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jfire import deployment_secret  # noqa: E402
from jfire.disagg.frontend import affinity_index  # noqa: E402
from jfire.disagg.launch import free_port  # noqa: E402

DEPLOYMENT = "meshes/local-2p1d.toml"
# The deployment's secret, as an operator gives one: its control token shows /health's group
# addresses, whose own /health says when each group has compiled everything.
SECRET = deployment_secret.DeploymentSecret.generate()
CONTROL_AUTH = {"Authorization": f"Bearer {SECRET.bearer()}"}
# KV cache: 45 KiB a token for SmolLM2-135M in float32 (2 GiB is 2,912 pages of 16 tokens), so 4
# sessions of up to 8,192 tokens need 1.4 GiB (2,048 pages). 2 GiB leaves a margin for the pages
# of other prefixes and requests, in the colocated pool and in each group's.
ENGINE_ARGS = ["--max-context", "8192", "--max-batch", "8", "--prefill-budget", "256", "--kv-cache-gb", "2"]
SHUTDOWN_GRACE_S = 5  # on SIGTERM, in-flight requests get this long before the server ends them
MAX_TOKENS = 8
SESSION_STAGGER_S = 0.5
GOAL_HIT_RATIO = 0.90
GOAL_TTFT_GROWTH = 2.0

SYSTEM_PROMPT = """You are Forge, an autonomous software engineering agent working inside a developer's repository. \
You complete programming tasks end to end: you explore the code base, read the relevant files, make focused \
changes, run the tests, and report what you did.

Working rules:
- Before you change a file, read the part you are about to change. Never guess at the contents of a file.
- Prefer small, reviewable edits over rewrites. Keep the existing style, naming and formatting of the project.
- Every behaviour change needs a test. Run the tests that cover the code you touched, then the whole suite \
before you commit.
- Do not invent APIs. When you are unsure how a library behaves, search its documentation first.
- Never commit secrets, credentials, generated files or large binaries. Never force-push or rewrite history.
- Shell commands run in a sandbox without network access, with a timeout of 120 seconds. Prefer the \
dedicated tools (read_file, grep, list_dir, run_tests) over shell equivalents.
- When a command fails, read its output carefully and fix the cause; do not retry the same command unchanged.
- Work on a feature branch; open a pull request when the task is done and the tests pass.

Communication:
- Be concise. Explain the reason for a change in one or two sentences; the diff speaks for itself.
- When the task is ambiguous, state the assumption you make and continue.
- When you are done, summarise the change, the tests you ran and anything left for a human to decide.

Call one tool at a time and wait for its result before you decide the next step."""


def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    """An OpenAI `tools` entry."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def string(description: str, **extra) -> dict:
    return {"type": "string", "description": description, **extra}


def integer(description: str, **extra) -> dict:
    return {"type": "integer", "description": description, **extra}


def boolean(description: str) -> dict:
    return {"type": "boolean", "description": description}


TOOLS = [
    tool("read_file", "Read a text file from the repository and return its contents with line numbers. Read the "
         "part of a file you are about to change before editing it.",
         {"path": string("Path of the file, relative to the repository root."),
          "start_line": integer("First line to return (1-based).", minimum=1),
          "end_line": integer("Last line to return, inclusive.", minimum=1)},
         ["path"]),
    tool("write_file", "Create a new file, or replace a file entirely, with the given content. Prefer edit_file "
         "for changes to existing files: it produces a smaller diff.",
         {"path": string("Path of the file to write, relative to the repository root."),
          "content": string("The complete new content of the file.")},
         ["path", "content"]),
    tool("edit_file", "Replace an exact snippet of an existing file with new text. The old text must occur exactly "
         "once, whitespace included. Returns the edited region with line numbers.",
         {"path": string("Path of the file to edit."),
          "old_text": string("The exact text to replace."),
          "new_text": string("The replacement text.")},
         ["path", "old_text", "new_text"]),
    tool("list_dir", "List the files and directories under a path, with sizes, up to a given depth. Skips "
         "version-control metadata, virtual environments and build outputs.",
         {"path": string("Directory to list; '.' for the repository root."),
          "depth": integer("How many levels to descend.", minimum=1, maximum=5)},
         ["path"]),
    tool("grep", "Search file contents for a regular expression (ripgrep syntax) and return the matching lines "
         "as path:line:text.",
         {"pattern": string("Regular expression to search for."),
          "path": string("File or directory to search in."),
          "glob": string("Only search files matching this glob, e.g. '*.py'.")},
         ["pattern"]),
    tool("run_tests", "Run the project's test suite, or a part of it, and return the output: passes, failures "
         "with their tracebacks, and a summary.",
         {"target": string("Test file, directory or test id; omit to run everything."),
          "fail_fast": boolean("Stop at the first failure.")},
         []),
    tool("run_shell", "Run a shell command in the repository root and return its exit status and output. No "
         "network access. Use it for linters, type checkers and builds, not to read or search files.",
         {"command": string("The command line, run by bash."),
          "timeout_s": integer("Kill the command after this many seconds.", minimum=1, maximum=120)},
         ["command"]),
    tool("git_diff", "Show the uncommitted changes as a unified diff, optionally limited to some paths. Review it "
         "before committing.",
         {"paths": {"type": "array", "items": {"type": "string"}, "description": "Limit the diff to these paths."}},
         []),
    tool("git_commit", "Stage the given paths (or every change) and commit them on the current branch with the "
         "given message. Refuses to commit on the default branch.",
         {"message": string("A summary line of at most 72 characters, a blank line, then the reason."),
          "paths": {"type": "array", "items": {"type": "string"}, "description": "Paths to stage; omit for all."}},
         ["message"]),
    tool("search_docs", "Search the documentation of the project's dependencies and of the standard library. Use "
         "it before relying on an API you are not sure about.",
         {"query": string("What to look for, in a few words."),
          "library": string("Restrict the search to one library, e.g. 'pytest'.")},
         ["query"]),
    tool("create_branch", "Create a git branch from the current commit and switch to it. Names look like "
         "'fix/short-description'.",
         {"name": string("Name of the new branch.")},
         ["name"]),
    tool("open_pr", "Push the current branch and open a pull request against the default branch. Say what "
         "changed, why, and how it was tested.",
         {"title": string("Title, at most 72 characters."),
          "body": string("Description in Markdown.")},
         ["title", "body"]),
]

# -- the trace: synthetic coding-agent sessions -------------------------------------------------

PROJECTS = [
    {"package": "ledger", "about": "a double-entry payments ledger service",
     "task": "Refunds in a foreign currency are booked with the wrong amount: the refund uses today's exchange "
             "rate instead of the rate of the original charge. Find where refunds are booked, fix it, and add a "
             "regression test.",
     "modules": ["accounts", "transactions", "currency", "refunds", "reconcile", "storage"]},
    {"package": "crawlkit", "about": "an asynchronous web crawler library",
     "task": "The crawler ignores the Crawl-delay directive of robots.txt and gets rate-limited by some sites. "
             "Make the scheduler honour Crawl-delay per host, with tests.",
     "modules": ["scheduler", "robots", "fetcher", "frontier", "parser", "throttle"]},
    {"package": "tablefmt", "about": "a library that renders tables for terminals and Markdown",
     "task": "Wide Unicode characters (CJK, emoji) break column alignment in the terminal renderer. Measure "
             "display width correctly and add tests for mixed-width content.",
     "modules": ["render", "width", "columns", "markdown", "styles", "cli"]},
    {"package": "jobqueue", "about": "a Redis-backed background job queue",
     "task": "Jobs that time out are retried immediately and forever. Add exponential backoff with a maximum "
             "number of attempts, configurable per queue, and document it.",
     "modules": ["worker", "queue", "retry", "serializer", "registry", "config"]},
    {"package": "geoindex", "about": "a spatial index for geographic points",
     "task": "Radius queries near the antimeridian (longitude +/-180) miss points on the other side. Fix the "
             "bounding-box computation and cover it with tests.",
     "modules": ["index", "geometry", "haversine", "tiles", "query", "io"]},
    {"package": "confload", "about": "a configuration loader with layered sources",
     "task": "Environment variables with a double underscore should override nested keys (APP__DB__HOST sets "
             "db.host), but they are ignored. Implement it and add tests.",
     "modules": ["loader", "sources", "merge", "schema", "env", "errors"]},
]
VERBS = ["load", "parse", "apply", "validate", "merge", "compute", "render", "fetch", "sync", "resolve", "build",
         "normalize", "register", "flush", "schedule", "encode", "decode", "split", "check", "update"]
NOUNS = ["entry", "batch", "record", "rate", "config", "cursor", "window", "token", "schema", "snapshot", "host",
         "delay", "column", "attempt", "bounds", "source", "request", "result", "cache", "limit"]
FOLLOW_UPS = [
    "Go on.", "OK, continue with the next step.", "Looks right. Keep going.",
    "Before changing anything, make sure you understand how {module} is used.",
    "Good. Don't forget the edge case where the value is missing.",
    "Please keep the change minimal; we want to backport it.",
    "That output is useful. What does it tell you about {module}?",
    "Check the tests for {module} as well.",
    "Fine. Remember we support Python 3.9, so no match statements.",
    "Continue, and tell me if you need a decision from me.",
]
TOOL_PHASES = [  # which tools an agent calls early in a session, in the middle, and at the end
    ["list_dir", "read_file", "grep", "read_file", "search_docs"],
    ["read_file", "edit_file", "run_tests", "grep", "run_shell", "write_file", "edit_file", "run_tests"],
    ["run_tests", "git_diff", "run_shell", "create_branch", "git_commit", "open_pr"],
]
TOOL_RESULT_TOKENS = (140, 240)  # each tool result's size is drawn from this range
# Characters per token of each tool's synthetic output below, for SmolLM2's tokenizer (measured).
CHARS_PER_TOKEN = {"read_file": 3.2, "write_file": 2.7, "edit_file": 3.2, "list_dir": 2.3, "grep": 2.55,
                   "run_tests": 3.5, "run_shell": 3.0, "git_diff": 2.8, "git_commit": 2.5, "search_docs": 3.9,
                   "create_branch": 2.75, "open_pr": 2.8}


class Session:
    """One scripted agent conversation: its messages grow turn by turn."""

    def __init__(self, seed: int, index: int):
        self.rng = random.Random(f"agent-trace:{seed}:{index}")
        self.id = f"session-{seed}-{index}-{self.rng.getrandbits(32):08x}"
        self.project = PROJECTS[(seed + index) % len(PROJECTS)]
        self.messages: list[dict] = []

    def add_turn(self, turn: int, turns: int) -> None:
        """Appends turn `turn` (1-based) of `turns`."""
        if turn == 1:
            self.messages += [{"role": "system", "content": SYSTEM_PROMPT},
                              {"role": "user", "content": f"Repository: {self.project['package']}, "
                                                          f"{self.project['about']}.\n\n{self.project['task']}"}]
            return
        name = self.pick_tool(turn, turns)
        arguments = self.arguments_for(name)
        call_id = f"call_{self.rng.getrandbits(96):024x}"
        self.messages += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": self.tool_result(name, arguments)},
            {"role": "user", "content": self.rng.choice(FOLLOW_UPS).format(module=self.module())},
        ]

    # -- what the agent does ---------------------------------------------------------------------

    def pick_tool(self, turn: int, turns: int) -> str:
        phase = min(len(TOOL_PHASES) - 1, (turn - 2) * len(TOOL_PHASES) // max(1, turns - 1))
        return self.rng.choice(TOOL_PHASES[phase])

    def module(self) -> str:
        return self.rng.choice(self.project["modules"])

    def path(self) -> str:
        return f"src/{self.project['package']}/{self.module()}.py"

    def identifier(self) -> str:
        return f"{self.rng.choice(VERBS)}_{self.rng.choice(NOUNS)}"

    def arguments_for(self, name: str) -> dict:
        package = self.project["package"]
        start = self.rng.randrange(1, 300)
        return {
            "read_file": lambda: {"path": self.path(), "start_line": start, "end_line": start + 80},
            "write_file": lambda: {"path": f"tests/test_{self.module()}_regression.py",
                                   "content": f"from {package} import {self.module()}\n\n\n"
                                              f"def test_{self.identifier()}():\n"
                                              f"    assert {self.identifier()}() is not None\n"},
            "edit_file": lambda: {"path": self.path(), "old_text": f"    return {self.identifier()}(value)",
                                  "new_text": f"    if value is None:\n        return None\n"
                                              f"    return {self.identifier()}(value)"},
            "list_dir": lambda: {"path": self.rng.choice([".", "src", f"src/{package}", "tests"]), "depth": 2},
            "grep": lambda: {"pattern": rf"def {self.identifier()}\b|{self.rng.choice(NOUNS)}_\w+", "glob": "*.py"},
            "run_tests": lambda: {"target": f"tests/test_{self.module()}.py", "fail_fast": False},
            "run_shell": lambda: {"command": self.rng.choice(["python -m mypy src", "ruff check src tests",
                                                              "python -m pip list", f"python -m {package} --help"])},
            "git_diff": lambda: {"paths": [self.path()]},
            "git_commit": lambda: {"message": f"Fix {self.identifier().replace('_', ' ')} in {self.module()}\n\n"
                                              f"{self.project['task'].split('.')[0]}."},
            "search_docs": lambda: {"query": f"{self.rng.choice(VERBS)} {self.rng.choice(NOUNS)} semantics",
                                    "library": self.rng.choice(["python", "pytest", "attrs", "httpx"])},
            "create_branch": lambda: {"name": f"fix/{self.rng.choice(NOUNS)}-{self.module()}"},
            "open_pr": lambda: {"title": f"Fix {self.rng.choice(NOUNS)} handling in {self.module()}",
                                "body": "## What\n\nFixes the bug described in the task.\n\n## Tests\n\nAdded a "
                                        "regression test; the full suite passes."},
        }[name]()

    # -- what the tools answer ---------------------------------------------------------------------

    def tool_result(self, name: str, arguments: dict) -> str:
        """A few hundred tokens of plausible output: lines until the drawn size is reached."""
        budget = self.rng.randint(*TOOL_RESULT_TOKENS) * CHARS_PER_TOKEN[name]
        lines = getattr(self, f"lines_{name}")(arguments)
        out, size = [next(lines)], 0
        for line in lines:
            size += len(line) + 1
            if size > budget:
                break
            out.append(line)
        return "\n".join(out)

    def code_lines(self, first_line: int = 1):
        """Numbered lines of a plausible Python module, forever."""
        n = first_line
        while True:
            fn, arg = self.identifier(), self.rng.choice(NOUNS)
            body = [f"def {fn}({arg}, *, strict: bool = False):",
                    f'    """{fn.replace("_", " ").capitalize()} for one {arg}; raises ValueError when strict."""',
                    f"    if {arg} is None:",
                    f"        return {self.rng.choice(['None', '[]', '0', 'default_' + arg])}",
                    f"    {self.rng.choice(NOUNS)} = {self.identifier()}({arg}.{self.rng.choice(NOUNS)})",
                    f"    if strict and not {self.identifier()}({arg}):",
                    f"        raise ValueError(f\"invalid {arg}: {{{arg}!r}}\")",
                    f"    return {self.identifier()}({arg}, limit={self.rng.randrange(2, 500)})",
                    ""]
            for line in body[:self.rng.randrange(4, len(body) + 1)] + [""]:
                yield f"{n:5d}\t{line}"
                n += 1

    def lines_read_file(self, arguments):
        return self.code_lines(arguments["start_line"])

    def lines_edit_file(self, arguments):
        yield f"Edited {arguments['path']}: 1 replacement. The region after the edit:"
        yield from self.code_lines(self.rng.randrange(10, 400))

    def lines_write_file(self, arguments):
        yield f"Wrote {arguments['path']} ({len(arguments['content'])} bytes). ruff check:"
        for n in range(1, 10**6):
            yield (f"{arguments['path']}:{n}:{self.rng.randrange(1, 40)}: {self.rng.choice(['F401', 'E501', 'I001'])}"
                   f" `{self.identifier()}` {self.rng.choice(['imported but unused', 'line too long', 'unsorted'])}")

    def lines_list_dir(self, arguments):
        package = self.project["package"]
        yield f"{arguments['path']}/"
        while True:
            folder = self.rng.choice([f"src/{package}", "tests", "docs", f"src/{package}/{self.module()}"])
            name = self.rng.choice([f"{self.module()}.py", f"test_{self.module()}.py", f"{self.rng.choice(NOUNS)}.md",
                                    f"{self.identifier()}.py"])
            yield f"  {folder}/{name}  {self.rng.randrange(1, 40)}.{self.rng.randrange(10)} KB"

    def lines_grep(self, arguments):
        while True:
            yield (f"{self.path()}:{self.rng.randrange(1, 900)}:    {self.rng.choice(NOUNS)} = "
                   f"{self.identifier()}({self.rng.choice(NOUNS)}, {self.rng.choice(NOUNS)}={self.rng.randrange(100)})")

    def lines_run_tests(self, arguments):
        target = arguments["target"]
        yield "=" * 29 + " test session starts " + "=" * 30
        yield f"collected {self.rng.randrange(8, 60)} items\n"
        for _ in range(self.rng.randrange(3, 8)):
            yield f"{target}::test_{self.identifier()} {self.rng.choice(['PASSED', 'PASSED', 'PASSED', 'FAILED'])}"
        yield "\n=================================== FAILURES ==================================="
        test = f"test_{self.identifier()}"
        yield f"______________________________ {test} ______________________________"
        while True:
            yield f"    {self.rng.choice(NOUNS)} = {self.identifier()}({self.rng.choice(NOUNS)})"
            yield f">   assert {self.rng.choice(NOUNS)}.{self.rng.choice(NOUNS)} == {self.rng.randrange(1000)}"
            yield (f"E   AssertionError: assert {self.rng.randrange(1000)} == {self.rng.randrange(1000)}\n"
                   f"{self.path()}:{self.rng.randrange(1, 900)}: AssertionError")

    def lines_run_shell(self, arguments):
        yield f"$ {arguments['command']}"
        while True:
            yield (f"{self.path()}:{self.rng.randrange(1, 900)}: error: Argument {self.rng.randrange(1, 4)} to "
                   f"\"{self.identifier()}\" has incompatible type \"{self.rng.choice(['str', 'int', 'None'])}\"; "
                   f"expected \"{self.rng.choice(NOUNS).capitalize()}\"  [arg-type]")

    def lines_git_diff(self, arguments):
        path = arguments["paths"][0]
        yield f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}"
        while True:
            start = self.rng.randrange(1, 800)
            yield f"@@ -{start},7 +{start},9 @@ def {self.identifier()}({self.rng.choice(NOUNS)}):"
            yield f"     {self.rng.choice(NOUNS)} = {self.identifier()}({self.rng.choice(NOUNS)})"
            yield f"-    return {self.identifier()}({self.rng.choice(NOUNS)})"
            yield f"+    if {self.rng.choice(NOUNS)} is None:\n+        return None"
            yield f"+    return {self.identifier()}({self.rng.choice(NOUNS)}, strict=True)"

    def lines_git_commit(self, arguments):
        yield f"[fix/{self.module()} {self.rng.getrandbits(28):07x}] {arguments['message'].splitlines()[0]}"
        yield (f" {self.rng.randrange(2, 9)} files changed, {self.rng.randrange(10, 200)} insertions(+), "
               f"{self.rng.randrange(1, 80)} deletions(-)")
        while True:
            yield f" {self.rng.choice(['create', 'modify'])} mode 100644 {self.path()}  ({self.identifier()})"

    def lines_search_docs(self, arguments):
        library = arguments["library"]
        while True:
            topic = self.identifier()
            yield (f"[{library}] {topic.replace('_', ' ').capitalize()} - "
                   f"https://docs.example.org/{library}/{topic}.html")
            yield (f"  {topic}() returns a new {self.rng.choice(NOUNS)}; the {self.rng.choice(NOUNS)} argument is "
                   f"optional and defaults to None. Raises {self.rng.choice(['ValueError', 'TypeError', 'KeyError'])} "
                   f"when the {self.rng.choice(NOUNS)} is out of range "
                   f"(added in version {self.rng.randrange(1, 5)}.{self.rng.randrange(20)}).")

    def lines_create_branch(self, arguments):
        yield f"Switched to a new branch '{arguments['name']}'"
        yield "git status:"
        while True:
            yield f"\tmodified:   {self.path()}"

    def lines_open_pr(self, arguments):
        yield f"Pushed branch. Opened pull request #{self.rng.randrange(100, 5000)}: {arguments['title']}"
        yield "Checks queued:"
        while True:
            check = self.rng.choice(["lint", "tests (3.9)", "tests (3.12)", "typecheck", "docs"])
            yield f"  - {check}: queued ({self.identifier()})"


# -- requests --------------------------------------------------------------------------------------


class RequestFailed(Exception):
    def __init__(self, status: int, response: str, body: dict):
        super().__init__(f"HTTP {status}: {response[:500]}")
        self.status, self.response, self.body = status, response, body


def request_body(messages: list[dict]) -> dict:
    return {"model": "default", "messages": messages, "tools": TOOLS, "tool_choice": "auto",
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def set_max_tokens(n: int) -> None:
    global MAX_TOKENS
    MAX_TOKENS = n


def is_role_chunk(chunk: dict) -> bool:
    """The first chunk of a chat stream: only the role, sent before any token exists."""
    choices = chunk.get("choices") or []
    return bool(choices) and all(
        not c.get("finish_reason") and set(c.get("delta", {})) <= {"role", "content"} and "role" in c["delta"]
        and not c["delta"].get("content") for c in choices)


def first_output_kind(chunk: dict) -> str | None:
    """What a chunk after the role chunk carries: tool_call, content, finish or empty; None for
    the usage chunk (no choices)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    delta = choices[0].get("delta") or {}
    if delta.get("tool_calls"):
        return "tool_call"
    return "content" if delta.get("content") else "finish" if choices[0].get("finish_reason") else "empty"


def stream_turn(http: httpx.Client, url: str, messages: list[dict], session_id: str | None) -> dict:
    """One streamed chat request: TTFT, latency, prompt and cached tokens. `session_id`: the
    session affinity key it carries (None: none)."""
    body = request_body(messages)
    t0 = time.perf_counter()
    ttft = first_kind = usage = None
    headers = {"x-session-affinity": session_id} if session_id is not None else {}
    with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RequestFailed(r.status_code, r.read().decode(errors="replace"), body)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RequestFailed(r.status_code, line, body)
            usage = chunk.get("usage") or usage
            if ttft is None and not is_role_chunk(chunk) and (kind := first_output_kind(chunk)):
                ttft, first_kind = time.perf_counter() - t0, kind
    latency = time.perf_counter() - t0
    if usage is None:
        raise RequestFailed(r.status_code, "the stream ended without a usage chunk", body)
    return {"ttft_s": ttft if ttft is not None else latency, "latency_s": latency, "first_chunk": first_kind,
            "decode_s": latency - (ttft if ttft is not None else latency),
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def run_session(url: str, session: Session, turns: int, delay: float, records: list, errors: list,
                lock: threading.Lock, affinity: str = "session") -> None:
    time.sleep(delay)
    with httpx.Client(timeout=600) as http:
        for turn in range(1, turns + 1):
            session.add_turn(turn, turns)
            try:
                key = {"session": session.id, "turn": f"{session.id}-{turn}", "none": None}[affinity]
                record = stream_turn(http, url, session.messages, key)
            except (RequestFailed, httpx.HTTPError) as e:
                with lock:
                    errors.append({"session": session.id, "turn": turn, "error": str(e),
                                   "status": getattr(e, "status", None), "response": getattr(e, "response", None),
                                   "request": getattr(e, "body", None)})
                print(f"  {session.id} turn {turn}: FAILED: {e}", file=sys.stderr, flush=True)
                return  # the rest of this session would only repeat the failure
            record.update(session=session.id, turn=turn)
            with lock:
                records.append(record)
            print(f"  {session.id} turn {turn:2d}: {record['prompt_tokens']:5d} prompt, "
                  f"{record['cached_tokens']:5d} cached, TTFT {1e3 * record['ttft_s']:7.0f} ms",
                  file=sys.stderr, flush=True)


def run_trace(url: str, args) -> tuple[list[dict], list[dict]]:
    sessions = [Session(args.seed, i) for i in range(args.sessions)]
    records, errors, lock = [], [], threading.Lock()
    threads = [threading.Thread(target=run_session, daemon=True,
                                args=(url, s, args.turns, i * SESSION_STAGGER_S, records, errors, lock,
                                      args.affinity))
               for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # joined in slices, so Ctrl-C gets through
            t.join(timeout=0.5)
    return records, errors


def measure_tool_prompt(url: str) -> int:
    """Prompt tokens of the system prompt and tools alone (plus the chat template's framing)."""
    body = {**request_body([{"role": "system", "content": SYSTEM_PROMPT}]), "stream": False, "max_tokens": 1}
    body.pop("stream_options")
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]


def warm_up(url: str, prefill_groups: int) -> None:
    """One short unrelated request through every prefill group, so that the trace's first turns
    do not pay for first-request set-up (and the trace's prefixes are not cached yet)."""
    for group in range(max(1, prefill_groups)):
        key = next(k for k in (f"warm-up-{i}" for i in range(1000))
                   if affinity_index(k, max(1, prefill_groups)) == group)
        body = {"model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": MAX_TOKENS,
                "temperature": 0}
        httpx.post(url + "/v1/chat/completions", json=body, headers={"x-session-affinity": key},
                   timeout=600).raise_for_status()


# -- the KV cache while the trace runs -------------------------------------------------------------


class KvSampler(threading.Thread):
    """Polls /metrics: the peak of KV pages in use, the pool size and preemptions (all groups
    summed in the disaggregated mode)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.peak_used, self.last = 0, {}

    def run(self):
        while not self.stop.wait(1.0):
            try:
                self.last = scrape_metrics(self.url)
                self.peak_used = max(self.peak_used, int(self.last.get("jfire_kv_pages_used", 0)))
            except httpx.HTTPError:
                pass

    def summary(self) -> dict:
        return {"kv_pages_total": int(self.last.get("jfire_kv_pages_total", 0)), "kv_pages_used_peak": self.peak_used,
                "preemptions": int(self.last.get("jfire_preemptions_total", 0))}


def scrape_metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# -- deployments -----------------------------------------------------------------------------------


def start(mode: str, port: int, log: Path, engine_args: list[str]) -> tuple[subprocess.Popen, str]:
    jfire = [sys.executable, "-m", "jfire.cli"]  # what .venv/bin/jfire runs
    common = ["--port", str(port), "--shutdown-grace", str(SHUTDOWN_GRACE_S), *engine_args]
    cmd = [*jfire, "serve", *common] if mode == "colocated" else [*jfire, "launch", DEPLOYMENT, *common]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **deployment_secret.to_env(SECRET)}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO, env=env,
                            start_new_session=True), f"http://127.0.0.1:{port}"


def stop(process: subprocess.Popen) -> None:
    """SIGTERM (the server drains and stops its own processes), then SIGKILL to the whole process
    group, for whatever is left (also when a second Ctrl-C cuts the wait short)."""
    try:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=SHUTDOWN_GRACE_S + 45)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float = 1200) -> dict:
    """The frontend's /health once it is 200 and every engine (the server's own, or each group's,
    at its control address) has compiled all its programs: engines serve while the rest compile in
    the background, which would compete with the trace for the CPU."""
    deadline = time.time() + timeout
    health = None
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}; see {log}")
        if health is None:
            health = health_if_ok(url)
        if health is not None:
            engines = [g["control"] for g in health.get("groups", {}).values()] or [url]
            if all((h := health_if_ok(engine)) is not None and not h.get("compiling") for engine in engines):
                return health
        time.sleep(0.5)
    raise SystemExit(f"server not ready in {timeout:g} s; see {log}")


def health_if_ok(url: str) -> dict | None:
    try:
        r = httpx.get(url + "/health", headers=CONTROL_AUTH, timeout=2)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


# -- report ----------------------------------------------------------------------------------------


def summarize(records: list[dict], turns: int) -> dict:
    per_turn = []
    for turn in range(1, turns + 1):
        rs = [r for r in records if r["turn"] == turn]
        if rs:
            per_turn.append({"turn": turn, "sessions": len(rs),
                             "ttft_p50_ms": 1e3 * statistics.median(r["ttft_s"] for r in rs),
                             "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rs),
                             "cached_tokens_mean": statistics.mean(r["cached_tokens"] for r in rs)})
    by_turn = {t["turn"]: t for t in per_turn}
    prompt = sum(r["prompt_tokens"] for r in records)
    growth = (by_turn[turns]["ttft_p50_ms"] / by_turn[2]["ttft_p50_ms"]
              if turns >= 2 and turns in by_turn and 2 in by_turn else None)
    later = [r for r in records if r["turn"] > 1]  # turns whose prompt extends one sent before
    later_prompt = sum(r["prompt_tokens"] for r in later)
    return {"per_turn": per_turn, "requests": len(records),
            "later_turns_hit_ratio": sum(r["cached_tokens"] for r in later) / later_prompt if later_prompt else None,
            "later_turns_ttft_p50_ms": 1e3 * statistics.median(r["ttft_s"] for r in later) if later else None,
            "prompt_tokens": prompt, "cached_tokens": sum(r["cached_tokens"] for r in records),
            "hit_ratio": sum(r["cached_tokens"] for r in records) / prompt if prompt else None,
            "ttft_last_over_second": growth,
            "last_turn_prompt_tokens_max": max((r["prompt_tokens"] for r in records if r["turn"] == turns),
                                               default=None),
            "first_chunks": {k: sum(r["first_chunk"] == k for r in records)
                             for k in ("content", "tool_call", "finish", "empty")},
            # Tokens after the first over the time after it, over every request.
            "decode_tokens_per_s": (sum(max(0, (r["completion_tokens"] or 0) - 1) for r in records)
                                    / max(1e-9, sum(r["decode_s"] for r in records)))}


def print_mode(mode: str, result: dict) -> None:
    s, kv = result["summary"], result["summary"]["kv"]
    print(f"\n{mode}: {result['sessions']} sessions x {result['turns']} turns in {result['seconds']:.0f} s; "
          f"system prompt + tools {result['tool_prompt_tokens']} tokens; last turn's prompt at most "
          f"{s['last_turn_prompt_tokens_max']} tokens")
    print(f"  KV cache: {kv['kv_pages_total']} pages, at most {kv['kv_pages_used_peak']} in use; "
          f"{kv['preemptions']} preemptions")
    if result["session_groups"] and result.get("affinity", "session") == "session":
        print("  prefill group per session: " + ", ".join(f"{k} {v}" for k, v in result["session_groups"].items()))
    if s.get("routing"):
        print("  routing: " + ", ".join(f"{k} {v}" for k, v in s["routing"].items()))
    print(f"{'turn':>6} {'TTFT p50 ms':>12} {'prompt':>8} {'cached':>8} {'hit':>7}")
    for t in s["per_turn"]:
        hit = t["cached_tokens_mean"] / t["prompt_tokens_mean"] if t["prompt_tokens_mean"] else 0
        print(f"{t['turn']:6d} {t['ttft_p50_ms']:12.0f} {t['prompt_tokens_mean']:8.0f} "
              f"{t['cached_tokens_mean']:8.0f} {hit:7.1%}")
    if s["later_turns_hit_ratio"] is not None:
        print(f"  turns 2 and later: {s['later_turns_hit_ratio']:.1%} of prompt tokens from cache, "
              f"TTFT p50 {s['later_turns_ttft_p50_ms']:.0f} ms")
    print(f"  {hit_ratio_text(s)}; {ttft_growth_text(s)}; first chunk after the role: "
          + ", ".join(f"{k} {v}" for k, v in s["first_chunks"].items()))
    print(f"  decode {s['decode_tokens_per_s']:.1f} tokens/s (tokens after each request's first over the time "
          "after it)" + (f"; speculation: {s['speculation']['accepted']:.0f} of {s['speculation']['drafted']:.0f} "
                         f"draft tokens kept, {s['speculation']['mean_accepted_length']:.2f} tokens a verified step"
                         if s.get("speculation") else ""))
    if result["errors"]:
        print(f"  {len(result['errors'])} requests FAILED (the output file's errors list them)")


def hit_ratio_text(summary: dict) -> str:
    ratio = summary["hit_ratio"]
    if ratio is None:
        return "hit ratio n/a"
    return f"hit ratio {ratio:.1%} ({'ok' if ratio >= GOAL_HIT_RATIO else 'MISSED'}: goal >= {GOAL_HIT_RATIO:.0%})"


def ttft_growth_text(summary: dict) -> str:
    growth = summary["ttft_last_over_second"]
    if growth is None:
        return "last/second turn TTFT n/a"
    verdict = "ok" if growth <= GOAL_TTFT_GROWTH else "MISSED"
    return f"last/second turn TTFT {growth:.2f} ({verdict}: goal <= {GOAL_TTFT_GROWTH:g})"


def print_summary(results: dict) -> None:
    print()
    for text in (hit_ratio_text, ttft_growth_text):
        print("; ".join(f"{mode}: {text(r['summary'])}" for mode, r in results.items()))


# -- main ------------------------------------------------------------------------------------------


def run_mode(mode: str, args) -> dict:
    log = Path(f"/tmp/jfire-agent-trace-{mode}.log")
    port = args.port or free_port()
    print(f"{mode}: starting (log {log}) ...", file=sys.stderr, flush=True)
    engine_args = shlex.split(args.engine_args) if args.engine_args is not None else ENGINE_ARGS
    if mode == "speculative":  # colocated, drafting from the session's own text
        engine_args = [*engine_args, "--speculative", "suffix"]
    process, url = start("colocated" if mode == "speculative" else mode, port, log, engine_args)
    try:
        health = wait_ready(url, process, log)
        prefill_groups = sorted(n for n, g in health.get("groups", {}).items() if g["role"] == "prefill")
        warm_up(url, len(prefill_groups))
        print(f"{mode}: running {args.sessions} sessions x {args.turns} turns ...", file=sys.stderr, flush=True)
        sampler = KvSampler(url)
        sampler.start()
        t0 = time.time()
        records, errors = run_trace(url, args)
        seconds = time.time() - t0
        sampler.stop.set()
        sampler.join()
        summary = summarize(records, args.turns)
        summary["kv"] = sampler.summary()
        metrics = scrape_metrics(url)
        if metrics.get("jfire_spec_draft_tokens_total"):
            summary["speculation"] = {"drafted": metrics["jfire_spec_draft_tokens_total"],
                                      "accepted": metrics["jfire_spec_accepted_tokens_total"],
                                      "mean_accepted_length": metrics["jfire_spec_mean_accepted_length"]}
        summary["routing"] = {k: int(metrics[f"jfire_{k}_total"])
                              for k in ("routed_by_prefix", "routed_by_affinity", "routed_by_load", "prefix_fetches",
                                        "shared_kv_blocks_received")
                              if f"jfire_{k}_total" in metrics and mode == "disaggregated"}
        sessions = [Session(args.seed, i).id for i in range(args.sessions)]
        return {"mode": mode, "sessions": args.sessions, "turns": args.turns, "seconds": seconds,
                "affinity": args.affinity,
                "engine_args": engine_args, "tool_prompt_tokens": measure_tool_prompt(url),
                "session_groups": {s: prefill_groups[affinity_index(s, len(prefill_groups))] for s in sessions}
                if prefill_groups else None,
                "summary": summary, "records": sorted(records, key=lambda r: (r["session"], r["turn"])),
                "errors": errors}
    finally:
        stop(process)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="colocated,disaggregated",
                   help="comma-separated: colocated, disaggregated, speculative (colocated with --speculative suffix)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help=f"tokens a turn may generate (default {MAX_TOKENS}: the trace measures prefill; more lets "
                   "the model write its calls and answers, as the speculative mode's comparison wants)")
    p.add_argument("--sessions", type=int, default=4, help="concurrent agent sessions")
    p.add_argument("--turns", type=int, default=20, help="requests per session")
    p.add_argument("--seed", type=int, default=0, help="the trace is the same for the same seed")
    p.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    p.add_argument("--output", default="bench-agent-trace.json", help="where the results go (JSON)")
    p.add_argument("--affinity", choices=("session", "turn", "none"), default="session",
                   help="the x-session-affinity key each request carries: the session's (default), a new one "
                   "every turn (a session's turns spread over the prefill groups, as behind a load balancer "
                   "with no stickiness), or none (the frontend routes by prefix, if on, and load)")
    p.add_argument("--engine-args", default=None,
                   help=f"engine flags instead of the default ({' '.join(ENGINE_ARGS)}), e.g. a smaller "
                   "--kv-cache-gb with --host-kv-gb (colocated only)")
    args = p.parse_args()
    if args.sessions < 1 or args.turns < 1:
        p.error("--sessions and --turns must be >= 1")
    modes = args.modes.split(",")
    if unknown := set(modes) - {"colocated", "disaggregated", "speculative"}:
        p.error(f"unknown mode(s): {', '.join(sorted(unknown))}")
    set_max_tokens(args.max_tokens)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the servers
    results = {}
    for mode in modes:
        results[mode] = run_mode(mode, args)
        print_mode(mode, results[mode])
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print_summary(results)
    return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
