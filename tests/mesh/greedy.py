"""A model on a mesh against one device, the way the mesh tests compare them: ragged prompts
prefilled through the compiled programs, then greedy decode steps, every step's logits kept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jfire import mesh as meshes
from jfire import sharding
from jfire.kv_cache import init_pages
from jfire.models.family import Parallel
from jfire.pipeline import Pipeline
from tests import greedy_programs

LENGTHS = [12, 5, 9, 1]  # one prompt per row
ROWS, STEPS = len(LENGTHS), 6


def setup(cfg, host, spec_text, num_pages: int, page_size: int):
    """(cfg adapted to the mesh, params, pages, pipeline or None, Parallel or None, mesh or None);
    spec_text None is one device."""
    if spec_text is None:
        return cfg, jax.device_put(host), init_pages(cfg, num_pages, page_size, jnp.float32), None, None, None
    spec = meshes.MeshSpec.inline(spec_text)
    meshes.check_fits(spec, cfg, jax.device_count())
    mesh = meshes.build(spec)
    wide, params, _ = sharding.adapt_to_mesh(cfg, sharding.place(host, cfg, mesh), mesh)
    pages = init_pages(wide, num_pages, page_size, jnp.float32, sharding.cache_shardings(wide, mesh))
    stack = Pipeline(mesh, spec.num_microbatches) if spec.pp > 1 else None
    return wide, params, pages, stack, Parallel(mesh), mesh


def run_greedy(cfg, host, spec_text, table: np.ndarray, *, num_pages: int, page_size: int):
    """(per-step logits [rows, vocab], tokens [steps + 1, rows]) for LENGTHS-long random prompts
    whose rows use the pages in `table` [rows, pages per row]."""
    cfg, params, pages, stack, parallel, _ = setup(cfg, host, spec_text, num_pages, page_size)
    rng = np.random.default_rng(0)
    tokens = np.zeros((ROWS, 16), np.int32)
    positions = np.full((ROWS, 16), -1, np.int32)
    for r, n in enumerate(LENGTHS):
        tokens[r, :n] = rng.integers(0, cfg.vocab_size, n)
        positions[r, :n] = np.arange(n)
    ids, logits, pages = greedy_programs.prefill(params, pages, tokens, positions, table, np.array(LENGTHS) - 1,
                                                 cfg=cfg, layer_stack=stack, parallel=parallel)
    all_logits, all_ids = [np.asarray(logits)], [np.asarray(ids)]
    pos = np.array(LENGTHS, np.int32)
    for _ in range(STEPS):
        ids, logits, pages = greedy_programs.decode(params, pages, np.asarray(ids), pos, table, cfg=cfg,
                                                    layer_stack=stack, parallel=parallel)
        all_logits.append(np.asarray(logits))
        all_ids.append(np.asarray(ids))
        pos = pos + 1
    return all_logits, np.stack(all_ids)


def assert_same_run(got, want, tol=1e-4):
    """Every step's logits within tol per row (one bad row cannot hide behind the others), and
    the same tokens."""
    (logits, ids), (ref_logits, ref_ids) = got, want
    for step, (g, w) in enumerate(zip(logits, ref_logits)):
        for row in range(ROWS):
            err = np.linalg.norm(g[row] - w[row]) / np.linalg.norm(w[row])
            assert err < tol, (step, row, err)
    np.testing.assert_array_equal(ids, ref_ids)
