"""The group control servers and the KV channel between groups, as a stranger would try them:
one prefill group (with a host tier, so it takes prefix blocks from others) and one decode
group, each an engine of a tiny model behind its control app (jfire.disagg.worker) in this
process, with their own JAX transfer servers on 127.0.0.1 and an in-memory cluster store.

- Every control route but /health answers 401 without the deployment's control token, and
  does nothing; /health says its status and nothing more.
- A body over its bound gets 413 before any of it is read.
- /decode refuses, with 400, a transfer that is unsigned, re-signed by another deployment,
  replayed, or signed but unfit for this group (`shards: 2` for its one device, which used to
  kill the engine thread), and bad fields around it; the engine serves on.
- KV changed on the way (two words swapped: the plain sum stays the same) is refused by the
  keyed sum, and only that request fails.
- `prefix_from` pointing anywhere but another prefill group of the deployment makes no
  request at all; a named group is asked at its registered address, with the token, and its
  answer counts only if signed. Blocks under hashes that were not asked for are dropped.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import httpx
import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient
from jax.experimental import transfer

from jfire.deployment_secret import DeploymentSecret
from jfire.disagg import control_guard, prefix_store
from jfire.disagg.connectors import DecodeConnector, PrefillConnector
from jfire.disagg.deployment import Deployment
from jfire.disagg.prefix_store import SharedPrefixes, encode_blocks
from jfire.disagg.signed_store import SignedStore
from jfire.disagg.transfer_auth import sign_transfer
from jfire.disagg.worker import create_control_app
from jfire.engine import Engine, EngineConfig
from jfire.host_tier import HostBlock, HostTier
from jfire.kv_connector import ConnectorStack
from jfire.sampling import SamplingParams
from tests.memory_store import MemoryClient
from tests.test_host_tier import LIMITS, PAGE, tiny_model  # noqa: F401 - the fixture, shared

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=1)
PREFILL_GROUPS = frozenset({"prefill-0", "prefill-1"})


class Recorder(http.server.BaseHTTPRequestHandler):
    """A stranger's HTTP server on 127.0.0.1: it records every request it gets."""

    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.seen.append((self.path, self.headers.get("Authorization")))
        body = b"not blocks"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def recorder():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class Groups:
    def __init__(self, model, secret: DeploymentSecret, recorder: str):
        self.secret = secret
        self.auth = {"Authorization": f"Bearer {secret.bearer()}"}
        store = SignedStore(MemoryClient(), secret)
        client = jax.local_devices()[0].client
        self.prefill_server, self.decode_server = (
            transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"]) for _ in range(2)
        )
        config = EngineConfig(num_pages=64, **LIMITS)
        self.prefill_connector = PrefillConnector(
            server=self.prefill_server, store=store, group="prefill-0", transfer_timeout_s=10, secret=secret
        )
        tier = HostTier(64 << 20)
        self.shared = SharedPrefixes(tier)
        self.prefill = Engine(model, config, ConnectorStack(self.prefill_connector, tier, self.shared))
        self.decode = Engine(
            model,
            config,
            DecodeConnector(
                server=self.decode_server,
                store=store,
                transfer_timeout_s=10,
                secret=secret,
                prefill_groups=PREFILL_GROUPS,
                group="decode-0",
            ),
        )
        deployment = Deployment.load("local-1p1d")
        registered = {"prefill-1": recorder}  # where the other prefill group registered itself
        self.prefill_app = TestClient(
            create_control_app(
                self.prefill,
                deployment.process(1),
                self.shared,
                secret=secret,
                prefill_groups=PREFILL_GROUPS,
                control_of=registered.get,
            )
        )
        self.decode_app = TestClient(
            create_control_app(self.decode, deployment.process(2), secret=secret, prefill_groups=PREFILL_GROUPS)
        )

    def prefill_body(self, request_id: str, prompt: list[int], **extra) -> dict:
        return {"request_id": request_id, "prompt_ids": prompt, "sampling": GREEDY.to_json(), "shards": 1, **extra}

    def prefilled(self, request_id: str, prompt: list[int]) -> dict:
        r = self.prefill_app.post("/prefill", json=self.prefill_body(request_id, prompt), headers=self.auth)
        assert r.status_code == 200, r.text
        return r.json()

    def decode_body(self, request_id: str, prompt: list[int], first: dict, /, **changes) -> dict:
        body = {
            "request_id": request_id,
            "prompt_ids": prompt,
            "first_token": first["first_token"],
            "first_logprobs": first["first_logprobs"],
            "sampling": GREEDY.to_json(),
            "transfer": first["transfer"],
        }
        return {**body, **changes}

    def decoded(self, body: dict) -> list[dict]:
        with self.decode_app.stream("POST", "/decode", json=body, headers=self.auth) as r:
            assert r.status_code == 200, r.read()
            return [json.loads(line) for line in r.iter_lines() if line]


@pytest.fixture(scope="module")
def groups(tiny_model, recorder):  # noqa: F811 - the shared fixture
    made = Groups(tiny_model, DeploymentSecret.generate(), recorder)
    with made.prefill, made.decode:
        yield made


def prompt(seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 200, size=21)]


@pytest.fixture(scope="module")
def colocated(tiny_model):  # noqa: F811 - the shared fixture
    with Engine(tiny_model, EngineConfig(num_pages=64, **LIMITS)) as engine:
        return {seed: engine.generate([(prompt(seed), GREEDY)])[0].token_ids for seed in range(4)}


def tokens(lines: list[dict]) -> list[int]:
    assert lines[-1]["finish_reason"] == "length", lines[-1]
    return [t for line in lines for t in line.get("token_ids", [])]


def test_control_routes_answer_401_without_the_token_and_do_nothing(groups):
    routes = [("POST", "/prefill"), ("POST", "/decode"), ("POST", "/cancel"), ("POST", "/kv/blocks"), ("GET", "/stats")]
    wrong = [
        {},
        {"Authorization": "Bearer "},
        {"Authorization": f"Bearer {groups.secret.hex()}"},  # the secret itself is not the token
        {"Authorization": f"Bearer {DeploymentSecret.generate().bearer()}"},  # another deployment's
        {"Authorization": groups.secret.bearer()},
    ]
    published = groups.prefill.stats()["transfers_published"]
    body = groups.prefill_body("unauthorized", prompt(0))
    for headers in wrong:
        for method, path in routes:
            r = groups.prefill_app.request(method, path, json=body, headers=headers)
            assert r.status_code == 401 and "deployment token" in r.json()["error"], (headers, path, r.text)
        groups.prefill_app.post("/cancel", json={"request_id": "cancel-me"}, headers=headers)
    assert groups.prefill.stats()["transfers_published"] == published
    # The unauthenticated /cancel did nothing: the request it named still runs.
    assert groups.prefilled("cancel-me", prompt(0))["transfer"]["num_pages"] == 6
    health = groups.decode_app.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "compiling": False}


def test_a_body_over_its_bound_gets_413_before_it_is_read(groups):
    """ASGI-level: the refusal comes before the route's app is called or a byte is received."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def receive():
        reached.append("receive")
        return {"type": "http.request", "body": b"", "more_body": False}

    guard = control_guard.ControlGuard(app, groups.secret)
    token = (b"authorization", f"Bearer {groups.secret.bearer()}".encode())

    def call(path: str, length: str | None) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        headers = [token] + ([(b"content-length", length.encode())] if length is not None else [])
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        asyncio.run(guard(scope, receive, send))
        return sent[0]["status"] if sent else 200

    assert call("/decode", str(control_guard.MAX_BODY_BYTES + 1)) == 413
    assert call("/prefill", str(control_guard.MAX_PREFILL_BODY_BYTES + 1)) == 413
    assert call("/cancel", None) == 411  # a body that does not say its length cannot be bounded
    assert reached == []
    assert call("/prefill", str(control_guard.MAX_BODY_BYTES + 1)) == 200  # images: /prefill's bound is larger
    assert reached == ["/prefill"]


def test_a_split_request_through_the_control_apps_equals_colocated_and_its_transfer_is_taken_once(groups, colocated):
    first = groups.prefilled("whole-1", prompt(1))
    body = groups.decode_body("whole-1", prompt(1), first)
    assert tokens(groups.decoded(body)) == colocated[1]
    r = groups.decode_app.post("/decode", json={**body, "request_id": "replayed"}, headers=groups.auth)
    assert r.status_code == 400 and "taken already" in r.json()["error"]


def test_a_bad_decode_request_answers_400_and_the_engine_serves_on(groups, colocated):
    first = groups.prefilled("bad-0", prompt(2))
    t = first["transfer"]
    assert "shards" in t and "signature" in t and len(t["id"]) == 32

    def signed(**changes) -> dict:  # as if a prefill group of this deployment had made it
        return sign_transfer(groups.secret, {**t, **changes})

    cases = [
        ({"transfer": {**t, "shards": 2}}, "not signed"),  # the request that used to kill the engine thread
        ({"transfer": sign_transfer(DeploymentSecret.generate(), t)}, "not signed"),
        ({"transfer": {k: v for k, v in t.items() if k != "signature"}}, "not signed"),
        ({"transfer": signed(shards=2)}, "'shards' must be a split of the heads this group can take"),
        ({"transfer": signed(group="prefill-9")}, "'group' must be one of this deployment's prefill groups"),
        ({"transfer": signed(address="nowhere")}, "'address' must be"),
        ({"transfer": signed(num_pages=2, pages=t["pages"][:2])}, "the transfer has 2 pages"),
        ({"transfer": signed(uuid=-1)}, "'uuid' must be"),
        ({"transfer": signed(id="0" * 31)}, "'id' must be"),
        ({"transfer": signed(protocol="blocks")}, "'sender' must be"),
        ({"transfer": signed(codec="zip")}, "coded as 'zip'"),
        ({"transfer": "elsewhere"}, "'transfer' must be the object"),
        ({"first_token": 10**9}, "'first_token' must be a token id"),
        ({"first_logprobs": [0.0, [["x", 0.0]]]}, "'first_logprobs' must be"),
        ({"prompt_ids": [1, "2"]}, "'prompt_ids' must be"),
        ({"request_id": ""}, "'request_id' must be"),
        ({"sampling": {**GREEDY.to_json(), "temperature": "hot"}}, "'sampling.temperature' must be float"),
        ({"sampling": {**GREEDY.to_json(), "colour": 1}}, "'sampling' has no parameter 'colour'"),
        ({"shards": 2}, "/decode takes no shards"),
    ]
    for changes, message in cases:
        r = groups.decode_app.post(
            "/decode", json=groups.decode_body("bad-0", prompt(2), first, **changes), headers=groups.auth
        )
        assert r.status_code == 400 and message in r.json()["error"], (changes, r.text)
    r = groups.decode_app.post("/decode", content=b"[1, 2", headers=groups.auth)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    assert groups.decode.error is None and groups.decode.stats()["transferring"] == 0
    # None of them took the transfer's id: the request itself goes through, as colocated.
    assert tokens(groups.decoded(groups.decode_body("bad-0", prompt(2), first))) == colocated[2]


def test_kv_changed_on_the_way_is_refused_by_its_keyed_sum(groups, colocated):
    """A stranger on the transfer server's network takes the published pages and publishes
    others under the same id: two words of a page swapped, which the plain wrapping sum the
    checksum used to be cannot see. The decode group refuses them; only that request fails."""
    first = groups.prefilled("forged", prompt(3))
    t = first["transfer"]
    structs = groups.prefill_connector.layout.wire_structs(t["num_pages"], t["shards"])
    connection = groups.decode_server.connect(t["address"])
    taken = [np.array(a) for a in connection.pull(t["uuid"], structs)]
    del connection  # only once every byte has arrived (kv_transfer.fetch says why)
    forged = [a.copy() for a in taken]
    page = forged[1].reshape(-1)
    page[0], page[1] = page[1], page[0]
    assert not np.array_equal(forged[1], taken[1])
    plain = [int(a.view(np.uint32).astype(np.uint64).sum() % (1 << 32)) for a in (taken[1], forged[1])]
    assert plain[0] == plain[1]
    groups.prefill_server.await_pull(t["uuid"], [jax.device_put(a, s.sharding) for a, s in zip(forged, structs)])
    corrupted = groups.decode.stats()["transfers_corrupted"]
    lines = groups.decoded(groups.decode_body("forged", prompt(3), first))
    assert lines[-1]["finish_reason"] == "error" and "arrived with other bytes than were sent" in lines[-1]["error"]
    assert groups.decode.stats()["transfers_corrupted"] == corrupted + 1
    assert groups.decode.stats()["pages_used"] == 0
    again = groups.prefilled("after-forged", prompt(3))
    assert tokens(groups.decoded(groups.decode_body("after-forged", prompt(3), again))) == colocated[3]


def test_prefix_from_outside_the_deployment_makes_no_request(groups, recorder):
    blocks = {"first": 0, "blocks": 2}
    refused = [
        ({"control": recorder, **blocks}, "'prefix_from' must be {'group'"),  # a URL, as prefix_from once was
        ({"group": recorder, **blocks}, "not another prefill group of this deployment"),
        ({"group": "prefill-7", **blocks}, "not another prefill group of this deployment"),
        ({"group": "prefill-0", **blocks}, "not another prefill group"),  # itself
        ({"group": "prefill-1", "first": 2, "blocks": 1}, "0 <= first < blocks"),
    ]
    Recorder.seen.clear()
    for prefix_from, message in refused:
        body = groups.prefill_body("prefix", prompt(0), prefix_from=prefix_from)
        r = groups.prefill_app.post("/prefill", json=body, headers=groups.auth)
        assert r.status_code == 400 and message in r.json()["error"], (prefix_from, r.text)
    assert Recorder.seen == []
    # Another prefill group of the deployment is asked at the address it registered, with the
    # token; its answer is not signed, so nothing is taken from it and the prompt is computed here.
    received = groups.prefill.stats()["shared_blocks_received"]
    body = groups.prefill_body("prefix-ok", prompt(0), prefix_from={"group": "prefill-1", **blocks})
    r = groups.prefill_app.post("/prefill", json=body, headers=groups.auth)
    assert r.status_code == 200, r.text
    assert Recorder.seen == [("/kv/blocks", f"Bearer {groups.secret.bearer()}")]
    assert groups.prefill.stats()["shared_blocks_received"] == received


def test_only_the_blocks_asked_for_are_taken_and_only_from_this_deployment():
    secret, identity = DeploymentSecret.generate(), b"model"
    asked = [bytes([i]) * 16 for i in range(3)]
    stranger = b"\xee" * 16

    def block(i: int) -> HostBlock:
        return HostBlock([np.full((2, 4), i, np.float32)], i)

    def holder_answering(blocks: list[tuple[bytes, HostBlock]], signer: DeploymentSecret):
        def answer(request: httpx.Request) -> httpx.Response:
            hashes = [bytes.fromhex(h) for h in json.loads(request.content)["hashes"]]
            data = encode_blocks(blocks)
            tag = prefix_store.blocks_tag(signer, identity, hashes, data)
            return httpx.Response(200, content=data, headers={prefix_store.TAG_HEADER: tag})

        return httpx.Client(transport=httpx.MockTransport(answer))

    def fetched(blocks, signer=secret) -> list[bytes]:
        got = prefix_store.fetch_blocks(holder_answering(blocks, signer), "http://holder", asked, identity, secret)
        return [h for h, _ in got]

    assert fetched([(asked[0], block(0)), (asked[1], block(1))]) == asked[:2]
    # A block nobody asked for ends the run: it and everything after it are dropped.
    assert fetched([(asked[0], block(0)), (stranger, block(9)), (asked[1], block(1))]) == asked[:1]
    assert fetched([(stranger, block(9)), *((h, block(i)) for i, h in enumerate(asked))]) == []
    assert fetched([(asked[1], block(1)), (asked[0], block(0))]) == []  # out of order
    assert fetched([*((h, block(i)) for i, h in enumerate(asked)), (stranger, block(9))]) == asked
    with pytest.raises(ValueError, match="not signed by a group of this deployment"):
        fetched([(asked[0], block(0))], signer=DeploymentSecret.generate())
