"""Images through a split deployment: `jfire launch local-1p1d` of the tiny random Llama 4 with
its vision tower (tests/serve/test_images_api.py's model and chat template), talked to with the
official openai client.

The frontend preprocesses the image and expands its placeholders (it loads no encoder), the
prefill group encodes it and prefills, the decode group decodes from the KV it pulled and never
sees pixels. The tokens equal transformers' `generate` on the same image and text (the same
reference the colocated server's test holds `jfire serve` to), and the same image again is
served from the prefill group's encoder cache.
"""

from __future__ import annotations

import pytest

from tests.disagg.clients import client as openai_client
from tests.disagg.deployment_process import assert_quiet, deployment_file, launch
from tests.serve.test_images_api import (  # noqa: F401  (fixtures)
    MAX_TOKENS,
    MODEL,
    data_url,
    image_message,
    image_png,
    model_dir,
    transformers_tokens,
)


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("local-1p1d-images")
    running = launch(
        deployment_file(tmp, "local-1p1d", timeout_s=30),
        tmp / "launch.log",
        extra=("--model", str(model_dir), "--served-model-name", MODEL, "--max-context", "256", "--quick-compile"),
    )
    yield running
    code = running.stop()
    assert code == 0, running.log.read_text()[-3000:]
    assert_quiet(running.log)


def chat(url: str, messages) -> tuple[list[int], list[int]]:
    r = openai_client(url, timeout=120).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    return r.prompt_token_ids, r.choices[0].token_ids


def test_an_image_through_the_split_deployment_equals_transformers(deployment, model_dir, image_png):  # noqa: F811
    want_prompt, want = transformers_tokens(model_dir, image_png)
    for _ in range(2):
        prompt_ids, got = chat(deployment.url, image_message(data_url(image_png)))
        assert prompt_ids == want_prompt and got == want
    prefill, decode = deployment.stats("prefill"), deployment.stats("decode")
    assert (prefill["images"], prefill["images_encoded"]) == (2, 1)  # the second from its cache
    assert "images" not in decode  # the decode group has no encoder and took no pixels
