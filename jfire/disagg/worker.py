"""One prefill or decode group process: its engine, its transfer server, its control server.

The control server is what the frontend talks to (plain HTTP + JSON, one line per output
when streaming):
  POST /prefill  {request_id, prompt_ids, sampling, shards}
                 -> {first_token, transfer, prompt_tokens, prefix_hit_tokens}
  POST /decode   {request_id, prompt_ids, first_token, sampling, transfer}
                 -> NDJSON outputs until finished
  POST /cancel   {request_id}: ends it here, queued or running (the frontend's client left)
  POST /kv/blocks {hashes, identity}: prefix blocks for another prefill group (prefix_store)
  GET  /stats    the engine's stats;  GET /health: the status alone, for probes
A client that goes away cancels its request, which frees its pages. Every route but /health
needs the deployment's control token, and every body is checked before the engine sees it
(jfire.disagg.control_guard).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import httpx
import jax
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jfire import lockstep
from jfire.deployment_secret import DeploymentSecret
from jfire.device_memory import PoolSize, size_pool
from jfire.disagg import blocks, cluster, control_guard, prefix_store
from jfire.disagg.connectors import DecodeConnector, PrefillConnector
from jfire.disagg.deployment import Deployment, Process
from jfire.disagg.prefix_store import SharedPrefixes
from jfire.engine import Engine, EngineConfig
from jfire.errors import JfireError
from jfire.host_tier import HostTier
from jfire.kv_cache import block_hashes, page_bytes
from jfire.kv_connector import ConnectorStack, KVConnector
from jfire.requests import RequestOutput

CANCELLED_KEPT = 1024


def output_to_json(out: RequestOutput) -> dict:
    return {k: v for k, v in dataclasses.asdict(out).items() if v is not None}


def create_control_app(
    engine,
    process: Process,
    shared: SharedPrefixes | None = None,
    *,
    secret: DeploymentSecret,
    prefill_groups: frozenset[str] = frozenset(),
    control_of: Callable[[str], str | None] = lambda group: None,
) -> FastAPI:
    """The group's HTTP control API, open only to the deployment's control token
    (jfire.disagg.control_guard). `shared`: the tier through which a prefill group lends its
    prefix blocks to the other prefill groups and takes theirs (jfire.disagg.prefix_store);
    `prefill_groups`: the deployment's, the only groups a prompt's blocks are fetched from;
    `control_of(group)`: the control address that group registered, or None (not up)."""
    if process.group is None:
        raise JfireError("a control server runs in a group's process, not the frontend's")
    group_name = process.group.name
    app = FastAPI(title=f"jfire {process.label}")
    app.add_middleware(control_guard.ControlGuard, secret=secret)
    # Fetches from other groups, with the token their control servers ask for.
    peers = httpx.Client(
        headers={"Authorization": f"Bearer {secret.bearer()}"},
        limits=httpx.Limits(max_connections=64),
        trust_env=False,
    )
    vocab_size = engine.checks.vocab_size
    # Ids cancelled here, most recent last: a /cancel can overtake its own /prefill (two
    # connections), which then must not run. Bounded: only the last few matter.
    cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
    error = control_guard.error

    def attach(request_id: str):
        """An asyncio queue fed from the engine thread."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def on_output(out: RequestOutput) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:
                pass

        return outputs, on_output

    async def next_output(outputs, request: Request, request_id: str) -> RequestOutput | None:
        while True:
            try:
                return await asyncio.wait_for(outputs.get(), timeout=0.25)
            except TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(request_id)
                    return None

    @app.exception_handler(control_guard.BadRequest)
    async def bad_request(request: Request, e: control_guard.BadRequest):
        return error(400, str(e))

    @app.get("/health")
    async def health():
        """The status alone (and whether programs are still compiling): it answers anyone
        (probes), so it says nothing of addresses, processes or requests."""
        status, body = engine.health()
        return JSONResponse({k: body[k] for k in ("status", "compiling") if k in body}, status_code=status)

    @app.get("/stats")
    async def stats():
        return {"group": group_name, "role": process.role, "pid": os.getpid(), **engine.stats()}

    @app.post("/cancel")
    async def cancel(request: Request):
        request_id = control_guard.cancel_request(await control_guard.json_object(request))
        cancelled[request_id] = None
        while len(cancelled) > CANCELLED_KEPT:
            cancelled.popitem(last=False)
        engine.cancel(request_id)
        return {"cancelled": request_id}

    @app.post("/kv/blocks")
    async def kv_blocks(request: Request):
        """The prefix blocks of the given hashes this group holds (leading run), for another;
        the answer is signed (prefix_store.blocks_tag), so the taker knows who sent it."""
        if shared is None:
            return error(404, f"{process.label} shares no prefix blocks (it has no host tier: --host-kv-gb)")
        hashes, identity = control_guard.blocks_request(await control_guard.json_object(request))
        if identity != shared.identity:
            return error(409, f"{process.label} runs another model (or layout): its blocks are not yours")
        exported = await asyncio.wait_for(asyncio.wrap_future(shared.export(hashes)), prefix_store.FETCH_TIMEOUT_S)
        data = await asyncio.to_thread(lambda: prefix_store.encode_blocks(exported.to_host()))
        tag = prefix_store.blocks_tag(secret, identity, hashes, data)
        return Response(data, media_type="application/octet-stream", headers={prefix_store.TAG_HEADER: tag})

    async def take_prefix_from(source: control_guard.PrefixSource, prompt_ids: list[int], cache_salt) -> None:
        """Blocks of the prompt another prefill group of the deployment holds and this one
        lacks, into the host tier (hashed with the request's cache salt, as this group's
        scheduler will look them up). The group is asked at the address it registered itself;
        a group not up now is skipped (the prompt is computed here)."""
        hashes = block_hashes(prompt_ids, engine.pool.page_size, salt=cache_salt)[source.first : source.blocks]
        if shared is None or not hashes:
            return

        def fetch():  # off the event loop: the store's read and the fetch both wait on the network
            control = control_of(source.group)
            return [] if control is None else prefix_store.fetch_blocks(peers, control, hashes, shared.identity, secret)

        try:
            blocks = await asyncio.to_thread(fetch)
        except (httpx.HTTPError, ValueError, KeyError) as e:  # down, slow, or garbled: computed here instead
            print(f"jfire: {process.label}: no prefix blocks from {source.group} ({e})", file=sys.stderr)
            return
        shared.receive(blocks)

    @app.post("/prefill")
    async def prefill(request: Request):
        if process.role != "prefill":
            return error(404, f"{process.label} is a {process.role} group; send prefill requests to a prefill group")
        body = control_guard.prefill_request(await control_guard.json_object(request), prefill_groups, group_name)
        if body.request_id in cancelled:
            return error(499, "cancelled before it arrived")
        if body.prefix_from is not None:
            await take_prefix_from(body.prefix_from, body.prompt_ids, body.sampling.cache_salt)
        outputs, on_output = attach(body.request_id)
        try:
            # Off the event loop: a request's grammar compiles inside submit (seconds for a
            # large schema), and the other requests' streams must go on meanwhile.
            await asyncio.to_thread(
                engine.submit,
                body.prompt_ids,
                body.sampling,
                request_id=body.request_id,
                on_output=on_output,
                kv_params={"shards": body.shards, "receiver": body.receiver},
                # The prompt's images: this group encodes them; the decode group never sees pixels.
                images=body.images,
            )
        except (JfireError, TypeError, ValueError) as e:
            return error(400, str(e))
        while True:
            out = await next_output(outputs, request, body.request_id)
            if out is None:
                return error(499, "client went away")
            if out.finished:
                break
        if out.finish_reason == "cancelled":
            return error(499, "cancelled")
        if out.finish_reason != "prefilled":
            return error(500, out.error or f"the prefill ended with {out.finish_reason!r}")
        return {
            "first_token": out.token_ids[0],
            "transfer": out.transfer,
            "prompt_tokens": out.prompt_tokens,
            "prefix_hit_tokens": out.prefix_hit_tokens,
            "first_logprobs": (out.logprobs or [None])[0],
            "prompt_logprobs": out.prompt_logprobs,
        }

    @app.post("/decode")
    async def decode(request: Request):
        if process.role != "decode":
            return error(404, f"{process.label} is a {process.role} group; send decode requests to a decode group")
        body = control_guard.decode_request(await control_guard.json_object(request), vocab_size)
        request_id = body.request_id
        outputs, on_output = attach(request_id)
        try:
            # The connector checks the transfer here, before anything reaches the engine thread;
            # off the event loop, as /prefill's.
            await asyncio.to_thread(
                engine.submit,
                body.prompt_ids,
                body.sampling,
                request_id=request_id,
                on_output=on_output,
                kv_params={
                    "first_token": body.first_token,
                    "transfer": body.transfer,
                    "first_logprobs": body.first_logprobs,
                },
            )
        except (JfireError, TypeError, ValueError, KeyError) as e:
            return error(400, str(e))

        async def lines():
            finished = False
            try:
                while True:
                    out = await next_output(outputs, request, request_id)
                    if out is None:
                        return
                    yield json.dumps(output_to_json(out)) + "\n"
                    if out.finished:
                        finished = True
                        return
            finally:
                # The frontend left mid-stream (its client went away): while outputs keep
                # coming, next_output never polls for the disconnect, but the response
                # stops this generator.
                if not finished:
                    engine.cancel(request_id)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


def _registered_control(store, group: str) -> str | None:
    """The control address a prefill group registered in the store (signed there: only a
    process of this deployment could have), or None while it is not up."""
    info = cluster.read_group(store, group)
    control = info.get("control") if info and info.get("role") == "prefill" else None
    return control if isinstance(control, str) and control.startswith("http://") else None


def _progress_printer(label: str, every_s: float = 2.0):
    """compile_progress for a group's engine: a line at most every `every_s` seconds, so a cold
    start says what it is doing and a warm one (programs loaded from the cache) stays quiet."""
    start = last = time.monotonic()

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_s and done < total:
            last = now
            print(
                f"jfire: {label}: compiled {done}/{total} programs ({now - start:.0f} s)", file=sys.stderr, flush=True
            )

    return progress


def run(
    deployment: Deployment,
    process: Process,
    *,
    model: str,
    dtype: str,
    coordinator: str,
    bind_host: str,
    advertise_host: str,
    config: EngineConfig,
    host_kv_bytes: int = 0,
    host_kv_min_uses: int = 1,
    pool_size: PoolSize | None = None,
    secret: DeploymentSecret,
) -> None:
    """Runs one group process until it is told to stop (SIGTERM / Ctrl-C). A prefill group of
    one process keeps `host_kv_bytes` of evicted prefix blocks in host memory (jfire.host_tier),
    those that served `host_kv_min_uses` prompts.
    `pool_size`: --kv-cache-gb as given, auto sizing the pool from the plan of the group's mesh
    on its devices (jfire.device_memory)."""
    from jax.experimental import transfer

    from jfire.checkpoint.load import load_model

    group = process.group
    prefill_groups = frozenset(g.name for g in deployment.groups if g.role == "prefill")
    members = [p.process_id for p in deployment.processes if p.group == group]  # the leader first
    store = cluster.join(
        coordinator, len(deployment.processes), process.process_id, secret=secret, collectives=len(members) > 1
    )
    # A group spanning processes runs one mesh over all their devices (jfire.lockstep).
    devices = [d for d in jax.devices() if d.process_index in members] if len(members) > 1 else jax.local_devices()
    if len(members) > 1:
        name = cluster.incarnation(store, group.name, len(members))
        if process.rank == 0:  # a restarted group: its collectives must not meet its old life's keys
            cluster.forget_collectives(store, {d.id for d in devices})
            store.key_value_set(f"jfire/clean/{name}", "1")
        else:
            store.blocking_key_value_get(f"jfire/clean/{name}", 600_000)
    try:
        spec = group.mesh
        if pool_size is not None:  # before the weights: a group that does not fit says so at once
            config = size_pool(
                config, pool_size, model=model, dtype=dtype, spec=spec, devices=devices, vision=group.role != "decode"
            )
        loaded = load_model(model, dtype, mesh_spec=spec, devices=devices)
    except JfireError as e:  # the frontend reports it on /health instead of waiting for ever
        cluster.publish_group(store, group.name, {"error": str(e)})
        raise
    server = transfer.start_transfer_server(jax.local_devices()[0].client, f"{bind_host}:0", [f"{bind_host}:0"])
    transfer_address = server.address().replace(bind_host, advertise_host, 1)
    connector: PrefillConnector | DecodeConnector
    if group.role == "prefill":
        connector = PrefillConnector(
            server=server,
            store=store,
            group=group.name,
            transfer_timeout_s=deployment.transfer_timeout_s,
            secret=secret,
            compress=deployment.transfer_compress,
        )
    else:
        connector = DecodeConnector(
            server=server,
            store=store,
            transfer_timeout_s=deployment.transfer_timeout_s,
            group=group.name,
            secret=secret,
            prefill_groups=prefill_groups,
            compress=deployment.transfer_compress,
        )
    role: KVConnector = connector
    host_tier_bytes, shared = 0, None
    if host_kv_bytes and isinstance(connector, PrefillConnector) and len(members) == 1:
        host_tier = HostTier(host_kv_bytes, min_uses=host_kv_min_uses)
        shared = SharedPrefixes(host_tier)  # the deployment's prefix store, through this tier
        role, host_tier_bytes = ConnectorStack(connector, host_tier, shared), host_kv_bytes
    engine = Engine(loaded, config, role)
    if len(members) > 1:
        channel = lockstep.StepChannel(name, members, process.process_id, store)
        if process.rank > 0:

            def ready():  # the leader registers the group once every process's transfer server is known
                store.key_value_set(cluster.transfer_key(channel.group, process.process_id), transfer_address)

            lockstep.follow(engine, channel, on_ready=ready)
            return
        engine.runner.step_channel = channel
        if isinstance(connector, PrefillConnector):
            connector.transfer_addresses = {str(process.process_id): transfer_address}

        def group_failed(error: BaseException) -> None:  # a group lives and dies whole
            print(
                f"jfire: {process.label}: error: the group failed ({type(error).__name__}: {error}); its requests "
                "have ended with an error; exiting with status 1",
                file=sys.stderr,
                flush=True,
            )
            threading.Timer(1.0, lambda: os._exit(1)).start()  # let the errors go out first

        engine.on_fatal = group_failed
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((bind_host, group.port))
    control = f"http://{advertise_host}:{sock.getsockname()[1]}"

    def compile_then_register():
        try:
            engine.start(compile_progress=_progress_printer(process.label))
            for member in members[1:]:
                address = store.blocking_key_value_get(
                    cluster.transfer_key(engine.runner.step_channel.group, member), 600_000
                )
                if isinstance(connector, PrefillConnector):
                    connector.transfer_addresses[str(member)] = address
        except BaseException as e:  # reported on /health and to the frontend through the store
            engine.error = e
            cluster.publish_group(store, group.name, {"error": str(e)})
            print(f"jfire: {process.label}: error: engine failed to start: {e}", file=sys.stderr, flush=True)
            return
        cluster.publish_group(
            store,
            group.name,
            {
                "role": group.role,
                "control": control,
                "transfer": transfer_address,
                "pid": os.getpid(),
                "mesh": group.mesh.name,
                "devices": len(loaded.mesh.devices.flat) if loaded.mesh is not None else 1,
                "kv_shards": connector.layout.preferred_shards(),
                "pages_total": engine.pool.num_pages,
                # For routing by prefix: how prompts are cut into blocks, and how many blocks
                # the group's caches hold (device pages and its host tier).
                "page_size": engine.pool.page_size,
                "shares_prefixes": shared is not None,
                "cache_blocks": engine.pool.num_pages
                + host_tier_bytes // page_bytes(loaded.config, config.page_size, loaded.kv_dtype),
                "processes": len(members),
                "kv_layout": blocks.describe(connector.layout),
                "startup_s": engine.startup_s,
            },
        )
        launched_at = os.environ.get("JFIRE_LAUNCHED_AT")  # set by `jfire launch` on this machine
        since = f", {time.time() - float(launched_at):.1f} s after launch" if launched_at else ""
        print(
            f"jfire: {process.label}: ready ({group.role}, mesh {group.mesh.name}, "
            f"{engine.stats()['compiled_programs']} programs compiled in {engine.startup_s:.1f} s{since}); "
            f"control {control}, KV transfer {transfer_address}",
            file=sys.stderr,
            flush=True,
        )

    threading.Thread(target=compile_then_register, name="jfire-compile", daemon=True).start()
    app = create_control_app(
        engine,
        process,
        shared,
        secret=secret,
        prefill_groups=prefill_groups,
        control_of=lambda name: _registered_control(store, name),
    )
    from serve.uvicorn_config import ConnectionLimits, uvicorn_config

    limits = ConnectionLimits.for_queue(config.max_waiting + config.max_batch)
    uv = uvicorn.Server(uvicorn_config(app, limits, log_level="warning", timeout_graceful_shutdown=3))
    try:
        uv.run(sockets=[sock])
    finally:
        engine.shutdown()
