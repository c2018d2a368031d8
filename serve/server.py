"""`jfire serve`: load the model, start uvicorn at once (so /health can say "starting"),
compile the engine's programs in the background, then serve."""

from __future__ import annotations

import sys
import threading

import uvicorn

from jfire.engine import Engine, EngineConfig
from serve.app import ServerState, create_app


def served_name(model_arg: str) -> str:
    from pathlib import Path

    return "default" if model_arg in (None, "default") else Path(model_arg).name.removesuffix(".gguf")


def run(model, config: EngineConfig, *, host: str, port: int, api_key: str | None, model_name: str) -> None:
    engine = Engine(model, config)
    state = ServerState(engine=engine, model_name=model_name, api_key=api_key)
    app = create_app(state)

    def compile_then_start():
        try:
            engine.start(compile_progress=_progress)
        except BaseException as e:  # reported on /health; the server stays up to say so
            engine.error = e
            print(f"jfire: error: engine failed to start: {e}", file=sys.stderr, flush=True)
            return
        print(f"jfire: ready: {engine.programs.num_compiled} programs compiled in {engine.startup_s:.1f} s",
              file=sys.stderr, flush=True)

    threading.Thread(target=compile_then_start, name="jfire-compile", daemon=True).start()
    print(f"jfire: serving {model_name!r} on http://{host}:{port} (compiling programs; /health says when ready)",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()


def _progress(done: int, total: int) -> None:
    if done == total or done % 8 == 0:
        print(f"jfire: compiled {done}/{total} programs", file=sys.stderr, flush=True)
