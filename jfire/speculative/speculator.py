"""The engine's speculative part: drafts for a step's decode rows, their lookahead pages, the
verify call, and the counts /stats and /metrics report.

How speculation meets the rest of the engine (docs/speculative.md):
- continuous batching and chunked prefill: a step's decode rows verify their drafts in one
  call beside the step's prefill chunks; rows without drafts decode as usual;
- pages: a row's pages grow to its last draft's position from free pages only (drafts never
  preempt anyone: a row that cannot get them drafts fewer tokens), and shrink back to what
  its emitted tokens need after the step;
- prefix caching: generated tokens are never hashed, so a rejected draft's entries, left in
  the pages, are never found by another request;
- running ahead: a batch that may draft (up to `max_rows` rows) does not run ahead: each step's
  ids are read before the next is planned, so a draft found after a token is verified in the
  very next step (running ahead, that step would already be on its way as a plain decode, one
  lost verify each time drafts begin). A larger batch runs ahead, and its run ends once the batch
  shrinks to where it may draft;
- structured outputs and min_tokens: a draft is cut where the grammar refuses it, and each
  position gets the mask decode would build after the drafts before it; the matcher advances
  by emitted tokens only (the output processor, as for decode);
- penalties and logprobs: each position is penalized by the tokens before it and reports its
  own logprobs, as decode does;
- a step verifies only where it is expected to emit more tokens a second than decoding
  (`Speculator.plan`: each draft token's chance of being kept, learned per support
  (jfire.speculative.acceptance), against the measured seconds of each program), and in the
  verify program of as many tokens a row as pays;
  a batch larger than `max_rows` rows always decodes without drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from jfire.scheduler import Scheduler, Sequence, Step
from jfire.speculative.acceptance import Acceptance, position
from jfire.speculative.drafters import Draft, Drafter, ModelDrafter, make_drafter

# Before a verify program's steps are timed, its step is taken as decode's stretched by this
# much for each token a row past the first (the default model on this CPU: 1 + 4 tokens a row
# cost 1.5x a decode step, 1 + 8 tokens 2.0x).
VERIFY_COST_PER_TOKEN = 0.125


@dataclasses.dataclass
class Plan:
    """A step's verify call: each decode row's draft (maybe empty) and its tokens' support keys,
    and the program's (rows, tokens)."""

    drafts: dict[Sequence, list[int]]
    keys: dict[Sequence, list[Hashable]]
    shape: tuple[int, int]


class Speculator:
    """`drafter` None: an engine that does not speculate (every call a no-op)."""

    def __init__(self, drafter: Drafter | None, num_draft_tokens: int, max_rows: int, eos_ids, max_model_len: int):
        self.drafter = drafter
        self.k = num_draft_tokens
        self.max_rows = max_rows
        self.eos_ids = frozenset(eos_ids)
        self.max_model_len = max_model_len
        self.proposed = 0  # draft tokens verified
        self.accepted = 0  # of which the model made the same
        self.verify_rows = 0  # rows verified (each emits its accepted drafts plus one token)
        # How often draft tokens were kept, by what supports them.
        self.acceptance = Acceptance()
        # Whether a step verifies only where that is expected to pay (False: whenever a row has
        # a draft, as tests that must see drafts verified want).
        self.weigh = True

    @classmethod
    def for_engine(cls, config, eos_ids, max_model_len: int, program_kinds) -> Speculator:
        """The speculator of an engine with settings `config` (an EngineConfig): without a
        drafter where it does not speculate (none asked for, or a role that does not decode)."""
        on = config.speculative and "decode" in program_kinds
        drafter = make_drafter(config.speculative) if on else None
        return cls(drafter, config.num_draft_tokens, config.speculative_max_rows, eos_ids, max_model_len)

    def may_draft(self, rows: int) -> bool:
        """Whether a step of `rows` decode rows may verify drafts (a drafter, few enough rows)."""
        return self.drafter is not None and rows <= self.max_rows

    def plan(self, seqs: list[Sequence], programs, seconds: dict) -> Plan | None:
        """How the step's decode rows `seqs` verify drafts, or None where decoding them one token
        each is expected to be faster (or nothing is drafted, or no verify program holds them).

        The choice weighs tokens a second: a verify program of t tokens a row emits, per row,
        1 + p1 + p1 p2 + ... + p1...pd tokens on average (d: its draft cut to t - 1; pj: the
        estimated chance that draft token j is kept, by its support) in the seconds that
        program's steps take (`seconds`, measured by the runner; before its first step,
        decode's stretched by VERIFY_COST_PER_TOKEN a token); decoding emits one token a row in
        a decode step's."""
        if not seqs or not self.may_draft(len(seqs)):
            return None
        options = programs.verify_options(len(seqs))
        if not options:
            return None
        drafts = {seq: self._draft(seq) for seq in seqs}
        if not any(d.tokens for d in drafts.values()):
            return None
        best = self._fastest(list(drafts.values()), options, seconds, programs.decode_shape(len(seqs)))
        if best is None:
            return None
        t = best[1]
        return Plan(
            {s: d.tokens[: t - 1] for s, d in drafts.items()}, {s: d.keys[: t - 1] for s, d in drafts.items()}, best
        )

    def _fastest(self, drafts: list[Draft], options, seconds: dict, decode_rows: int) -> tuple[int, int] | None:
        """The verify program (rows, tokens) expected to emit the most tokens a second, or None
        where decoding is (with `weigh` off: the largest)."""
        if not self.weigh:
            return options[-1]
        decode_s = seconds.get(("decode", decode_rows))
        best, best_rate = None, len(drafts) / decode_s if decode_s else 0.0
        for rows, t in options:
            verify_s = seconds.get(("verify", rows, t))
            if verify_s is None:
                verify_s = (decode_s or 0.0) * (1 + VERIFY_COST_PER_TOKEN * (t - 1))
            expected = sum(self.acceptance.expected_tokens(d.keys[: t - 1]) for d in drafts)
            rate = expected / verify_s if verify_s > 0 else float("inf")
            if rate > best_rate:
                best, best_rate = (rows, t), rate
        return best

    def _draft(self, seq: Sequence) -> Draft:
        sp = seq.sampling
        # Emitted tokens past max_tokens or the context would be thrown away: draft no further.
        room = min(self.k, sp.max_tokens - seq.num_generated - 1, self.max_model_len - len(seq.tokens))
        if room <= 0:
            return Draft([], [])
        draft = self.drafter.propose(seq, room)  # type: ignore[union-attr]
        if not isinstance(draft, Draft):  # no support to tell: a draft model's chain
            draft = Draft(list(draft), [position(j) for j in range(len(draft))])
        tokens = draft.tokens[:room]
        # A request ends at its first stop token: nothing after one can be emitted.
        for j, token in enumerate(tokens):
            if (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
                tokens = tokens[: j + 1]
                break
        if seq.matcher is not None and tokens:
            tokens = tokens[: seq.matcher.validate_tokens(tokens)]  # type: ignore[attr-defined]
        return Draft(tokens, draft.keys[: len(tokens)])

    def reserve(self, scheduler: Scheduler, drafts: dict[Sequence, list[int]]) -> None:
        """Pages up to each row's last draft, from free pages only; a row that cannot get them
        keeps the drafts its pages reach."""
        for seq, draft in drafts.items():
            if draft and isinstance(self.drafter, ModelDrafter):
                # The draft model's next chain is written past the verified tokens, in pages the
                # row holds (a chain ends where they do): room for it if free pages allow.
                scheduler.pools.grow(seq.tables, len(seq.tokens) + len(draft) + self.k)
            while draft and not scheduler.pools.grow(seq.tables, len(seq.tokens) + len(draft)):
                draft.pop()

    def verify(self, plan: Plan, step: Step, scheduler: Scheduler, runner) -> dict:
        """Runs the step's decode rows (the plan's) as one verify call (a ModelRunner's), their
        pages grown to their drafts first; returns each row's emitted (token, logprobs entry)
        run and records the counts in `step.emitted` (the scheduler's on_step_done)."""
        drafts = plan.drafts
        self.reserve(scheduler, drafts)
        runs = dict(zip(drafts, runner.run_verify(list(drafts), list(drafts.values()), plan.shape)))
        step.emitted = {seq: len(run) for seq, run in runs.items()}
        self.observe(plan, step.emitted)
        return runs

    def observe(self, plan: Plan, emitted: dict[Sequence, int]) -> None:
        """Counts what the plan's rows kept (`emitted`: tokens each row emitted)."""
        for seq, draft in plan.drafts.items():
            accepted = emitted[seq] - 1
            self.proposed += len(draft)
            self.accepted += accepted
            self.verify_rows += 1
            # reserve() may have cut the draft where pages ran out: the keys of what ran.
            self.acceptance.record(plan.keys[seq][: len(draft)], accepted)
            self.drafter.observe(seq, len(draft), accepted)  # type: ignore[union-attr]

    def finished(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.finished(seq)

    def stats(self) -> dict:
        if self.drafter is None:
            return {}
        return {
            "spec_draft_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_verify_rows": self.verify_rows,
            # Tokens a verified row emitted on average: its accepted drafts plus the model's own.
            "spec_mean_accepted_length": (self.accepted + self.verify_rows) / self.verify_rows
            if self.verify_rows
            else 0.0,
        }
