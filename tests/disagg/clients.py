"""Sending the shared test prompts through the OpenAI client."""

from __future__ import annotations

import openai


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
