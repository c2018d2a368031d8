"""Speculative decoding: drafts proposed cheaply, verified by the target model in one step.

A decode row with drafts d1..dk runs as one verify row of k + 1 tokens (its last token and
the drafts) through `jfire.speculative.verify`: every position is computed as a decode step
would compute it and sampled with that step's random key, and the row keeps the sampled
tokens up to the first that differs from its draft (plus that one). So the tokens are the
ones decoding without drafts gives, greedy or seeded, only several per weight read.

- `drafters`: where drafts come from (model-free: n-gram prompt lookup, the longest earlier
  match in the request's own text, else an index over earlier requests' outputs);
- `acceptance`: how likely each draft token is to be kept, learned by what supports it;
- `verify`: the verify program and the attention adaptor that makes each position a decode row;
- `rejection`: the rejection sampler for drafts with a distribution of their own (a draft model);
- `speculator`: the engine's part that drafts, verifies and reports (docs/speculative.md).
"""
