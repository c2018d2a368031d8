"""Offline batch mode: a JSONL file of prompts through the continuous-batching engine.

Each input line is an object with one of "prompt" (text), "prompt_ids" (ints) or
"messages" (chat), and optional sampling fields (max_tokens, temperature, top_p, top_k,
seed, stop). Each output line carries the input's index, the ids, the text and why it ended.
Every line is parsed and checked before any work starts, so a bad line costs nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import grain
from tqdm import tqdm

from jfire.engine import Engine
from jfire.errors import JfireError
from jfire.sampling import SamplingParams

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


class JsonlSource(grain.sources.RandomAccessDataSource):
    """Random access to the lines of a JSONL file (blank lines skipped), for grain."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offsets = []
        with open(self.path, "rb") as f:
            offset = 0
            for line in f:
                if line.strip():
                    self._offsets.append(offset)
                offset += len(line)

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        with open(self.path, "rb") as f:
            f.seek(self._offsets[index])
            return index, f.readline()


def parse_line(item: tuple[int, bytes], defaults: SamplingParams, tokenizer) -> tuple[int, list[int], SamplingParams]:
    index, raw = item
    where = f"line {index + 1}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise JfireError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise JfireError(f"{where} must be a JSON object with 'prompt', 'prompt_ids' or 'messages'")
    given = [k for k in ("prompt", "prompt_ids", "messages") if k in obj]
    if len(given) != 1:
        raise JfireError(f"{where} needs exactly one of 'prompt', 'prompt_ids' or 'messages', got {given or 'none'}")
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise JfireError(f"{where}: 'prompt_ids' must be a list of integers")
    elif tokenizer is None:
        raise JfireError(f"{where}: this model has no tokenizer; use 'prompt_ids'")
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise JfireError(f"{where}: 'prompt' must be a string")
        ids = tokenizer.encode(obj["prompt"])
    else:
        ids = tokenizer.encode_chat(obj["messages"])
    overrides = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    if isinstance(overrides.get("stop"), str):
        overrides["stop"] = (overrides["stop"],)
    elif "stop" in overrides:
        overrides["stop"] = tuple(overrides["stop"])
    try:
        sampling = dataclasses.replace(defaults, **overrides)
    except (TypeError, JfireError) as e:
        raise JfireError(f"{where}: {e}") from None
    return index, ids, sampling


def read_requests(
    prompts_file: Path, defaults: SamplingParams, tokenizer
) -> list[tuple[int, list[int], SamplingParams]]:
    """Every line parsed (with grain) into (index, prompt ids, sampling), or a JfireError naming the line."""
    if not Path(prompts_file).is_file():
        raise JfireError(f"prompts file {prompts_file} does not exist")
    dataset = grain.MapDataset.source(JsonlSource(prompts_file)).map(lambda item: parse_line(item, defaults, tokenizer))
    return list(dataset)


def validate_requests(engine: Engine, requests) -> None:
    """Checks every request against the engine's limits before anything is compiled or run."""
    for index, ids, sampling in requests:
        try:
            engine.validate(ids, sampling)
        except JfireError as e:
            raise JfireError(f"line {index + 1}: {e}") from None


def run_requests(engine: Engine, requests, write: Callable[[dict], None], progress: bool = True) -> int:
    """Runs every request on a started engine; `write` receives results in input order."""
    # Submit within the waiting bound; the engine batches whatever is queued.
    handles, next_up = {}, 0
    bar = tqdm(total=len(requests), desc="generating", unit="prompt", disable=not progress)
    for done in range(len(requests)):
        while next_up < len(requests) and len(handles) < engine.config.max_waiting:
            index, ids, sampling = requests[next_up]
            handles[index] = engine.submit(ids, sampling)
            next_up += 1
        index = requests[done][0]
        result = handles.pop(index).result()
        bar.update()
        write(
            {
                "index": index,
                "prompt_ids": result.prompt_ids,
                "token_ids": result.token_ids,
                "text": result.text,
                "finish_reason": result.finish_reason,
            }
        )
    bar.close()
    return len(requests)
