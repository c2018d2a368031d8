"""Named places where tests inject faults into a running engine, as a failing accelerator or a
request's failing output processing would raise. Each is None in normal running; a test sets
one (and puts it back) instead of patching the engine's methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jfire.scheduler import Sequence

# Called with a decode call's rows (None: padding) before the call is dispatched.
before_decode: Callable[[list[Sequence | None]], None] | None = None
# Called with a sequence and its newly sampled token before the token is appended to it.
before_output: Callable[[Sequence, int], None] | None = None
# Called with a block's chained hash and the block (a jfire.host_tier.HostBlock) as it reaches
# the host-memory tier, after the device summed its bits: a test changes the block's arrays as a
# fault in host memory would.
host_block_saved: Callable[[bytes, Any], None] | None = None
