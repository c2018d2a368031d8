"""`--keep-compressed` in bfloat16 on one CPU device: a model's layer weights palette-coded in
memory and multiplied coded (jfire.kernels.cpu_palette), whatever the checkpoint held."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jfire.errors import JfireError
from jfire.kernels import cpu_matmul
from jfire.kernels.cpu_palette import BLOCK_COLS, BLOCK_ROWS, encode, encode_table, fits
from jfire.models.llama import LlamaConfig


def code_params(params: dict, config) -> dict:
    """params with every layer-stacked linear weight of a Llama-family model (bfloat16, whole
    blocks) in the coded form, and a tied embedding (looked up and multiplied as the output
    head) as a coded table; the rest (norms, weights too narrow, an untied head) as they were.
    Other families read their stacks in ways the coded form does not serve yet: refused."""
    if not isinstance(config, LlamaConfig):
        raise JfireError(
            f"--keep-compressed on the CPU serves Llama-family models only; {type(config).__name__} "
            "is not one (load it without --keep-compressed)"
        )
    if not cpu_matmul.available():
        raise JfireError(
            "--keep-compressed on the CPU needs jfire's CPU kernels, which did not build here (see the warning)"
        )
    out = jax.tree.map(lambda x: x, params)  # a new tree of the same leaves
    coded = 0
    for spec in config.param_specs():
        if not spec.per_layer or spec.n_in is None or spec.per_expert or spec.dtype is not None:
            continue
        *parents, name = spec.name.split(".")
        node = out
        for key in parents:
            node = node[key]
        leaf = node[name]
        if leaf.dtype == jnp.bfloat16 and fits(tuple(leaf.shape), spec.n_in):
            node[name] = encode(np.asarray(leaf), spec.n_in)
            coded += 1
    embed = out["embed"]
    if config.tie_word_embeddings and embed.dtype == jnp.bfloat16 and fits((1, *embed.shape), 1):
        out["embed"] = encode_table(np.asarray(embed))
    if not coded:
        raise JfireError(
            f"--keep-compressed: none of this model's layer weights splits into blocks of {BLOCK_ROWS} x "
            f"{BLOCK_COLS} values (inputs a multiple of {BLOCK_ROWS}, outputs of {BLOCK_COLS})"
        )
    return out
