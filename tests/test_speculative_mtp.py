"""DeepSeek-V3's MTP layer drafting inside the engine (`--speculative mtp`,
jfire.speculative.model_drafts), on a tiny random DeepSeek-V3 whose checkpoint holds an MTP
layer written as DeepSeek ships it (tests/models/test_mtp.py, which checks the layer itself
against transformers' `generate(use_mtp=True)`).

- Exact: the tokens (greedy and seeded sampling, with logprobs) equal the same engine's
  without speculation.
- The drafts are the MTP layer's: before every step, each row's draft equals a recomputation
  without any cache: the target over the whole sequence, then the MTP layer over every pair
  (h[p], x[p + 1]) and its chain, from scratch. That holds only if each program's catch-up
  wrote the draft cache at every position it confirmed (prefill chunks, decode steps, verify
  steps that kept some drafts and dropped the rest) and the chain read nothing stale.
- Drafts are accepted at known places too: the verify steps are also fed a reference's own
  continuation with every third token wrong (the MTP program still runs), so catch-up covers
  runs of kept drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.models import family, mtp
from jfire.sampling import SamplingParams
from tests.models.test_mtp import save_with_mtp

K = 3  # draft tokens a step
LONGEST = 64  # the recomputation's padded sequence length
CONFIG = dict(
    max_batch=4,
    max_prefill_rows=4,
    prefill_budget=8,
    page_size=4,
    max_model_len=LONGEST - K - 1,
    aot=False,
    quick_compile=True,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(save_with_mtp(tmp_path_factory.mktemp("deepseek_mtp"))), "float32")


def requests() -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.RandomState(3)
    prompts = [[int(x) for x in rng.randint(3, 200, size=n)] for n in (13, 9, 5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True, logprobs=2)
    return [(prompts[0], greedy), (prompts[1], greedy), (prompts[2], sampled)]


def generate(engine, reqs):
    handles = [engine.submit(ids, sp) for ids, sp in reqs]
    out = []
    for h in handles:
        tokens, logprobs = [], []
        for o in h:
            tokens += o.token_ids
            logprobs += o.logprobs or []
        out.append((tokens, logprobs))
    return out


class Recording:
    """The engine's MTP drafter, recording each row's sequence and draft as a step plans;
    with `answers`, it proposes those (every third token changed) instead, while the programs
    still compute the MTP drafts it records."""

    name = "mtp"

    def __init__(self, answers: dict | None = None):
        self.answers, self.count = answers, 0
        self.seen: list[tuple[list[int], list[int]]] = []

    def propose(self, seq, k):
        self.seen.append((list(seq.tokens), list(seq.model_draft)))
        if self.answers is None:
            return seq.model_draft[:k]
        draft = list(self.answers[tuple(seq.prompt_ids)][seq.num_generated : seq.num_generated + k])
        for j in range(len(draft)):
            self.count += 1
            if self.count % 3 == 0:
                draft[j] = (draft[j] + 1) % 200 + 3
        return draft

    def observe(self, seq, proposed, accepted):
        pass

    def finished(self, seq):
        pass


@pytest.fixture(scope="module")
def plain(model):
    engine = Engine(model, EngineConfig(**CONFIG))
    engine.start()
    try:
        yield generate(engine, requests())
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def speculating(model):
    engine = Engine(model, EngineConfig(**CONFIG, speculative="mtp", num_draft_tokens=K))
    engine.start()
    engine.speculator.weigh = False  # verify whenever a row has a draft
    try:
        yield engine
    finally:
        engine.shutdown()


class Recompute:
    """The drafts of a sequence computed from scratch: the target over the whole sequence,
    then the MTP layer over every pair and, for each further draft, over the pairs with the
    chain's own output hidden state and token appended (one uncached pass each)."""

    def __init__(self, model):
        self.model = model
        self.cfg, self.params = mtp.load_mtp(model)
        cfg = model.config
        pages, page = LONGEST // 4 + 1, 4

        def target(params, tokens, positions):
            cache = family.init_cache(cfg, 1, LONGEST, jnp.float32)
            table = cache.pop("page_table")
            return cfg.decoder(params, tokens, positions, cache, table)[0]

        def layer(params, main, hidden, next_tokens, positions):
            cache = mtp.init_cache(self.cfg, pages, page, jnp.float32)
            table = jnp.arange(LONGEST // page)[None]
            logits, out, _ = mtp.mtp_forward(self.cfg, params, main, hidden, next_tokens, positions, cache, table)
            return logits, out

        self._target, self._layer = jax.jit(target), jax.jit(layer)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        n = len(tokens) - 1  # pairs (h[p], x[p + 1]) for p < n
        padded = np.zeros((1, LONGEST), np.int32)
        padded[0, :n] = tokens[:n]
        positions = np.where(np.arange(LONGEST) < n, np.arange(LONGEST), -1)[None].astype(np.int32)
        hidden = np.array(self._target(self.model.params, padded, positions)[0])
        following = list(tokens[1:])
        drafts = []
        for i in range(k):
            m = n + i
            next_tokens = np.zeros((1, LONGEST), np.int32)
            next_tokens[0, :m] = following
            pos = np.where(np.arange(LONGEST) < m, np.arange(LONGEST), -1)[None].astype(np.int32)
            logits, out = self._layer(self.params, self.model.params, hidden[None], next_tokens, pos)
            drafts.append(int(np.argmax(np.asarray(logits)[0, m - 1])))
            hidden[m] = np.asarray(out)[0, m - 1]
            following.append(drafts[-1])
        return drafts


def check_drafts(recording: Recording, recompute: Recompute) -> int:
    """Every recorded draft equals the recomputation's; returns how many were full length."""
    assert recording.seen
    full = 0
    for tokens, draft in recording.seen:
        assert draft, f"no draft after {len(tokens)} tokens"
        assert draft == recompute.drafts(tokens, K)[: len(draft)], f"after {len(tokens)} tokens"
        full += len(draft) == K
    return full


def test_mtp_drafts_are_exact_and_the_layers_own(model, plain, speculating):
    recording = Recording()
    speculating.speculator.drafter = recording
    got = generate(speculating, requests())
    assert [t for t, _ in got] == [t for t, _ in plain]
    for (_, lps), (_, want) in zip(got, plain):  # MLA attention runs on XLA: see test_speculative
        for a, b in zip(lps, want):
            assert a[1] and [i for i, _ in a[1]] == [i for i, _ in b[1]]
            np.testing.assert_allclose(a[0], b[0], rtol=0, atol=1e-5)
    full = check_drafts(recording, Recompute(model))
    # The chain ends where the row's pages do; the speculator reserves room for it.
    assert full >= 0.8 * len(recording.seen), f"{full} of {len(recording.seen)} drafts had {K} tokens"
    stats = speculating.stats()
    assert stats["spec_verify_rows"] >= len(recording.seen) and stats["spec_draft_tokens"] > 0


def test_mtp_catch_up_over_kept_drafts(model, plain, speculating):
    answers = {tuple(ids): tokens for (ids, _), (tokens, _) in zip(requests(), plain)}
    recording = Recording(answers)
    speculating.speculator.drafter = recording
    before = speculating.stats()["spec_accepted_tokens"]
    got = generate(speculating, requests()[:2])  # the greedy ones: the answers are theirs
    assert [t for t, _ in got] == [t for t, _ in plain[:2]]
    assert speculating.stats()["spec_accepted_tokens"] - before >= 10
    check_drafts(recording, Recompute(model))
