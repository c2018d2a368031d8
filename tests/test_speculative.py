"""Speculative decoding is exact: the tokens with drafts equal the tokens without, on every family
of the parity suite, greedy and seeded sampling, with penalties, logprobs, preemption and
prefix hits; after forced rejections the KV at emitted positions and the prefix cache's block
hashes equal a run without drafts. The reference is the same engine decoding one token a step
(its drafter proposing nothing): the verify step must compute each position as decode does.

One engine per family (lazy programs, quick compiles), its drafter swapped between runs:
- `Silent`: proposes nothing (the engine decodes as without speculation);
- `Oracle`: proposes the reference's own continuation, with every `wrong`-th draft token
  changed, so drafts are accepted and rejected at known places;
- the model-free drafters, `ngram` and `suffix`, on prompts that repeat themselves.
"""

from __future__ import annotations

import numpy as np
import pytest

from jfire import faults
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.kv_cache import block_hashes
from jfire.sampling import SamplingParams
from jfire.speculative.drafters import NgramDrafter, SuffixDrafter
from tests.tiny_models import ALL_FAMILIES

PAGE = 4
CONFIG = dict(max_batch=4, max_prefill_rows=4, prefill_budget=16, page_size=PAGE, max_model_len=96, aot=False,
              quick_compile=True, speculative="ngram", num_draft_tokens=3)


class Silent:
    name = "silent"

    def __init__(self):
        self.snapshots: dict[str, tuple] = {}  # request id -> (tables, computed) at its last step

    def propose(self, seq, k):
        self.snapshots[seq.request_id] = ([list(t) for t in seq.tables], seq.computed)
        return []

    def observe(self, seq, proposed, accepted):
        pass

    def finished(self, seq):
        pass


class Oracle(Silent):
    """Drafts the reference's tokens for the request (by prompt and sampling), every `wrong`-th
    draft token changed."""

    name = "oracle"

    def __init__(self, answers: dict, wrong: int):
        super().__init__()
        self.answers, self.wrong, self.count = answers, wrong, 0

    def propose(self, seq, k):
        super().propose(seq, k)
        answer = self.answers[(tuple(seq.prompt_ids), seq.sampling)]
        draft = list(answer[seq.num_generated : seq.num_generated + k])
        for j in range(len(draft)):
            self.count += 1
            if self.wrong and self.count % self.wrong == 0:
                draft[j] = (draft[j] + 1) % 200 + 3
        return draft


def prompts_for(vocab: int) -> list[list[int]]:
    rng = np.random.RandomState(7)
    phrase = [int(x) for x in rng.randint(3, vocab, size=6)]
    return [
        phrase * 3 + [int(rng.randint(3, vocab))],  # repeats itself: the n-gram drafters find drafts
        [int(x) for x in rng.randint(3, vocab, size=9)],
        phrase[:3] * 4,
    ]


def requests_for(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    a, b, c = prompts_for(vocab)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    return [
        (a, greedy),
        (b, greedy),
        (c, SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True, logprobs=2)),
        (a, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.4)),
    ]


class Result:
    """A request's token ids and logprobs entries, as its outputs streamed them."""

    def __init__(self, handle):
        self.token_ids, self.logprobs, self.outputs = [], [], 0
        for out in handle:
            self.token_ids += out.token_ids
            self.logprobs += out.logprobs or []
            self.outputs += 1


def run(engine, drafter, requests) -> list[Result]:
    engine.speculator.drafter = drafter
    engine.speculator.weigh = False  # verify whenever a row has a draft, however the steps time
    handles = [engine.submit(ids, sp) for ids, sp in requests]
    return [Result(h) for h in handles]


# Families whose attention runs on XLA's reference (multi-head latent attention, Llama 4's
# chunked and NoPE layers) rather than the CPU decode-attention kernel: XLA compiles a verify
# step's b x t decode rows apart from a decode step's b, and their logprobs came out within
# 3.4e-6 of decode's (every token the same); the kernel's sums do not depend on the rows beside
# a row, and those families' logprobs are decode's bit for bit.
XLA_ATTENTION = {"deepseek_v3", "kimi_k2", "llama4", "llama4_mm"}


def same(got, want, family="llama3"):
    """The same tokens; the same logprobs, bit for bit where attention runs on the CPU kernel
    (else within float32 rounding, and the same top ids). `family` "mesh": on a mesh, XLA's."""
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    if family not in XLA_ATTENTION and family != "mesh":
        assert [c.logprobs for c in got] == [c.logprobs for c in want]  # the same floats, the same top ids
        return
    for g, w in zip(got, want):
        assert [[i for i, _ in e[1]] for e in g.logprobs] == [[i for i, _ in e[1]] for e in w.logprobs]
        np.testing.assert_allclose([e[0] for e in g.logprobs], [e[0] for e in w.logprobs], rtol=0, atol=1e-5)


FAMILIES = sorted(ALL_FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_change_no_token(family, tiny_hf_dir):
    model = load_model(str(tiny_hf_dir(family)), "float32")
    requests = requests_for(model.config.vocab_size)
    with Engine(model, EngineConfig(**CONFIG)) as engine:
        want = run(engine, Silent(), requests)
        answers = {(tuple(p), sp): c.token_ids for (p, sp), c in zip(requests, want)}
        for drafter in (Oracle(answers, wrong=3), NgramDrafter(), SuffixDrafter()):
            before = engine.stats()
            same(run(engine, drafter, requests), want, family)
            stats = engine.stats()
            proposed = stats["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            if isinstance(drafter, Oracle):  # drafts were verified, kept and refused
                assert 0 < accepted < proposed
        assert engine.stats()["pages_used"] == 0


def test_kv_and_block_hashes_after_rejections_equal_decoding(tiny_hf_dir, monkeypatch):
    """One request alone, decoded without drafts and then with drafts rejected every third
    token: as its last token is appended, the KV of every computed position (read through its
    own page table) is bit for bit the same, its tables as long, and the prefix cache holds the
    same blocks: the prompt's, never one of generated tokens."""
    model = load_model(str(tiny_hf_dir("llama3")), "float32")
    prompt = prompts_for(model.config.vocab_size)[0]
    request = [(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]
    last = {}
    monkeypatch.setattr(faults, "before_output", lambda seq, token: last.update(
        tables=[list(t) for t in seq.tables], computed=seq.computed))
    results = []
    for make in (lambda answers: Silent(), lambda answers: Oracle(answers, wrong=3)):
        with Engine(model, EngineConfig(**CONFIG)) as engine:
            answers = {(tuple(p), sp): c.token_ids for (p, sp), c in zip(request, results[0][0])} if results else {}
            out = run(engine, make(answers), request)
            tables, computed = last["tables"], last["computed"]
            kv = {name: np.stack([np.asarray(a)[:, :, tables[0][p // PAGE], p % PAGE] for p in range(computed)])
                  for name, a in engine.runner.pages.items()}
            tokens = prompt + out[0].token_ids
            hashes = block_hashes(tokens[: len(tokens) // PAGE * PAGE], PAGE)
            registered = [engine.pools.first.page_of(h) is not None for h in hashes]
            verified = engine.stats()["spec_draft_tokens"]
            results.append((out, kv, len(tables[0]), computed, registered, verified))
    (plain, kv_plain, width_plain, n_plain, reg_plain, _), (spec, kv_spec, width_spec, n_spec, reg_spec, drafts) = results
    assert drafts > 0
    assert spec[0].token_ids == plain[0].token_ids
    assert n_spec == n_plain == len(prompt) + len(plain[0].token_ids) - 1
    assert width_spec == width_plain
    for name in kv_plain:
        np.testing.assert_array_equal(kv_spec[name], kv_plain[name])
    assert reg_spec == reg_plain
    assert reg_plain == [i < len(prompt) // PAGE for i in range(len(reg_plain))]


class Once(Silent):
    """Drafts the reference's next tokens once, when the request has generated `at` tokens."""

    name = "once"

    def __init__(self, answer: list[int], at: int):
        super().__init__()
        self.answer, self.at = answer, at

    def propose(self, seq, k):
        super().propose(seq, k)
        return list(self.answer[self.at : self.at + k]) if seq.num_generated == self.at else []


def test_a_draft_found_after_a_token_is_verified_in_the_next_step(tiny_hf_dir):
    """A lone request decoding steadily: where its drafter finds a draft after some token, the
    very next step verifies it (every draft token kept), not a step already dispatched as a
    plain decode while the token was still on the device."""
    model = load_model(str(tiny_hf_dir("llama3")), "float32")
    request = [(prompts_for(model.config.vocab_size)[1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))]
    with Engine(model, EngineConfig(**CONFIG)) as engine:
        want = run(engine, Silent(), request)
        before = engine.stats()
        same(run(engine, Once(want[0].token_ids, at=6), request), want)
        stats = engine.stats()
    assert stats["spec_verify_rows"] - before["spec_verify_rows"] == 1
    assert stats["spec_accepted_tokens"] - before["spec_accepted_tokens"] == CONFIG["num_draft_tokens"]


class OnceFor(Once):
    """`Once`, for one request (by prompt) only."""

    def __init__(self, prompt: list[int], answer: list[int], at: int):
        super().__init__(answer, at)
        self.prompt = prompt

    def propose(self, seq, k):
        return super().propose(seq, k) if seq.prompt_ids == self.prompt else []


def test_a_run_ahead_ends_once_the_batch_may_draft(tiny_hf_dir):
    """Five rows decode running ahead (more than the 4 that may draft); once one ends, the four
    left read each step's ids, so a draft found after a token is verified in the next step."""
    model = load_model(str(tiny_hf_dir("llama3")), "float32")
    rng = np.random.RandomState(5)
    prompts = [[int(x) for x in rng.randint(3, model.config.vocab_size, size=6)] for _ in range(5)]
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=4 if i == 0 else 24, ignore_eos=True))
                for i, p in enumerate(prompts)]
    config = {**CONFIG, "max_batch": 8, "max_prefill_rows": 8, "prefill_budget": 64}
    with Engine(model, EngineConfig(**config)) as engine:
        want = run(engine, Silent(), requests)
        assert engine.stats()["run_ahead_steps"] > 0
        before = engine.stats()
        same(run(engine, OnceFor(prompts[1], want[1].token_ids, at=12), requests), want)
        stats = engine.stats()
    assert stats["spec_verify_rows"] - before["spec_verify_rows"] >= 1
    assert stats["spec_accepted_tokens"] - before["spec_accepted_tokens"] == CONFIG["num_draft_tokens"]


def test_drafts_with_preemption_and_prefix_hits(tiny_hf_dir):
    """A pool too small for every request at once (preemptions) and prompts sharing their
    first blocks (prefix hits): the same tokens with drafts as without."""
    model = load_model(str(tiny_hf_dir("qwen3")), "float32")
    a, b, c = prompts_for(model.config.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    requests = [(a, greedy), (a + [5, 6], greedy), (c, greedy), (a[:8] + b, greedy)]
    with Engine(model, EngineConfig(**{**CONFIG, "num_pages": 22})) as engine:
        want = run(engine, Silent(), requests)
        assert engine.stats()["preemptions"] > 0 and engine.stats()["prefix_hit_tokens"] > 0
        answers = {(tuple(p), sp): c.token_ids for (p, sp), c in zip(requests, want)}
        preemptions = engine.stats()["preemptions"]
        same(run(engine, Oracle(answers, wrong=4), requests), want)
        assert engine.stats()["preemptions"] > preemptions
        same(run(engine, NgramDrafter(), requests), want)
