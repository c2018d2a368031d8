"""Property tests of the host side of batching, with no model: random interleavings of submits,
steps, cancels and finishes against `Scheduler` and its pools (one, or one per kind of layer:
full attention beside chunks, a sliding window alone), checking after every action that no page
is leaked or owned more times than it is referenced, that a windowed pool's sequence holds
every page its next queries see and none before them; and `Buckets` always picks the smallest
compiled shape that holds a step."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jfire.kv_cache import RELEASED, KVPools
from jfire.models.family import CacheGroup
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


# The kinds of pools: one of full attention; full attention beside chunks of 8 (Llama 4);
# a sliding window of 6 alone (Mistral).
GROUPS = {
    "full": (CacheGroup("full"),),
    "full+chunked": (CacheGroup("global"), CacheGroup("chunked", chunk=8)),
    "sliding": (CacheGroup("sliding", sliding_window=6),),
}
BUDGET = 8


def check_pages(pools: KVPools, live: list[Sequence]) -> None:
    """In every pool: each referenced page is owned exactly as many times as its reference
    count, no sequence holds a page twice, and free + referenced = all. A windowed pool's
    sequence holds no page before the first position its next query sees."""
    for i, gp in enumerate(pools.pools):
        pool = gp.pool
        held = {seq.request_id: [p for p in seq.tables[i] if p != RELEASED] for seq in live}
        owners = collections.Counter(p for pages in held.values() for p in pages)
        for name, pages in held.items():
            assert len(set(pages)) == len(pages), f"{name} holds a page twice"
        for page in range(pool.num_pages):
            assert pool.ref_count[page] == owners.get(page, 0), (page, pool.ref_count[page], owners.get(page, 0))
        assert pool.num_free == sum(1 for page in range(pool.num_pages) if pool.ref_count[page] == 0)
        if gp.group.windowed:
            for seq in live:
                behind = gp.group.first_visible(seq.computed) // PAGE
                assert all(p == RELEASED for p in seq.tables[i][:behind]), (seq.request_id, seq.tables[i])
                kept = sum(1 for p in seq.tables[i] if p != RELEASED)
                assert kept <= gp.group.pages_per_row(10**6, PAGE, BUDGET), (seq.request_id, seq.tables[i])


def sees_its_pages(pools: KVPools, seq: Sequence, start: int, end: int) -> bool:
    """Every pool holds the pages of positions [first one a query at start sees, end)."""
    for i, gp in enumerate(pools.pools):
        first = gp.group.first_visible(start) // PAGE if gp.group.windowed else 0
        table = seq.tables[i]
        if len(table) * PAGE < end or any(p == RELEASED for p in table[first : -(-end // PAGE)]):
            return False
    return True


def check_step(step, scheduler: Scheduler) -> None:
    assert len(step.decode) <= scheduler.max_batch
    assert sum(c.length for c in step.prefill) <= scheduler.prefill_budget
    assert len(step.prefill) <= scheduler.max_prefill_rows
    rows = [c.seq for c in step.prefill] + step.decode
    assert len(set(map(id, rows))) == len(rows), "a sequence scheduled twice in one step"
    for seq in step.decode:  # a decoding row has the pages it writes and reads
        assert sees_its_pages(scheduler.pools, seq, len(seq.tokens) - 1, len(seq.tokens))
    for chunk in step.prefill:
        assert sees_its_pages(scheduler.pools, chunk.seq, chunk.start, chunk.start + chunk.length)
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
            assert seq.phase is Phase.WAITING and not any(seq.tables) and seq.computed == 0
        else:
            assert chunk.start == seq.prefix_hit_tokens
    new = list(step.decode) + [c.seq for c in step.prefill if c.completes_prompt]
    scheduler.on_step_done(step)
    for seq in new:
        seq.tokens.append(1)
        if seq.num_generated >= seq.sampling.max_tokens:
            scheduler.finish(seq)
            live.remove(seq)


@pytest.mark.parametrize("kinds", list(GROUPS))
@settings(max_examples=150, deadline=None)
@given(script=actions, num_pages=st.integers(7, 14), prefix_caching=st.booleans())
def test_no_page_is_leaked_or_double_owned(kinds, script, num_pages, prefix_caching):
    groups = GROUPS[kinds]
    pools = KVPools(groups, {g.name: num_pages for g in groups}, PAGE, shared=False)
    scheduler = Scheduler(pools, max_batch=4, prefill_budget=BUDGET, max_prefill_rows=2, prefix_caching=prefix_caching)
    live: list[Sequence] = []
    prefixes = [[7] * 12, [5, 6] * 6, []]
    for n, action in enumerate(script):
        if action[0] == "submit":
            _, length, max_tokens, prefix = action
            prompt = (prefixes[prefix] + list(range(100 + n, 100 + n + length)))[:24]
            # Admission (the engine's validate) refuses what a pool can never hold.
            if pools.shortfall(len(prompt) + max_tokens, BUDGET) is not None:
                continue
            seq = Sequence(f"r{n}", prompt, SamplingParams(max_tokens=max_tokens), seed=n)
            scheduler.add(seq)
            live.append(seq)
        elif action[0] == "cancel" and live:
            seq = live.pop(action[1] % len(live))
            scheduler.finish(seq)
        else:
            run_step(scheduler, live)
        check_pages(pools, live)
    # Everything still live runs to its end, then no page is referenced.
    for _ in range(2000):
        if not live:
            break
        run_step(scheduler, live)
        check_pages(pools, live)
    assert not live, "requests never finished"
    for gp in pools.pools:
        assert gp.pool.num_free == num_pages and not gp.pool.ref_count.any()


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
