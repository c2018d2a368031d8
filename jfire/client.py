"""The one interface a server uses to reach an engine.

`jfire.engine.Engine` (prefill and decode in this process) and the deployment frontend's
`RemoteEngine` (groups in other processes) both implement it, and `serve/` depends on
nothing else: the model's tokenizer and limits, readiness and health, submitting,
cancelling and failing requests, and stats.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from jfire.sampling import SamplingParams

if TYPE_CHECKING:
    from jfire.request_checks import RequestChecks
    from jfire.tokenizer import Tokenizer


class EngineClient(Protocol):
    tokenizer: Tokenizer | None  # None for a model served by token ids
    vocab_size: int
    model_type: str | None  # the checkpoint's model_type (chooses chat and tool-call formats)
    vision: object | None  # its image preprocessing and placeholders (jfire.vision.model); None: text only
    max_model_len: int  # tokens a request may span
    checks: RequestChecks  # `checks.admit(n)`: whether the waiting queue has room, before costly checks
    error: BaseException | None  # why the engine stopped serving, once it has
    # Called once the engine has failed for good, after ending every request it held.
    on_fatal: Callable[[BaseException], None] | None

    def is_ready(self) -> bool:
        """Whether requests are taken (programs compiled, groups registered)."""
        ...

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) for /health."""
        ...

    def validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raises jfire.errors.RequestError (naming the field) when the request can never run."""
        ...

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        on_output: Callable | None = None,
        affinity: str | None = None,
        after: str | None = None,
        images=(),
    ):
        """Queues a request; returns its RequestHandle. Outputs (RequestOutput) go to
        `on_output`, called on an engine thread, or to the handle. `images`: the prompt's
        (jfire.vision.encoder.RequestImage, in order), their placeholder ids in prompt_ids."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def fail_all(self, message: str) -> None:
        """Ends every request held with finish_reason "error" and this message."""
        ...

    def stats(self) -> dict: ...

    def shutdown(self) -> None: ...


def serving_health(error: BaseException | None, ready: bool, programs, aot: bool) -> tuple[int, dict]:
    """(HTTP status, body) for /health of an engine in this process: failed, starting (compiling
    what serving needs), or serving, maybe while the rest of its programs compile."""
    if error is not None:
        return 503, {"status": "error", "message": str(error)}
    if not ready:
        return 503, {"status": "starting", "message": "compiling programs"}
    compiled = {"compiled": programs.num_compiled, "total": programs.num_total}
    if aot and compiled["compiled"] < compiled["total"]:
        # Serving already, each step with the smallest program compiled so far.
        return 200, {"status": "ok", "compiling": True, "programs": compiled}
    return 200, {"status": "ok", "compiling": False, "programs": compiled}
