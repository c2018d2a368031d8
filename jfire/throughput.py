"""Throughput and cost on paper: the decode and prefill bounds `jfire plan` gives a deployment,
from the bytes each device reads and the FLOPs it does in a step (the method: docs/plan.md).

A pass of some layers over some tokens takes, on one device,

    max(weight bytes read / memory bandwidth, the products' FLOPs / (peak bf16 FLOP/s x efficiency))
      + max(cache bytes read / memory bandwidth, attention FLOPs / (peak x attention efficiency))
      + bytes sent over the link / link bandwidth

The layers' products and attention are two phases, each under its own bound: a prefill chunk's
products are bound by the weights' bytes on a GPU while its attention over a long cache is
bound by FLOPs, and one max over both would hide one under the other.

with the device's spec-sheet peaks from the mesh file's [device] table. Every device of a
pipeline stage reads its own shard at the same time, so one device's pass is the stage's.
What a device reads and does (plan.step_passes counts the weights, exactly as the plan holds them):

  weights   every weight it holds, once a pass (the embedding table excepted: a lookup reads a
            row a token), the routed experts only as far as the pass's tokens touch them:
            t tokens choosing k of E experts each touch E (1 - (1 - k/E)^t) of them (routing
            taken as uniform and independent)
  KV        each row's cache up to its position, in every layer it runs (windows and chunks
            respected), at the device's share of a token's cache
  FLOPs     2 per weight a token multiplies (routed experts at k/E), the LM head once a row
            (prefill samples the last token only); attention per query token and attended
            position: 4 x heads x head_dim for GQA (QK and PV), 2 x heads x (2 latent + rope)
            for MLA's absorbed form (jfire.models.mla), split over the devices that split the
            heads or the pages
  link      per token and layer, over a stage's devices (ring: an all-reduce sends 2 (n-1)/n of
            its bytes, an all-gather (n-1)/n): the attention output and the MLP output (counted
            as float32, as the experts' psum is), and for MLA the query gathered and the partial
            attention merged (acc, max and sum, float32); nothing else

A step runs as the engine's pipeline does (jfire.pipeline): its rows split into m micro-batches
(at most the mesh's, dividing the rows), m + pp - 1 ticks, each one stage's pass over rows/m
rows; what lies outside the pipeline (the LM head, a dense first layer kept on every stage)
runs once a step on every device. One row (a batch of 1, a prefill chunk) so crosses the
stages in turn. Not counted: collective latency, the host's time per step, kernel launches,
the pipeline's hand-offs between stages, the sampler.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import numpy as np

from jfire import mesh as meshes
from jfire import sharding
from jfire.models.family import Family
from jfire.models.params import get_path

# How much of each spec-sheet peak a step is taken to get: stated, never fitted. At 1.0 the
# decode figures are bounds (no kernel reads memory faster than the sheet says); prefill's FLOPs
# at 0.5, a round allowance for bf16 GEMMs and flash attention at an engine's chunk sizes
# (FlashAttention-3 reports about 75% of an H100's peak at its best shapes).
EFFICIENCY = MappingProxyType(
    {
        "memory": 1.0,
        "link": 1.0,
        "decode_flops": 1.0,
        "prefill_flops": 0.5,
        "decode_attention_flops": 1.0,
        "prefill_attention_flops": 0.5,
        "attention_memory": 1.0,
    }
)
# A round figure for renting one Hopper GPU by the hour, not a quote: --usd-per-device-hour
# replaces it with what a deployment pays.
USD_PER_DEVICE_HOUR = 2.0
DECODE_BATCHES = (1, 8, 64)  # and the plan's --max-batch
PROMPT_LENGTHS = (1024, 8192, 32768)  # TTFT and prefill tokens/s, one prompt alone
LINK_VALUE_BYTES = 4  # the all-reduced activations, counted as float32


@dataclasses.dataclass
class Pass:
    """What one device reads and multiplies in one pass of some layers over a step's tokens:
    the part outside the pipeline (once a step), or one stage's part (once a tick)."""

    weight_bytes: int = 0  # read whole whatever the tokens
    expert_bytes: int = 0  # routed experts: read as far as the tokens touch them
    token_flops: float = 0.0  # per token: 2 per weight it multiplies, routed experts at k/E
    row_flops: float = 0.0  # per row: the LM head
    layers: tuple[int, ...] = ()  # the model layers the pass runs, over `share` stages
    share: int = 1


@dataclasses.dataclass(frozen=True)
class Device:
    memory_bytes_per_s: float
    flops_per_s: float
    link_bytes_per_s: float | None  # None: collectives not counted

    @classmethod
    def of(cls, spec: meshes.MeshSpec) -> Device | None:
        """The mesh file's [device] peaks; None without bandwidth and FLOPs."""
        if spec.device_memory_tb_per_s is None or spec.device_bf16_tflops is None:
            return None
        link = spec.device_link_gb_per_s
        return cls(spec.device_memory_tb_per_s * 1e12, spec.device_bf16_tflops * 1e12, link and link * 1e9)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The fractions of the device's peaks a step gets: its layers' products of the FLOP/s
    (`flops`), attention of the FLOP/s (`attention_flops`) and of the memory bandwidth as it
    reads the cache (`attention_memory`; the weights are read at EFFICIENCY["memory"])."""

    flops: float
    attention_flops: float
    attention_memory: float = 1.0

    @classmethod
    def of(cls, kind: str) -> Efficiency:
        """The stated constants of "decode" or "prefill" steps."""
        return cls(EFFICIENCY[f"{kind}_flops"], EFFICIENCY[f"{kind}_attention_flops"], EFFICIENCY["attention_memory"])


def experts_touched(experts: int, per_token: int, tokens: float) -> float:
    """Expected distinct experts `tokens` tokens touch, each choosing `per_token` of `experts`:
    one token misses a given expert with probability 1 - k/E, all of them with its t-th power."""
    return experts * (1 - (1 - per_token / experts) ** tokens) if experts else 0.0


@dataclasses.dataclass(frozen=True)
class Model:
    """The per-device constants of a model on a mesh that every pass shares."""

    once: Pass
    tick: Pass
    stages: int
    microbatches: int
    experts: int
    per_token: int
    kv_layer_bytes: float  # one token's cache in one layer, on one device
    attention_flops: float  # one query token, one attended position, one layer, on one device
    link_bytes: float  # one token, one layer: what a device sends to the others
    chunk: np.ndarray  # [layers] chunked attention's chunk, 0 for none
    window: np.ndarray  # [layers] sliding window, 0 for none

    def attended(self, positions: np.ndarray) -> np.ndarray:
        """[layers, positions]: cached positions a query at each position reads, itself included."""
        p = positions[None, :]
        chunk, window = self.chunk[:, None], self.window[:, None]
        within_chunk = np.where(chunk > 0, p % np.maximum(chunk, 1) + 1, p + 1)
        return np.where(window > 0, np.minimum(within_chunk, window), within_chunk)

    def pass_s(self, part: Pass, device: Device, rows: int, tokens: int, start: int, efficiency: Efficiency) -> float:
        """One device's time for `part` over `rows` rows of `tokens` tokens at positions start...
        (every row alike)."""
        if not part.layers and not part.weight_bytes:
            return 0.0
        seen = self.attended(np.arange(start, start + tokens))[list(part.layers)]  # [layers, tokens]
        n = rows * tokens
        touched = experts_touched(self.experts, self.per_token, n) / self.experts if self.experts else 0.0
        bandwidth, peak = device.memory_bytes_per_s, device.flops_per_s
        read = part.weight_bytes + part.expert_bytes * touched
        flops = n * part.token_flops + rows * part.row_flops
        t = max(read / (bandwidth * EFFICIENCY["memory"]), flops / (peak * efficiency.flops))
        kv = rows * self.kv_layer_bytes * seen[:, -1].sum() / part.share  # each row's cache read once a pass
        attention = rows * self.attention_flops * seen.sum() / part.share
        if kv or attention:
            t += max(kv / (bandwidth * efficiency.attention_memory), attention / (peak * efficiency.attention_flops))
        if device.link_bytes_per_s:
            sent = n * self.link_bytes * len(part.layers) / part.share
            t += sent / (device.link_bytes_per_s * EFFICIENCY["link"])
        return t

    def ticks(self, rows: int) -> tuple[int, int]:
        """(micro-batches, ticks) of a step of `rows` rows, as jfire.pipeline.Pipeline splits them."""
        if self.stages == 1:
            return 1, 0
        m = max(1, min(self.microbatches, rows))
        while rows % m:
            m -= 1
        return m, m + self.stages - 1

    def step_s(self, device: Device, rows: int, tokens: int, start: int, efficiency: Efficiency) -> float:
        m, ticks = self.ticks(rows)
        once = self.pass_s(self.once, device, rows, tokens, start, efficiency)
        return once + ticks * self.pass_s(self.tick, device, rows // m, tokens, start, efficiency)


def model_on_mesh(
    cfg: Family,
    once: Pass,
    tick: Pass,
    param_shardings: dict,
    cache_shardings: dict,
    spec: meshes.MeshSpec,
    kv_bytes_per_token_device: int,
) -> Model:
    """The constants of `cfg` on `spec`'s mesh (`once` and `tick` from plan.step_passes)."""
    layers = sum(s.count for s in cfg.segments())
    held = len(once.layers) + len(tick.layers) / tick.share  # the layers whose cache a device holds
    pages_split = sharding.page_multiple(cache_shardings, cfg) if spec.size > 1 else 1
    heads_split = 1  # how many ways tp splits the query heads (GQA's attention splits with them)
    for s in cfg.param_specs():
        if "q_heads" in s.axes:
            i = s.axes.index("q_heads")
            heads_split = max(heads_split, s.shape[i] // get_path(param_shardings, s.name).shard_shape(s.shape)[i])
    fields = cfg.to_dict()  # the family's config: GQA's head_dim, or MLA's latent
    heads, latent = fields["num_heads"], fields.get("kv_lora_rank")
    if latent is not None:  # MLA, absorbed: scores over latent + rope key, values in the latent
        rope = fields["qk_rope_head_dim"]
        per_position = 2 * heads * (latent + rope) + 2 * heads * latent
    else:
        per_position = 4 * heads * fields["head_dim"]
    n = spec.size // spec.pp  # a stage's devices
    link = 0.0
    if n > 1:
        link = 2 * (n - 1) / n * 2 * fields["hidden_size"] * LINK_VALUE_BYTES
        if latent is not None:
            link += (n - 1) / n * heads * (latent + rope) * 2  # the query, bf16, gathered
            link += 2 * (n - 1) / n * heads * (latent + 2) * LINK_VALUE_BYTES  # partials merged
    # Per-layer attention spans: Llama 4's chunked layers (its scanned per-layer data), a sliding window.
    data = cfg.layer_data() if hasattr(cfg, "layer_data") else {}
    chunk = np.asarray(data.get("chunk", np.zeros(layers)))
    window = np.full(layers, fields.get("sliding_window") or 0)
    return Model(
        once=once,
        tick=tick,
        stages=spec.pp,
        microbatches=spec.num_microbatches,
        experts=fields.get("num_experts", 0),
        per_token=fields.get("experts_per_token", 0),
        kv_layer_bytes=kv_bytes_per_token_device / held,
        attention_flops=per_position / max(pages_split, heads_split),
        link_bytes=link,
        chunk=chunk.astype(np.int64),
        window=window.astype(np.int64),
    )


def figures(
    model: Model,
    device: Device,
    *,
    devices: int,
    kind: str | None,
    max_batch: int,
    context: int,
    prefill_chunk: int,
    max_prompt: int,
    usd_per_device_hour: float | None,
) -> dict:
    """The `throughput` object of a plan: decode at each batch with every row `context` tokens
    deep, one prompt's prefill in chunks of `prefill_chunk` tokens, and their cost."""
    usd = USD_PER_DEVICE_HOUR if usd_per_device_hour is None else usd_per_device_hour
    batches = sorted({b for b in DECODE_BATCHES if b <= max_batch} | {max_batch})
    decode = {b: b / model.step_s(device, b, 1, context - 1, Efficiency.of("decode")) for b in batches}
    ttft = {}
    for n in (n for n in PROMPT_LENGTHS if n <= max_prompt):
        # The prompt alone, chunk after chunk, each a step of one row (so through the stages in turn).
        chunks = [(s, min(prefill_chunk, n - s)) for s in range(0, n, prefill_chunk)]
        ttft[n] = sum(model.step_s(device, 1, t, s, Efficiency.of("prefill")) for s, t in chunks)
    per_stage = devices // model.stages
    return {
        "hbm_bytes_per_s": device.memory_bytes_per_s * per_stage,
        "decode_tokens_per_s": {str(b): tps for b, tps in decode.items()},
        "usd_per_million_output_tokens": {str(b): usd * devices / (tps * 3600) * 1e6 for b, tps in decode.items()},
        "prefill_tokens_per_s": {str(n): n / t for n, t in ttft.items()},
        "ttft_s": {str(n): t for n, t in ttft.items()},
        "assumptions": {
            "device": kind,
            "memory_bytes_per_s": device.memory_bytes_per_s,
            "bf16_flops_per_s": device.flops_per_s,
            "link_bytes_per_s": device.link_bytes_per_s,
            "devices_reading_at_once": per_stage,
            "usd_per_device_hour": usd,
            "usd_per_device_hour_source": "default" if usd_per_device_hour is None else "--usd-per-device-hour",
            "efficiency": dict(EFFICIENCY),
            "kv_context_tokens": context,
            "prefill_chunk_tokens": prefill_chunk,
            "pipeline": (
                f"{model.stages} stages: a step of b rows runs in m + {model.stages - 1} ticks of b/m rows "
                f"each (m micro-batches: at most {model.microbatches}, dividing b), each tick one stage's pass"
                if model.stages > 1
                else "none"
            ),
            "pipeline_ticks": {str(b): model.ticks(b)[1] for b in batches} if model.stages > 1 else None,
            "experts": model.experts,
            "experts_per_token": model.per_token,
            # What one layer's pass sees at once: a batch's rows, or a micro-batch's in a pipeline.
            "experts_touched_per_layer": {
                str(b): experts_touched(model.experts, model.per_token, b // model.ticks(b)[0]) for b in batches
            }
            if model.experts
            else None,
            "not_counted": "collective latency, host time per step, kernel launches, stage hand-offs, sampling",
            "method": "docs/plan.md",
        },
    }
