"""`jfire serve`: load the model, start uvicorn at once (so /health can say "starting"),
compile the engine's programs in the background, then serve."""

from __future__ import annotations

import socket
import sys
import threading
import time

import uvicorn

from jfire.client import EngineClient
from jfire.engine import Engine, EngineConfig
from serve.app import ServerState, create_app
from serve.uvicorn_config import ConnectionLimits, uvicorn_config


def served_name(model_arg: str) -> str:
    from pathlib import Path

    return "default" if model_arg in (None, "default") else Path(model_arg).name.removesuffix(".gguf")


class GracefulServer(uvicorn.Server):
    """uvicorn, draining on SIGTERM/SIGINT: new requests get 503 and /health says "draining",
    in-flight requests run to their end for up to `grace_s`, the rest then end with an error
    (an error event and [DONE] on a stream), and only then does uvicorn stop; the process exits
    0. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float):
        super().__init__(config)
        self.state, self.grace_s = state, grace_s

    def handle_exit(self, sig, frame) -> None:
        # Not uvicorn's own handler: it would re-raise the signal after shutdown (exit 143).
        if self.state.draining:
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True
        print(f"jfire: draining: in-flight requests have {self.grace_s:g} s to finish", file=sys.stderr, flush=True)
        threading.Thread(target=self._drain, name="jfire-drain", daemon=True).start()

    def _drain(self) -> None:
        drain(self.state, self.grace_s)
        self.should_exit = True


def drain(state: ServerState, grace_s: float) -> None:
    """Waits up to grace_s for the engine's in-flight requests to finish, then ends the rest
    with an error (where the engine can: a remote engine's end when its groups stop). The
    caller has set `state.draining`, so nothing new is admitted meanwhile."""
    engine = state.engine

    def busy() -> bool:
        s = engine.stats()
        return bool(s) and (s.get("running", 0) + s.get("waiting", 0)) > 0

    deadline = time.monotonic() + grace_s
    while busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    if busy():
        engine.fail_all(
            f"the server is shutting down and this request did not finish within the {grace_s:g} s grace period"
        )
        stop = time.monotonic() + 5
        while busy() and time.monotonic() < stop:
            time.sleep(0.05)
    state.drained = True


def run(
    model,
    config: EngineConfig,
    *,
    sock: socket.socket,
    host: str,
    api_keys: tuple[str, ...],
    model_name: str,
    max_body_bytes: int = 16 << 20,
    shutdown_grace_s: float = 30.0,
    lead=None,
    access_log: bool = True,
    connector=None,
    image_limits=None,
    cache_salt_per_key: bool = False,
) -> int:
    """Serves on `sock` (bound to host, serve/listen.py) until SIGTERM/SIGINT (exit status 0) or
    until the engine fails for good (1: its requests have ended with an error, /health says so,
    and a supervisor should restart it). `lead(engine)`, in a group spanning processes,
    connects the engine to its followers; `connector` is the engine's KV connector (a host
    tier), None for the colocated engine's own. `image_limits` (jfire.vision.images.ImageLimits)
    bound chat requests' images; None: the defaults. `api_keys`: the keys the API requires
    (none: it is open); `cache_salt_per_key`: each key's prompts hash apart. Connections have
    serve/uvicorn_config.py's limits (a header timeout of 10 s, at least as many connections
    as the engine's queue and batch hold)."""
    engine = Engine(model, config, connector)
    if lead is not None:
        lead(engine)
    state = ServerState(
        engine=engine,
        model_name=model_name,
        api_keys=api_keys,
        max_body_bytes=max_body_bytes,
        access_log=access_log,
        cache_salt_per_key=cache_salt_per_key,
    )
    if image_limits is not None:
        state.image_limits = image_limits
    app = create_app(state)

    def compile_then_start():
        t0 = time.perf_counter()
        try:
            engine.start(compile_progress=_progress)
        except BaseException as e:  # reported on /health; the server stays up to say so
            engine.error = e
            print(f"jfire: error: engine failed to start: {e}", file=sys.stderr, flush=True)
            return
        # What /health reports (README): the programs compiled so far and in all.
        compiled, total = _programs(engine)
        print(
            f"jfire: ready in {time.perf_counter() - t0:.1f} s with {compiled} of {total} programs; "
            "the rest compile in the background (/health reports progress)",
            file=sys.stderr,
            flush=True,
        )
        if engine.wait_compiled():
            print(
                f"jfire: all {_programs(engine)[1]} programs compiled, {time.perf_counter() - t0:.1f} s after start",
                file=sys.stderr,
                flush=True,
            )

    threading.Thread(target=compile_then_start, name="jfire-compile", daemon=True).start()
    port = sock.getsockname()[1]
    print(
        f"jfire: serving {model_name!r} on http://{host}:{port} (compiling programs; /health says when ready)",
        file=sys.stderr,
        flush=True,
    )
    try:
        # The responses of finished requests are written within uvicorn's own 5 s.
        limits = ConnectionLimits.for_queue(config.max_waiting + config.max_batch)
        server = GracefulServer(
            uvicorn_config(app, limits, log_level="warning", timeout_graceful_shutdown=5), state, shutdown_grace_s
        )

        def engine_failed(error: BaseException) -> None:
            print(
                f"jfire: error: the engine failed ({type(error).__name__}: {error}); in-flight requests have "
                "ended with an error, new ones get 503; exiting with status 1",
                file=sys.stderr,
                flush=True,
            )
            threading.Timer(1.0, lambda: setattr(server, "should_exit", True)).start()  # let the errors go out

        engine.on_fatal = engine_failed
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    return 1 if engine.error is not None else 0


def _programs(engine: EngineClient) -> tuple[int, int]:
    """(compiled, total) programs, as /health's body has them."""
    programs = engine.health()[1].get("programs", {})
    return programs.get("compiled", 0), programs.get("total", 0)


def _progress(done: int, total: int) -> None:
    if done == total or done % 8 == 0:
        print(f"jfire: compiled {done}/{total} programs", file=sys.stderr, flush=True)
