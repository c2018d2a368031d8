"""EAGLE-3 heads drafting inside the engine (`--speculative eagle3 --draft-model PATH`,
jfire.speculative.model_drafts) for tiny random Llama 3.x, Llama 4 and Kimi K2 (DeepSeek-V3
shaped, MLA) targets, each with a random head in the released layout (tests/models/test_eagle3.py
checks the head itself against a float64 forward written from the paper's equations): a
Llama-style head for the Llama targets, an MLA head (kimi-k2.5-eagle3-mla's layout) for Kimi.

- The target's intermediate hidden states the head reads (`family.capture_hidden`, kept inside
  the layer scan) equal transformers' `output_hidden_states` at those indices.
- Exact: the greedy tokens equal the same engine's without speculation.
- The drafts are the head's: before every step, each row's draft equals a recomputation without
  any cache (the target over the whole sequence with its states captured, `fuse`, then the
  head over every pair and its chain, from scratch), with the head's drafts verified as they
  come and with a reference's own continuation proposed instead (every third token wrong), so
  catch-up also covers runs of kept drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.models import eagle3, family
from jfire.sampling import SamplingParams
from tests.models.test_eagle3 import GQA_CONFIG, MLA_CONFIG, default_names, random_tensors, write_head
from tests.test_speculative_mtp import CONFIG, LONGEST, K, Recording, generate
from tests.tiny_models import ALL_FAMILIES, tiny_hf_config

# target family -> (its layers, the head's config: aux ids are layer outputs, so indices id + 1)
TARGETS = {
    "llama3": (6, {**GQA_CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}),
    "llama4": (4, {**GQA_CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}),
    "kimi_k2": (3, {**MLA_CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}}),
}


def head_config(target, hf: dict) -> dict:
    """The head's config for this target: its width and vocabulary."""
    return {**hf, "target_hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "draft_vocab_size": 96}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def setup(request, tmp_path_factory):
    """(family, the HF target, the jfire target, the head's directory)."""
    name = request.param
    layers, hf_head = TARGETS[name]
    config = tiny_hf_config(name)
    config.num_hidden_layers = layers
    if name == "llama4":
        config.no_rope_layers = [0, 1, 1, 0][:layers]
    torch.manual_seed(0)
    hf = ALL_FAMILIES[name][1](config).eval()
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    target = load_model(str(path), "float32")
    hf_head = head_config(target.config, hf_head)
    head = write_head(path / "eagle3", hf_head, random_tensors(hf_head, default_names(hf_head), seed=1))
    return name, hf, target, head


def requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.RandomState(5)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    return [([int(x) for x in rng.randint(3, vocab, size=n)], greedy) for n in (13, 6)]


def states_program(target, indices):
    """jfire's target over tokens [1, LONGEST], jitted: (final hidden, {index: hidden state})."""
    tcfg = target.config

    def run(params, tokens, positions):
        cache = family.init_cache(tcfg, 1, LONGEST, jnp.float32)
        table = cache.pop("page_table")
        with family.capture_hidden(indices) as found:
            hidden, _ = tcfg.decoder(params, tokens, positions, cache, table)
        return hidden, dict(found)

    return jax.jit(run)


def captured_states(target, program, tokens: np.ndarray):
    """`states_program`'s result for tokens [1, n] (padded to LONGEST), cut to n."""
    n = tokens.shape[1]
    padded = np.zeros((1, LONGEST), np.int32)
    padded[:, :n] = tokens
    positions = np.where(np.arange(LONGEST) < n, np.arange(LONGEST), -1)[None].astype(np.int32)
    hidden, found = program(target.params, padded, positions)
    return np.asarray(hidden)[0, :n], {i: np.asarray(v)[0, :n] for i, v in found.items()}


def test_captured_states_equal_transformers_hidden_states(setup):
    name, hf, target, head = setup
    cfg, _ = eagle3_head(head)
    indices = cfg.target_hidden_indices(TARGETS[name][0])
    tokens = np.random.RandomState(1).randint(3, target.config.vocab_size, size=(1, 11)).astype(np.int32)
    _, found = captured_states(target, states_program(target, indices), tokens)
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens.astype(np.int64)), output_hidden_states=True).hidden_states
    assert set(found) == set(indices)
    for i in indices:
        ref = want[i][0].numpy()
        err = np.linalg.norm(found[i] - ref) / np.linalg.norm(ref)
        assert err < 1e-5, f"{name} hidden state {i}: relative error {err:.2e}"


def eagle3_head(path):
    from jfire.checkpoint.eagle3_load import load_eagle3

    return load_eagle3(path)


class Recompute:
    """A sequence's drafts from scratch: the target over the whole sequence with its states
    captured, `fuse`, then the head over every pair (h[p], x[p + 1]), and for each further draft
    over the pairs with the chain's own output hidden state and token appended."""

    def __init__(self, target, head, layers: int):
        self.target = target
        self.cfg, params = eagle3_head(head)
        self.params = jax.device_put(params)
        self.indices = self.cfg.target_hidden_indices(layers)
        self._states = states_program(target, self.indices)  # traced once, not once a step
        embed = eagle3.draft_embedding(self.params, target.params["embed"])
        cfg = self.cfg

        def layer(params, hidden, tokens, positions):
            cache = eagle3.init_cache(cfg, LONGEST // 4 + 1, 4)
            table = jnp.arange(LONGEST // 4)[None]
            logits, out, _ = eagle3.draft_forward(cfg, params, embed, hidden, tokens, positions, cache, table)
            return eagle3.to_target_ids(params, jnp.argmax(logits, axis=-1)), out

        self._layer = jax.jit(layer)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        n = len(tokens) - 1
        _, found = captured_states(self.target, self._states, np.asarray([tokens[:n]], np.int32))
        aux = np.concatenate([found[i] for i in self.indices], axis=-1)
        hidden = np.zeros((LONGEST, self.cfg.hidden_size), np.float32)
        hidden[:n] = np.asarray(eagle3.fuse(self.cfg, self.params, jnp.asarray(aux)))
        following, drafts = list(tokens[1:]), []
        for i in range(k):
            m = n + i
            next_tokens = np.zeros((1, LONGEST), np.int32)
            next_tokens[0, :m] = following
            pos = np.where(np.arange(LONGEST) < m, np.arange(LONGEST), -1)[None].astype(np.int32)
            ids, out = self._layer(self.params, hidden[None], next_tokens, pos)
            drafts.append(int(np.asarray(ids)[0, m - 1]))
            hidden[m] = np.asarray(out)[0, m - 1]
            following.append(drafts[-1])
        return drafts


def test_eagle3_drafts_are_exact_and_the_heads_own(setup):
    name, _, target, head = setup
    reqs = requests(target.config.vocab_size)
    with Engine(target, EngineConfig(**CONFIG)) as engine:
        plain = generate(engine, reqs)
    config = EngineConfig(**CONFIG, speculative="eagle3", draft_model=str(head), num_draft_tokens=K)
    recompute = Recompute(target, head, TARGETS[name][0])
    with Engine(target, config) as engine:
        engine.speculator.weigh = False  # verify whenever a row has a draft
        for answers in (None, {tuple(ids): tokens for (ids, _), (tokens, _) in zip(reqs, plain)}):
            recording = Recording(answers)
            engine.speculator.drafter = recording
            got = generate(engine, reqs)
            assert [t for t, _ in got] == [t for t, _ in plain], (
                f"{name}, proposing {'answers' if answers else 'drafts'}"
            )
            assert recording.seen
            full = 0
            for tokens, draft in recording.seen:
                assert draft, f"no draft after {len(tokens)} tokens"
                assert draft == recompute.drafts(tokens, K)[: len(draft)], f"{name}: after {len(tokens)} tokens"
                full += len(draft) == K
            assert full >= 0.8 * len(recording.seen)
        assert engine.stats()["spec_accepted_tokens"] >= 10  # the answers' runs were kept
