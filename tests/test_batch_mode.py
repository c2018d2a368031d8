"""`jfire generate --prompts-file`: a JSONL file through the batching engine gives, line for
line and in input order, what each prompt gives run alone; a bad line stops it up front."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.sampling import SamplingParams

LINES = [
    {"prompt": "The capital of Italy is"},
    {"prompt_ids": [504, 3575, 282, 4649, 314], "max_tokens": 5},
    {"messages": [{"role": "user", "content": "Name a colour."}]},
    {"prompt": "Counting: one, two,", "stop": ","},
    {"prompt": "Roses are red,", "temperature": 0.8, "seed": 7},
]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jfire.cli", "generate", *args], capture_output=True, text=True,
                          timeout=600)


def test_prompts_file_equals_each_prompt_alone(default_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in LINES) + "\n\n")  # a trailing blank line is fine
    out = tmp_path / "out.jsonl"
    # Small limits keep the ahead-of-time bucket set (and so the test) short.
    run = run_cli("--prompts-file", str(prompts), "--output", str(out), "--max-tokens", "10", "--max-batch", "4",
                  "--prefill-budget", "32", "--max-context", "256", "--compile-cache", str(tmp_path / "xla"))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(LINES)))

    model = load_model("default", "float32")
    tok = model.tokenizer
    with Engine(model, EngineConfig(max_batch=1, max_prefill_rows=1, aot=False)) as engine:
        for line, row in zip(LINES, rows):
            if "prompt" in line:
                ids = tok.encode(line["prompt"])
            elif "messages" in line:
                ids = tok.encode_chat(line["messages"])
            else:
                ids = line["prompt_ids"]
            stop = line.get("stop")
            sampling = SamplingParams(temperature=line.get("temperature", 0.0), seed=line.get("seed"),
                                      max_tokens=line.get("max_tokens", 10), stop=(stop,) if stop else ())
            alone = engine.generate([(ids, sampling)])[0]
            assert row["prompt_ids"] == ids
            assert (row["token_ids"], row["text"], row["finish_reason"]) == (
                alone.token_ids, alone.text, alone.finish_reason)


@pytest.mark.parametrize("bad,why", [
    ('{"prompt": "ok"}\n{"prompt": 5}\n', "line 2: 'prompt' must be a string"),
    ('{"prompt": "ok"}\nnot json\n', "line 2 is not valid JSON"),
    ('{"prompt": "ok", "top_p": 3}\n', "line 1: top_p must be in"),
    ('{"text": "hi"}\n', "line 1 needs exactly one of"),
    ('{"prompt_ids": [1, "x"]}\n', "line 1: 'prompt_ids' must be a list of integers"),
])
def test_bad_lines_are_named(default_checkpoint, tmp_path, bad, why):
    from jfire.batch import read_requests
    from jfire.errors import JfireError

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(bad)
    tokenizer = load_model("default", "float32").tokenizer
    with pytest.raises(JfireError) as err:
        read_requests(prompts, SamplingParams(temperature=0.0, max_tokens=4), tokenizer)
    assert why in str(err.value)


def test_a_bad_line_stops_the_cli_before_any_work(default_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt_ids": [1, 2], "max_tokens": 100000}\n')
    out = tmp_path / "out.jsonl"
    run = run_cli("--prompts-file", str(prompts), "--output", str(out), "--max-tokens", "4")
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("jfire: error: line 2: ") and "max_tokens" in last, run.stderr
    assert "Traceback" not in run.stderr
    assert not out.exists()
