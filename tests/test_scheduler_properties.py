"""Property tests of the host side of batching, with no model: random interleavings of submits,
steps, cancels and finishes against `Scheduler` and `BlockPool`, checking after every action that
no page is leaked or owned more times than it is referenced; and `Buckets` always picks the
smallest compiled shape that holds a step."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from jfire.kv_cache import BlockPool
from jfire.programs import Buckets
from jfire.sampling import SamplingParams
from jfire.scheduler import Phase, Scheduler, Sequence

PAGE = 4

# One action: ("submit", prompt length, max tokens, prefix choice) | ("step",) | ("cancel", index).
actions = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 23), st.integers(1, 16), st.integers(0, 2)),
    st.tuples(st.just("step")),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
), min_size=1, max_size=60)


def check_pages(pool: BlockPool, live: list[Sequence]) -> None:
    """Every referenced page is owned exactly as many times as its reference count, no sequence
    holds a page twice, and free + referenced = all."""
    owners = collections.Counter(p for seq in live for p in seq.pages)
    for seq in live:
        assert len(set(seq.pages)) == len(seq.pages), f"{seq.request_id} holds a page twice"
    for page in range(pool.num_pages):
        assert pool.ref_count[page] == owners.get(page, 0), (page, pool.ref_count[page], owners.get(page, 0))
    assert pool.num_free == sum(1 for page in range(pool.num_pages) if pool.ref_count[page] == 0)


def check_step(step, scheduler: Scheduler) -> None:
    assert len(step.decode) <= scheduler.max_batch
    assert sum(c.length for c in step.prefill) <= scheduler.prefill_budget
    assert len(step.prefill) <= scheduler.max_prefill_rows
    rows = [c.seq for c in step.prefill] + step.decode
    assert len(set(map(id, rows))) == len(rows), "a sequence scheduled twice in one step"
    for seq in step.decode:  # a decoding row has a page for the token it writes
        assert len(seq.pages) * PAGE >= len(seq.tokens)
    for chunk in step.prefill:
        assert len(chunk.seq.pages) * PAGE >= chunk.start + chunk.length
        assert chunk.start == chunk.seq.computed and chunk.length > 0


def run_step(scheduler: Scheduler, live: list[Sequence]) -> None:
    """One engine step without a model: schedule, check, and append a token where the engine
    would (each decoding row, each prompt-completing chunk); finished sequences leave."""
    step = scheduler.schedule()
    check_step(step, scheduler)
    for seq in step.preempted:
        # A victim waits with nothing cached, or is readmitted in this very step from scratch
        # (or from a prefix-cache hit).
        chunk = next((c for c in step.prefill if c.seq is seq), None)
        if chunk is None:
            assert seq.phase is Phase.WAITING and not seq.pages and seq.computed == 0
        else:
            assert chunk.start == seq.prefix_hit_tokens
    new = list(step.decode) + [c.seq for c in step.prefill if c.completes_prompt]
    scheduler.on_step_done(step)
    for seq in new:
        seq.tokens.append(1)
        if seq.num_generated >= seq.sampling.max_tokens:
            scheduler.finish(seq)
            live.remove(seq)


@settings(max_examples=150, deadline=None)
@given(actions, st.integers(7, 14), st.booleans())
def test_no_page_is_leaked_or_double_owned(script, num_pages, prefix_caching):
    pool = BlockPool(num_pages, PAGE)
    scheduler = Scheduler(pool, max_batch=4, prefill_budget=8, max_prefill_rows=2, prefix_caching=prefix_caching)
    live: list[Sequence] = []
    prefixes = [[7] * 12, [5, 6] * 6, []]
    for n, action in enumerate(script):
        if action[0] == "submit":
            _, length, max_tokens, prefix = action
            prompt = (prefixes[prefix] + list(range(100 + n, 100 + n + length)))[:24]
            # Admission (the engine's validate) refuses what the pool can never hold.
            if scheduler.pages_needed(len(prompt) + max_tokens) > num_pages:
                continue
            seq = Sequence(f"r{n}", prompt, SamplingParams(max_tokens=max_tokens), seed=n)
            scheduler.add(seq)
            live.append(seq)
        elif action[0] == "cancel" and live:
            seq = live.pop(action[1] % len(live))
            scheduler.finish(seq)
        else:
            run_step(scheduler, live)
        check_pages(pool, live)
    # Everything still live runs to its end, then no page is referenced.
    for _ in range(2000):
        if not live:
            break
        run_step(scheduler, live)
        check_pages(pool, live)
    assert not live, "requests never finished"
    assert pool.num_free == num_pages and not pool.ref_count.any()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.sampled_from([16, 64, 256]), st.integers(1, 16), st.integers(1, 300),
       st.sampled_from([4, 16]))
def test_buckets_pick_the_smallest_shape_that_holds_the_step(max_batch, budget, max_rows, max_pages, page_size):
    b = Buckets.for_limits(max_batch=max_batch, prefill_budget=budget, max_prefill_rows=max_rows,
                           max_pages_per_row=max_pages, page_size=page_size)
    assert b.decode_batches[-1] == max_batch and b.pages_per_row == max_pages
    for n in range(1, max_batch + 1):
        chosen = b.decode_batch(n)
        assert chosen >= n and all(x < n for x in b.decode_batches if x < chosen)
    tokens = b.prefill_token_buckets()
    assert tokens[-1] >= budget
    for t in tokens:
        rows = [r for r, tt in b.prefill_shapes if tt == t]
        assert 1 in rows and max(rows) <= max(1, max_rows)
        # A full step of equal chunks of t tokens fits one program.
        assert b.max_rows_for(t) == max(1, min(max_rows, budget // t))
