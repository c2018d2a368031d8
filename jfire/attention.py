"""The attention backend of the programs: the models' own (the reference, with the CPU kernel
where it applies) or the Pallas kernels, chosen in one place for decode, prefill and verify."""

from __future__ import annotations

import dataclasses

from jfire.engine_config import ATTENTION_IMPLS
from jfire.errors import JfireError
from jfire.kernels.paged_attention import paged_attention, paged_prefill_attention


def decode_attention(attention: str, mesh=None):
    """The one place the attention backend of the programs (decode and prefill) is chosen:
    the model's attention hook, None (the reference) or the Pallas kernels. Refuses a name it
    does not know, and the kernels on a tensor-parallel mesh (they run on one device per group)."""
    if attention not in ATTENTION_IMPLS:
        raise JfireError(f"unknown attention {attention!r}; use one of {', '.join(ATTENTION_IMPLS)}")
    if attention != "reference" and mesh is not None and mesh.shape["tp"] > 1:
        raise JfireError(
            "the Pallas attention kernel runs on one device per tensor-parallel group only; "
            "use --attention reference with tp > 1"
        )
    return None if attention == "reference" else PallasAttention(interpret=attention == "pallas-interpret")


@dataclasses.dataclass(frozen=True)
class PallasAttention:
    """The Pallas attention kernels, called as grouped-query attention over K/V pages
    (`attention_impl(q, k_pages, v_pages, ...)`), and as `mla`, the latent-cache kernels that
    multi-head latent attention families look for: each the decode kernel for one query a row,
    the prefill flash kernel for chunks."""

    interpret: bool = False

    def __call__(self, q, k_pages, v_pages, layer, page_table, positions, sliding_window=None, chunk=None):
        if q.shape[1] > 1:
            return paged_prefill_attention(
                q, k_pages, v_pages, layer, page_table, positions, sliding_window, chunk, interpret=self.interpret
            )
        out = paged_attention(
            q[:, 0],
            k_pages,
            v_pages,
            layer,
            page_table,
            positions[:, 0] + 1,
            sliding_window=sliding_window,
            chunk=0 if chunk is None else chunk,
            interpret=self.interpret,
        )
        return out[:, None]

    def mla(self, q_latent, q_rope, cache, layer, page_table, positions, *, scale, first_page=0, expand=None):
        """The partial (acc, m, l) of jfire.kernels.mla_attention; with `expand` = (q_nope,
        wkv_b) (jfire.models.mla.prefill_expanded chose it for a long chunk), the expanded
        form's partial, in the value space (q_latent unused)."""
        from jfire.kernels.mla_attention import mla_expanded_prefill, mla_paged_decode, mla_paged_prefill

        if expand is not None:
            q_nope, wkv_b = expand
            return mla_expanded_prefill(
                q_nope,
                q_rope,
                wkv_b,
                cache,
                layer,
                page_table,
                positions,
                scale=scale,
                first_page=first_page,
                interpret=self.interpret,
            )
        if q_latent.shape[1] > 1:
            return mla_paged_prefill(
                q_latent,
                q_rope,
                cache,
                layer,
                page_table,
                positions,
                scale=scale,
                first_page=first_page,
                interpret=self.interpret,
            )
        acc, m, l = mla_paged_decode(
            q_latent[:, 0],
            q_rope[:, 0],
            cache,
            layer,
            page_table,
            positions[:, 0] + 1,
            scale=scale,
            first_page=first_page,
            interpret=self.interpret,
        )
        return acc[:, None], m[:, None], l[:, None]
