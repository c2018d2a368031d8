"""What a new user meets first: mistakes found before anything slow starts (a busy port, a
missing model, a mesh the model or the devices cannot take), each one line and exit status 2;
every option's default in --help; `jfire plan` of the default model."""

from __future__ import annotations

import argparse
import socket
import time

import pytest

from jfire.cli import build_parser
from tests.test_cli import assert_user_error, run_jfire


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_serve_on_a_busy_port_is_one_line_at_once(busy_port):
    t0 = time.monotonic()
    run = run_jfire("serve", "--port", busy_port)
    assert time.monotonic() - t0 < 2.0 + 1.0  # the 2 s promised, plus this busy machine's process start
    assert_user_error(run, f"127.0.0.1:{busy_port}", "in use", "--port")


def test_launch_with_a_missing_model_starts_no_process():
    run = run_jfire("launch", "local-1p1d", "--model", "/nonexistent/jfire-model")
    assert_user_error(run, "'/nonexistent/jfire-model'", "does not exist")  # and no "process N ... pid" line


def test_launch_refuses_a_group_mesh_the_model_cannot_take(tmp_path, default_checkpoint):
    deployment = tmp_path / "tp4.toml"
    deployment.write_text('name = "tp4"\n[coordinator]\nport = 0\n[frontend]\nport = 0\n'
                          '[[groups]]\nname = "prefill-0"\nrole = "prefill"\nmesh = "tp=4"\n'
                          '[[groups]]\nname = "decode-0"\nrole = "decode"\nmesh = "single"\n')
    run = run_jfire("launch", deployment)
    assert_user_error(run, "group 'prefill-0'", "tp=4 does not divide the 9 attention heads", "Would fit")


def test_a_mesh_larger_than_the_devices_names_cpu_devices(default_checkpoint):
    run = run_jfire("generate", "--mesh", "pp=2", "--prompt", "hi")
    assert_user_error(run, "needs 2 devices", "--cpu-devices 2")


def test_plan_takes_the_default_model(default_checkpoint):
    run = run_jfire("plan", "--model", "default", "--mesh", "cpu-pp2-tp3", "--device-memory-gib", "2",
                    "--dtype", "float32", "--no-compile")
    assert run.returncode == 0, run.stderr
    assert "mesh        cpu-pp2-tp3 (dp=1 pp=2 tp=3 ep=1)" in run.stdout and "fits        yes" in run.stdout


def test_every_default_is_in_help():
    parser = build_parser()
    for name, command in parser._subparsers._group_actions[0].choices.items():
        text = " ".join(command.format_help().split())
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or action.default in (None, False, []):
                continue
            assert action.help, f"jfire {name} {action.option_strings or action.dest} has no help"
            default = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
            assert f"default: {default}" in text or f"default {default}" in text, (name, action.option_strings)
