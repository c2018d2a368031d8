"""API keys: a key file of several keys, any of which opens the API (and none of which travels
on a command line the launcher starts); /health that shows a deployment's group addresses and
pids only to a caller with an API key or the deployment's control token; and `jfire launch`'s
key reaching the frontend's server (its environment, never its argv)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from jfire import cli, deployment_secret
from jfire.deployment_secret import DeploymentSecret
from jfire.disagg import launch
from jfire.disagg.deployment import Deployment
from jfire.errors import JfireError
from serve import api_keys
from serve.app import ServerState, create_app

KEYS = ("first-key-0123", "second-key-4567")
GROUPS = {
    "prefill-0": {"role": "prefill", "alive": True, "pid": 4242, "control": "http://127.0.0.1:9101",
                  "transfer": "127.0.0.1:9102", "mesh": "single", "devices": 1, "in_flight": 0, "restarts": 0,
                  "compiling": False},
    "decode-0": {"role": "decode", "alive": False, "pid": 4343, "control": "http://127.0.0.1:9201",
                 "transfer": "127.0.0.1:9202", "mesh": "single", "devices": 1, "in_flight": 0, "restarts": 1,
                 "compiling": False, "problem": "http://127.0.0.1:9201 is not answering"},
}


class FrontendLike:
    """What serve/app.py reads of an engine, with a frontend's /health body (its groups)."""

    tokenizer = None
    max_model_len = 64

    def health(self):
        return 200, {"status": "degraded", "message": "group(s) decode-0 down; serving with the rest",
                     "groups": {name: dict(g) for name, g in GROUPS.items()}}

    def stats(self):
        return {}

    def is_ready(self):
        return True


def key_file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_key_file_holds_several_keys_with_comments_and_blank_lines(tmp_path):
    path = key_file(tmp_path, f"# the team's keys\n\n  {KEYS[0]}  \n# retired: old-key\n{KEYS[1]}\n{KEYS[0]}\n")
    assert api_keys.read_file(path) == [KEYS[0], KEYS[1], KEYS[0]]
    assert api_keys.gather("env-key-89", path) == ("env-key-89", *KEYS)  # the env's key, then the file's, once each
    assert api_keys.gather(None, None) == ()


@pytest.mark.parametrize(("text", "mode", "message"), [
    ("# nothing but a comment\n\n", 0o600, "holds no key"),
    ("", 0o600, "holds no key"),
    (f"{KEYS[0]}\n", 0o644, r"readable by others \(mode 644\); run 'chmod 600"),
    (f"{KEYS[0]}\n", 0o640, r"readable by others \(mode 640\)"),
    (f"{KEYS[0]}\n{KEYS[1]} # the second\n", 0o600, "line 2 of the API key file .* holds a space"),
])
def test_a_key_file_that_is_empty_loose_or_malformed_is_refused(tmp_path, text, mode, message):
    with pytest.raises(JfireError, match=message):
        api_keys.read_file(key_file(tmp_path, text, mode))


def test_a_missing_key_file_is_refused_by_name(tmp_path):
    with pytest.raises(JfireError, match="cannot read the API key file .*missing"):
        api_keys.gather(None, tmp_path / "missing")


def test_any_of_the_keys_opens_the_api_and_nothing_else_does():
    http = TestClient(create_app(ServerState(FrontendLike(), "m", api_keys=KEYS, access_log=False)))
    for key in KEYS:
        r = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
    for header in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEYS[0][:-1]}"},
                   {"Authorization": f"Bearer {KEYS[0]}{KEYS[1]}"}, {"Authorization": KEYS[0]}):
        r = http.get("/v1/models", headers=header)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", header


def test_every_key_is_compared_whichever_matches(monkeypatch):
    """No early exit: the time taken does not say which key (if any) matched."""
    compared = []
    real = api_keys.hmac.compare_digest
    monkeypatch.setattr(api_keys.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    assert api_keys.matches(f"Bearer {KEYS[0]}", KEYS)
    assert compared == [f"Bearer {key}".encode() for key in KEYS]


def test_health_shows_group_addresses_and_pids_only_to_a_key_or_the_control_token():
    secret = DeploymentSecret.generate()
    state = ServerState(FrontendLike(), "m", api_keys=KEYS, access_log=False, deployment_secret=secret)
    http = TestClient(create_app(state))
    public = {"status": "degraded", "message": "group(s) decode-0 down; serving with the rest",
              "groups": {"prefill-0": {"role": "prefill", "alive": True}, "decode-0": {"role": "decode", "alive": False}}}
    for header in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {secret.derive('other').hex()}"}):
        r = http.get("/health", headers=header)
        assert r.status_code == 200 and r.json() == public, header
    for header in ({"Authorization": f"Bearer {KEYS[1]}"}, {"Authorization": f"Bearer {secret.bearer()}"}):
        r = http.get("/health", headers=header)
        assert r.json()["groups"] == GROUPS, header


def test_an_open_frontend_shows_group_addresses_only_to_the_control_token():
    secret = DeploymentSecret.generate()
    http = TestClient(create_app(ServerState(FrontendLike(), "m", access_log=False, deployment_secret=secret)))
    assert http.get("/health").json()["groups"]["prefill-0"] == {"role": "prefill", "alive": True}
    assert http.get("/health", headers={"Authorization": "Bearer anything"}).json()["groups"]["prefill-0"] == {
        "role": "prefill", "alive": True}
    assert http.get("/health", headers={"Authorization": f"Bearer {secret.bearer()}"}).json()["groups"] == GROUPS
    # With neither keys nor a secret nobody can prove anything: addresses stay hidden.
    http = TestClient(create_app(ServerState(FrontendLike(), "m", access_log=False)))
    assert http.get("/health").json()["groups"]["decode-0"] == {"role": "decode", "alive": False}


def test_launch_gives_the_key_to_the_frontend_in_its_environment_never_its_argv(tmp_path, monkeypatch):
    """`jfire launch --api-key KEY --api-key-file PATH`: the launcher starts the frontend with the
    key in its environment and only the file's path on its command line; the frontend's own
    `jfire launch --process-id 0` reads both, and its server requires every key."""
    path = key_file(tmp_path, f"{KEYS[1]}\n")
    monkeypatch.delenv(api_keys.ENV, raising=False)
    monkeypatch.setattr(launch, "check_model", lambda deployment, model: model)
    started: dict = {}

    def launch_local(deployment, deployment_arg, options, *rest):
        for process in deployment.processes:
            argv = launch.process_argv(deployment_arg, process.process_id, "127.0.0.1:1", options)
            started[process.process_id] = (argv, launch.with_api_key(process, options, launch.process_env(process)))
        return 0

    monkeypatch.setattr(launch, "launch_local", launch_local)
    assert cli.main(["launch", "local-1p1d", "--api-key", KEYS[0], "--api-key-file", str(path)]) == 0
    frontend_argv, frontend_env = started[0]
    assert frontend_env[api_keys.ENV] == KEYS[0]
    assert not any(KEYS[0] in arg for arg in frontend_argv)
    assert frontend_argv[frontend_argv.index("--api-key-file") + 1] == str(path.resolve())
    for process_id in (1, 2):  # the groups serve no API: no key in their environment either
        argv, env = started[process_id]
        assert api_keys.ENV not in env and not any(KEYS[0] in arg for arg in argv)

    # The frontend process: its argv and environment as given, into its server's state.
    ran: dict = {}
    monkeypatch.setattr(launch, "run_one", lambda deployment, process_id, coordinator, options, *rest, **kw: ran.update(
        options=options) or 0)
    secret = DeploymentSecret.generate()
    for name in (api_keys.ENV, deployment_secret.ENV):
        monkeypatch.setenv(name, frontend_env.get(name, secret.hex()))
    assert cli.main(frontend_argv) == 0
    options = ran["options"]
    assert options.api_key == KEYS[0] and KEYS[0] not in repr(options)
    state = launch.frontend_state(FrontendLike(), options, "default", secret)
    assert state.api_keys == KEYS and state.deployment_secret.key == secret.key
    http = TestClient(create_app(state))
    assert http.get("/v1/models").status_code == 401
    assert all(http.get("/v1/models", headers={"Authorization": f"Bearer {k}"}).status_code == 200 for k in KEYS)


def test_per_key_cache_salts_need_keys(monkeypatch, capsys):
    monkeypatch.delenv(api_keys.ENV, raising=False)
    monkeypatch.setattr(launch, "launch_local", lambda *a, **kw: pytest.fail("launched without keys"))
    assert cli.main(["launch", "local-1p1d", "--cache-salt-per-key"]) == 2
    assert "--cache-salt-per-key needs API keys" in capsys.readouterr().err
    with pytest.raises(JfireError, match="per-key cache salts need API keys"):
        ServerState(FrontendLike(), "m", cache_salt_per_key=True)


def test_options_hold_the_key_out_of_every_command_line():
    options = launch.Options(api_key="sekrit-key", api_key_file="/etc/jfire/keys", cache_salt_per_key=True)
    deployment = Deployment.load("local-1p1d")
    for process in deployment.processes:
        argv = launch.process_argv("local-1p1d", process.process_id, "127.0.0.1:1", options)
        assert "sekrit-key" not in " ".join(argv) and "--cache-salt-per-key" in argv
    assert "sekrit-key" not in repr(options)
