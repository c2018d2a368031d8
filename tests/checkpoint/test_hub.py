"""`--model org/name`: a Hugging Face id, found in the local Hugging Face cache.

The cache is made here, in the hub's own layout (`models--org--name/` with `blobs/`,
`snapshots/<commit>/` of links into the blobs, and `refs/main` naming the commit), and the
environment pointed at it as a user's would be (HF_HUB_CACHE, or HF_HOME with `hub/` in it).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jfire import cli
from jfire.checkpoint import hub
from jfire.checkpoint.load import load_model, resolve_model_path
from jfire.errors import JfireError
from tests.test_cli import assert_user_error, run_jfire
from tests.tiny_models import save_byte_tokenizer

REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_as_hub_cache(src: Path, cache: Path, repo_id: str, commit: str = COMMIT) -> Path:
    """`src`'s files as `hf download repo_id` leaves them in `cache`: each file a blob named by
    its hash, the snapshot a directory of relative links to the blobs. Returns the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir, tmp_path_factory) -> Path:
    """The tiny Llama with a tokenizer, so the tokenizer is found through the links too."""
    path = tmp_path_factory.mktemp("tiny-with-tokenizer") / "tiny-llama"
    shutil.copytree(tiny_hf_dir("llama2"), path)
    return save_byte_tokenizer(path)


@pytest.fixture
def cache(tiny, tmp_path, monkeypatch) -> Path:
    """A hub cache holding REPO_ID, named by HF_HUB_CACHE."""
    cache = tmp_path / "hub"
    lay_out_as_hub_cache(tiny, cache, REPO_ID)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def assert_same_model(a, b) -> None:
    assert a.config.to_dict() == b.config.to_dict()
    leaves_a, tree_a = jax.tree.flatten(a.params)
    leaves_b, tree_b = jax.tree.flatten(b.params)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.tokenizer is not None and b.tokenizer is not None
    assert a.tokenizer.encode("hub") == b.tokenizer.encode("hub")


def test_an_id_loads_what_its_directory_holds(tiny, cache):
    path, name = resolve_model_path(REPO_ID)
    assert path == cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT and name == REPO_ID
    by_id, by_dir = load_model(REPO_ID), load_model(str(tiny))
    assert by_id.name == REPO_ID
    assert_same_model(by_id, by_dir)


def test_the_cache_is_found_under_hf_home(tiny, tmp_path, monkeypatch):
    """Without HF_HUB_CACHE the cache is $HF_HOME/hub, read when the model is resolved (the
    library may have been imported, and its defaults fixed, long before)."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snapshot = lay_out_as_hub_cache(tiny, tmp_path / "hf" / "hub", REPO_ID)
    assert hub.hub_cache_dir() == tmp_path / "hf" / "hub"
    assert resolve_model_path(REPO_ID)[0] == snapshot


def test_a_local_path_wins_over_an_id(tiny, cache, tmp_path, monkeypatch):
    local = tmp_path / "work" / REPO_ID
    shutil.copytree(tiny, local)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_path(REPO_ID)[0] == Path(REPO_ID)
    assert hub.resolve_source("./" + REPO_ID) == Path(REPO_ID)


def test_paths_are_not_taken_for_ids():
    for model in ("org/name", "Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.1-8B"):
        assert hub.is_repo_id(model), model
    for model in ("/abs/path", "./rel", "a/b/c", "name", "org/model.gguf", "~/models/x", "org/-x", "a--b/c"):
        assert not hub.is_repo_id(model), model
    with pytest.raises(JfireError, match="does not exist"):  # a path's own error, not the cache's
        load_model("/nonexistent/jfire-model")


def test_a_missing_id_names_the_cache_and_what_to_do(cache):
    with pytest.raises(JfireError) as e:
        resolve_model_path("tiny-org/missing")
    message = str(e.value)
    for fragment in ("'tiny-org/missing'", "not a local path", str(cache), "models--tiny-org--missing",
                     REPO_ID,  # what the cache does hold: a typo shows
                     "hf download tiny-org/missing", "HF_HUB_CACHE", ".gguf", "jfire convert"):
        assert fragment in message, fragment
    assert "\n" not in message


def test_an_incomplete_download_is_refused(tiny, cache):
    """refs/main names a commit whose snapshot is not there (a download cut short)."""
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("f" * 40)
    with pytest.raises(JfireError, match=r"models--tiny-org--tiny-llama is there but has no usable snapshot"):
        resolve_model_path(REPO_ID)


def test_a_missing_cache_directory_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "nowhere"))
    with pytest.raises(JfireError, match=f"the cache directory {tmp_path / 'nowhere'} does not exist"):
        resolve_model_path(REPO_ID)


def test_convert_takes_an_id_and_names_the_checkpoint_after_it(cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("jfire.checkpoint.default_model.default_checkpoints_dir", lambda: tmp_path / "ckpt")
    assert cli.main(["convert", REPO_ID, "--dtype", "float32", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'ckpt' / 'tiny-llama'}"
    assert_same_model(load_model(str(tmp_path / "ckpt" / "tiny-llama")), load_model(REPO_ID))


def test_the_commands_take_an_id(cache):
    """Through the real console script: `plan` reads the config by id; a missing id is one
    line on stderr, exit status 2, no traceback."""
    proc = run_jfire("plan", "--model", REPO_ID, "--mesh", "single", "--device-memory-gib", "16", "--no-compile",
                     "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] == str(cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT)
    assert_user_error(run_jfire("generate", "--model", "tiny-org/missing", "--prompt-ids", "1,2"),
                      "'tiny-org/missing'", str(cache), "hf download tiny-org/missing", "jfire convert")
