"""The fault suite's running count, shared by its modules and printed as one line at the end
of the run (tests/conftest.py). Each test asserts its own invariants; the tally
only adds them up so the whole battery reads at a glance."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Tally:
    sent: int = 0  # requests sent, well-formed or not
    faults: int = 0  # faults injected: malformed bodies, disconnects, overload, signals, kills
    completed: int = 0  # requests answered with what was asked
    failed_cleanly: int = 0  # requests refused or ended with a clear error (4xx, 503, an error event)
    client_5xx: int = 0  # 5xx answers to requests whose only fault was their own input (must be 0)
    hangs: int = 0  # requests with no answer within their bound (must be 0)
    leaked_pages: int = 0  # KV pages still used once the engines are idle (must be 0)
    restarts: int = 0  # group processes restarted by `jfire launch`

    def add(self, counts: dict) -> None:
        for key, value in counts.items():
            setattr(self, key, getattr(self, key) + value)

    def line(self) -> str:
        return (f"fault suite: {self.sent} requests sent, {self.faults} faults injected, {self.completed} completed, "
                f"{self.failed_cleanly} failed cleanly, {self.client_5xx} 5xx from client input, {self.hangs} hangs, "
                f"{self.leaked_pages} leaked pages, {self.restarts} engine restarts")


TALLY = Tally()
