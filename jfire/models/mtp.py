"""DeepSeek-V3's multi-token-prediction (MTP) layer, run as a draft model.

DeepSeek-V3 ships `num_nextn_predict_layers` (1) extra layer after its decoder, stored as layer
`num_hidden_layers` (`model.layers.61.*`). From the target's hidden state at position t and
the token at t + 1 it predicts the token at t + 2, as transformers' `MtpModel`
(modeling_layers.py, behind `generate(use_mtp=True)`) computes it:

    e      = enorm(embed(x[t + 1]))          the target's own embedding
    h      = hnorm(h[t])                     the target's last hidden state, after its final norm
    u      = eh_proj(concat(e, h))           [2e] -> [e]: the embedding half first
    u      = decoder layer(u)                MLA over the MTP's own latent cache, routed experts
    out    = shared_head.norm(u)             the draft's hidden state (chained drafts feed it back)
    logits = lm_head(out)                    the target's LM head

The decoder layer is an ordinary DeepSeek-V3 layer: its parameters are declared by
`DeepseekV3Config` and it runs through `jfire.models.mla.run_segment`, so the attention
kernels, expert dispatch and quantized experts are the target's. transformers always builds
it with routed experts; the config's rule (layer index >= `first_k_dense_replace`) gives the
same for every released model. The checkpoint's copies of the embedding and the head
(`embed_tokens`, `shared_head.head`) equal the target's and are not read: transformers, vLLM
and SGLang all use the target's.

Positions. The MTP's cache is indexed like the target's: the entry for the pair (h[t],
x[t + 1]) is written at position t, the page and slot of the target's token t, so one page
table serves both and the MTP's first entry sits at position 0. transformers rotates that
pair at t + 1 instead; rotary attention depends only on the distance between query and key,
so rotating every query and key one position earlier gives the same attention (to float
rounding).

Einsum letters: b batch, t tokens, e embed, i eh_proj's input (2e).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp

from jfire.checkpoint import store
from jfire.checkpoint.load import LoadedModel, resolve_model_path
from jfire.checkpoint.read import open_source, parse_dtype, read_params
from jfire.errors import JfireError
from jfire.models import mla
from jfire.models.blocks import rms_norm
from jfire.models.deepseek import DeepseekV3Config
from jfire.models.family import CacheSpec, Family, MeshShape, Segment
from jfire.models.params import ParamSpec

CACHE = "mtp_latent"  # the MTP's cache array, named apart from the target's
_SEGMENT_CACHE = "latent_dense"  # what mla.run_segment calls an unpiped segment's latent


@dataclasses.dataclass(frozen=True)
class MtpConfig(Family):
    """The MTP layer of a DeepSeek-V3 target: its parameter and cache declarations, read by
    the checkpoint reader and the sharding rules like a family's. Not a registered family:
    it has no decoder of its own and runs only through `mtp_forward`."""

    family: ClassVar[str] = "deepseek_v3_mtp"

    target: DeepseekV3Config
    kind: str  # the decoder layer's MLP: "moe" (routed experts) or "dense"

    @property
    def layer(self) -> int:
        """The layer index the checkpoint stores the MTP layer under."""
        return self.target.num_layers

    @property
    def segment(self) -> Segment:
        # Outside the pipeline (every stage holds the one layer), layer 0 of its own cache array.
        return Segment("layer", self.layer, 1, self.kind, piped=False, cache_offset=0)

    def segments(self) -> tuple[Segment, ...]:
        return (self.segment,)

    def param_specs(self) -> tuple[ParamSpec, ...]:
        E = self.target.hidden_size
        pre = f"{self.target.hf_prefix}model.layers.{self.layer}."
        return (
            ParamSpec("enorm", (E,), ("embed",), pre + "enorm.weight", None, init="ones"),
            ParamSpec("hnorm", (E,), ("embed",), pre + "hnorm.weight", None, init="ones"),
            ParamSpec("eh_proj", (2 * E, E), ("embed", "embed"), pre + "eh_proj.weight", None, n_in=1),
            ParamSpec("head_norm", (E,), ("embed",), pre + "shared_head.norm.weight", None, init="ones"),
            *self.target._layer_specs(self.segment),
        )

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """One layer of latent + rope key per token, in the target's page format."""
        axes = ("layers_unpiped", "latent_pages", "page_slots", "latent")
        return (CacheSpec(CACHE, axes, (1, None, None, self.target.latent_width)),)

    def mesh_problems(self, shape: MeshShape) -> list[str]:
        # The layer is not pipelined: what it needs of tp and ep is what the target's layers need.
        return self.target.mesh_problems(dataclasses.replace(shape, pp=1))


def mtp_config(target: DeepseekV3Config, source_names: Iterable[str]) -> MtpConfig:
    """The MTP config of `target`, after checking that the checkpoint (whose tensor names are
    `source_names`) holds the layer: a clear error rather than a missing tensor later."""
    _check_target(target)
    if target.extra_layers < 1:
        raise JfireError(
            "this model has no MTP layer: its config.json sets num_nextn_predict_layers to 0 "
            "(Kimi K2.5 ships none; its drafters are separate EAGLE-3 heads)"
        )
    prefix = f"{target.hf_prefix}model.layers.{target.num_layers}."
    if not any(name.startswith(prefix) for name in source_names):
        raise JfireError(
            f"this model has no MTP layer: config.json declares num_nextn_predict_layers "
            f"{target.extra_layers}, but the checkpoint has no tensors under {prefix.rstrip('.')} "
            "(it was saved without them); use a checkpoint that includes the MTP layer"
        )
    kind = "dense" if target.num_layers < target.first_k_dense_replace else "moe"
    return MtpConfig(target=target, kind=kind)


def load_mtp(model: str | Path | LoadedModel, dtype: str | None = None) -> tuple[MtpConfig, dict]:
    """(config, params) of the MTP layer of a DeepSeek-V3 Hugging Face directory.

    `model` is the directory (or a Hugging Face id in the local cache), or the `LoadedModel`
    of the target: then the layer is placed as the target is (each device receives only its
    shards of the target's mesh) and `dtype` defaults to the target's; otherwise to float32."""
    loaded = model if isinstance(model, LoadedModel) else None
    if loaded is not None:
        _check_target(loaded.config)
        path, _ = resolve_model_path(loaded.name)
        dtype = dtype or loaded.dtype
    else:
        path, _ = resolve_model_path(str(model))
    if store.is_checkpoint(path):
        raise JfireError(
            f"{path} is a jfire checkpoint, which keeps the main model only; load the MTP layer "
            "from the Hugging Face directory it was converted from"
        )
    source = open_source(path)
    _check_target(source.config)
    cfg = mtp_config(source.config, source.names())
    host = read_params(source, cfg, parse_dtype(dtype or "float32"))
    if loaded is not None and loaded.mesh is not None:
        from jfire import sharding

        return cfg, sharding.place(host, cfg, loaded.mesh)
    return cfg, jax.device_put(host)


def _check_target(config: Family) -> None:
    """Only DeepSeek-V3 checkpoints have MTP layers; checked before reading anything else."""
    if not isinstance(config, DeepseekV3Config):
        raise JfireError(
            f"MTP draft layers are DeepSeek-V3's (num_nextn_predict_layers); a {config.family} model has none"
        )


def init_cache(cfg: MtpConfig, num_pages: int, page_size: int, dtype) -> dict:
    """A zeroed MTP cache of `num_pages` pages: {CACHE: [1, pages, page_size, latent + rope]}."""
    return {c.name: jnp.zeros(c.shape(num_pages, page_size), dtype) for c in cfg.cache_specs()}


def mtp_forward(
    cfg: MtpConfig,
    params: dict,
    main_params: dict,
    hidden,
    next_tokens,
    positions,
    cache: dict,
    page_table,
    *,
    attention_impl=None,
    parallel=None,
):
    """One MTP step over t tokens a row: returns (logits [b, t, v] float32, out_hidden
    [b, t, e], cache).

    hidden [b, t, e] is the target's last hidden state at positions [b, t] (after its final
    norm: what its LM head reads), next_tokens [b, t] the token at each position + 1, and
    logits[:, j] predict the token at positions[:, j] + 2. Entries are written at `positions`
    (-1 = padding, written nowhere) through page_table [b, w], the target's format, before the
    layer attends, as the target's layers do. out_hidden is what a chained draft feeds back as
    `hidden` at the next position. `attention_impl` and `parallel` are the target's."""
    target, eps = cfg.target, cfg.target.rms_norm_eps
    dtype = cache[CACHE].dtype  # the activations' dtype, as the target's decoder takes it
    with jax.named_scope("mtp"):
        e = rms_norm(main_params["embed"][next_tokens].astype(dtype), params["enorm"], eps)
        h = rms_norm(hidden.astype(dtype), params["hnorm"], eps)
        x = jnp.einsum("bti,ie->bte", jnp.concatenate([e, h], axis=-1), params["eh_proj"])
        x, pages = mla.run_segment(
            target,
            cfg.segment,
            params["layer"],
            x,
            positions,
            {_SEGMENT_CACHE: cache[CACHE]},
            page_table,
            cfg.layer,
            0,
            attention_impl=attention_impl,
            parallel=parallel,
        )
        out = rms_norm(x, params["head_norm"], eps)
        logits = target.logits(main_params, out)
    return logits, out, {**cache, CACHE: pages[_SEGMENT_CACHE]}
