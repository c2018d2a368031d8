"""Prometheus metrics for one server, in a registry of its own (no process-wide state).

Request counts and latency histograms are recorded by the HTTP layer; engine gauges and
counters (running, waiting, KV pages, prefix hits, tokens) are read from the engine's stats
snapshot at scrape time, so they are never stale or double-counted.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    """Turns the engine's stats dict into metrics at each scrape."""

    GAUGES = {
        "running": ("jfire_requests_running", "Requests being prefilled or decoded"),
        "waiting": ("jfire_requests_waiting", "Requests waiting to be admitted"),
        "pages_used": ("jfire_kv_pages_used", "KV cache pages referenced by requests"),
        "pages_free": ("jfire_kv_pages_free", "KV cache pages free (including reusable prefix pages)"),
        "pages_cached": ("jfire_kv_pages_cached", "Free KV pages still holding a reusable prefix block"),
        "pages_total": ("jfire_kv_pages_total", "KV cache pages in the pool"),
        "tokens_per_s": ("jfire_generation_tokens_per_second", "Tokens generated per second, last 10 s"),
        # Speculative decoding (--speculative).
        "spec_mean_accepted_length": (
            "jfire_spec_mean_accepted_length",
            "Tokens a verified sequence emitted a step on average: its accepted draft tokens plus one",
        ),
        # The host-memory tier (--host-kv-gb).
        "host_blocks": ("jfire_host_kv_blocks", "Prefix blocks held in host memory"),
        "host_bytes": ("jfire_host_kv_bytes", "Bytes of prefix blocks held in host memory"),
    }
    COUNTERS = {
        "prefix_hit_tokens": ("jfire_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
        "prompt_tokens": ("jfire_prompt_tokens", "Prompt tokens admitted"),
        "tokens_generated": ("jfire_generation_tokens", "Tokens generated"),
        "preemptions": ("jfire_preemptions", "Requests preempted for lack of KV pages"),
        "spec_draft_tokens": ("jfire_spec_draft_tokens", "Draft tokens verified (--speculative)"),
        "spec_accepted_tokens": ("jfire_spec_accepted_tokens", "Draft tokens the model made the same, so kept"),
        "spec_verify_rows": (
            "jfire_spec_verify_rows",
            "Sequences a verify step ran (each emits its accepted drafts + 1)",
        ),
        "host_blocks_saved": (
            "jfire_host_kv_blocks_saved",
            "Prefix blocks copied to host memory as the device evicted them",
        ),
        "host_blocks_loaded": ("jfire_host_kv_blocks_loaded", "Prefix blocks loaded back from host memory"),
        "host_blocks_corrupt": (
            "jfire_host_kv_blocks_corrupt",
            "Host prefix blocks whose bits differed from those saved: dropped and computed again",
        ),
        "host_bytes_saved": (
            "jfire_host_kv_bytes_saved",
            "Bytes of prefix blocks copied from the device to host memory",
        ),
        "host_bytes_loaded": (
            "jfire_host_kv_bytes_loaded",
            "Bytes of prefix blocks loaded from host memory to the device",
        ),
        "host_blocks_gated": (
            "jfire_host_kv_blocks_gated",
            "Evicted prefix blocks not kept in host memory: they served fewer prompts than --host-kv-min-uses",
        ),
        "host_load_s": ("jfire_host_kv_load_seconds", "Time spent loading prefix blocks back from host memory"),
        # Images in prompts (a model with a vision encoder).
        "images": ("jfire_images", "Images in admitted prompts: encoded, or served from the encoder cache"),
        "encoder_seconds": ("jfire_encoder_seconds", "Time spent running the vision encoder"),
        "encoder_cache_hits": (
            "jfire_encoder_cache_hits",
            "Images whose encoder rows came from the encoder cache (the same pixels seen before)",
        ),
        # The prefix store shared by prefill groups (jfire.disagg.prefix_store) and routing by prefix.
        "shared_blocks_received": (
            "jfire_shared_kv_blocks_received",
            "Prefix blocks fetched from another prefill group instead of computed",
        ),
        "shared_blocks_exported": ("jfire_shared_kv_blocks_exported", "Prefix blocks lent to other prefill groups"),
        "prefix_fetches": ("jfire_prefix_fetches", "Prompts whose prefill group was told to fetch blocks from another"),
        "routed_by_prefix": ("jfire_routed_by_prefix", "Prompts sent to a prefill group for the prefix it holds"),
        "routed_by_affinity": ("jfire_routed_by_affinity", "Prompts sent to a prefill group by session affinity"),
        "routed_by_load": ("jfire_routed_by_load", "Prompts sent to the least loaded prefill group"),
        # Disaggregated serving: KV cache moved from prefill groups to decode groups.
        "kv_transfer_bytes": ("jfire_kv_transfer_bytes", "KV cache bytes pulled from prefill into decode groups"),
        "kv_transfer_raw_bytes": (
            "jfire_kv_transfer_raw_bytes",
            "The same KV caches' bytes before coding (the wire's bytes without [transfer] compress)",
        ),
        "kv_transfers": ("jfire_kv_transfers", "Requests whose KV cache moved from prefill to decode"),
        "kv_handoffs": ("jfire_kv_handoffs", "Requests whose prefill group published their KV cache to the frontend"),
        "transfers_failed": (
            "jfire_kv_transfers_failed",
            "KV transfers that failed (not arrived in time, refused, or arrived with other bytes than were sent)",
        ),
        "transfers_corrupted": (
            "jfire_kv_transfers_corrupted",
            "KV transfers that arrived with other bytes than "
            "were sent (their checksum differs): a sender stopped mid-transfer, or a bug",
        ),
    }

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self):
        stats = self._stats() or {}
        for key, (name, doc) in self.GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key) or 0))
        for key, (name, doc) in self.COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(stats.get(key) or 0))


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "jfire_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "jfire_time_to_first_token_seconds",
            "Time from request to first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "jfire_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
