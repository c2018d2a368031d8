"""A small random Llama whose matrices are just large enough to be stored compressed."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.tiny_models import COMMON


@pytest.fixture(scope="session")
def compressible_hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("compressible") / "hf"
    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 512,
                                         "initializer_range": 0.02})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path
