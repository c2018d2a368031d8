"""The shared test prompts, and sending them through the OpenAI client."""

from __future__ import annotations

import itertools

import openai

from jfire.disagg.frontend import affinity_index

# Several page lengths (1 to 7 pages of 16 tokens), a chat prompt, and a stop string.
PROMPTS = [
    {"prompt": "The capital of France is", "max_tokens": 16},
    {"prompt": "Write a short poem about the sea and the wind. " * 4, "max_tokens": 16},
    {"prompt": "List three prime numbers: 2, 3,", "max_tokens": 12},
    {"messages": [{"role": "user", "content": "What is the boiling point of water in Celsius?"}],
     "max_tokens": 16},
    {"prompt": ("In a quiet village by the mountains there lived an old clockmaker who "
                "repaired every clock in the valley. ") * 4, "max_tokens": 16, "stop": ["."]},
]


def client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **kw)


def ask(url: str, prompt: dict, **extra) -> tuple[str, int, int, str]:
    """(text, prompt tokens, completion tokens, finish reason), greedy."""
    c = client(url)
    common = dict(model="default", max_tokens=prompt["max_tokens"], temperature=0, stop=prompt.get("stop"), **extra)
    if "messages" in prompt:
        r = c.chat.completions.create(messages=prompt["messages"], **common)
        text = r.choices[0].message.content
    else:
        r = c.completions.create(prompt=prompt["prompt"], **common)
        text = r.choices[0].text
    return text, r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason


def assert_same_as_colocated(url: str, prompts: list[dict], reference: list[dict], **extra) -> list[int]:
    """Every prompt's greedy output equals colocated generation; returns the prompt lengths."""
    lengths = []
    for prompt, ref in zip(prompts, reference):
        text, n_prompt, n_out, finish = ask(url, prompt, **extra)
        assert (text, n_prompt, n_out, finish) == (ref["text"], len(ref["prompt_ids"]), len(ref["token_ids"]),
                                                   ref["finish_reason"]), prompt
        lengths.append(n_prompt)
    return lengths


def key_for(group_index: int, live_groups: int = 2) -> str:
    """A session key the frontend routes to prefill group number group_index (by name order)."""
    return next(k for k in (f"session-{i}" for i in itertools.count()) if affinity_index(k, live_groups) == group_index)
