"""The programs' optional inputs: one argument after the ones every call takes, present only
where the engine uses one of them (a program without them is traced as before)."""

from __future__ import annotations

from typing import NamedTuple

from jfire.speculative.model_drafts import DraftIn


class Extras(NamedTuple):
    draft: DraftIn | None = None  # a draft model's inputs (jfire.speculative.model_drafts)
    # A prefill's image rows (jfire.vision.encoder): values float32 [b, t, e] replacing the token
    # embeddings where mask [b, t] is set.
    embeds: tuple | None = None
