"""CURVE keys for a producer bound beyond loopback (tensorsocket/keys.py): the folder, the
errors of a client without keys, the ZAP handler over loopback, and, in a private network
namespace (where a producer bound to every interface reaches loopback only), a producer on
``tcp://*`` that admits the consumer with its keys, refuses at once one whose key it does not
admit or a plain one, and lets one with another producer key time out saying what to check,
while it serves on."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from tensorsocket import Consumer, keys
from tensorsocket.cli.query import query_status
from tests.support import SPAWN, private_network

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


KEY_FILES = ["consumer.key", "consumer.key_secret", "producer.key", "producer.key_secret"]


def _key_files(where):
    return {p.name: p.read_bytes() for p in where.iterdir() if ".key" in p.name}


def test_the_folder_is_made_private_once_and_kept(tmp_path, monkeypatch):
    where = tmp_path / "conf" / "keys"
    previous = os.umask(0o022)  # (a common one: the secrets must not follow it)
    try:
        keys.ensure(where)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert sorted(_key_files(where)) == KEY_FILES
    for secret in ("producer.key_secret", "consumer.key_secret"):
        assert stat.S_IMODE((where / secret).stat().st_mode) == 0o600
    before = _key_files(where)
    keys.ensure(where)  # a second producer, or the next run: the same keys
    assert _key_files(where) == before
    (where / "consumer.key_secret").unlink()  # (a producer needs only its public half: kept)
    keys.ensure(where)
    assert (where / "consumer.key").read_bytes() == before["consumer.key"]

    monkeypatch.delenv(keys.ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert keys.folder() == tmp_path / "xdg" / "tensorsocket" / "keys"
    monkeypatch.setenv(keys.ENV, str(where))
    assert keys.folder() == where


def test_a_folder_others_may_read_or_write_is_refused(tmp_path, monkeypatch):
    where = tmp_path / "open"
    where.mkdir(mode=0o755)
    where.chmod(0o755)
    with pytest.raises(keys.KeysError, match=r"open must be a directory owned by uid .* mode 0700"):
        keys.ensure(where)
    assert list(where.iterdir()) == []


def _make_keys(where):
    keys.ensure(where)


def test_producers_starting_together_make_one_set_of_keys(tmp_path):
    where = tmp_path / "keys"
    makers = [SPAWN.Process(target=_make_keys, args=(where,)) for _ in range(4)]
    for p in makers:
        p.start()
    for p in makers:
        p.join(60)
        assert p.exitcode == 0
    for name in ("producer", "consumer"):
        public, secret = zmq.auth.load_certificate(where / f"{name}.key_secret")
        assert zmq.auth.load_certificate(where / f"{name}.key")[0] == public == zmq.curve_public(secret)


def test_loopback_and_ipc_stay_plain(tmp_path, monkeypatch):
    monkeypatch.setenv(keys.ENV, str(tmp_path / "none"))  # no keys: nothing may ask for them
    for endpoint in ("tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555", "ipc:///tmp/x"):
        assert keys.client_folder(endpoint) is None
    assert not (tmp_path / "none").exists()


def _handshake(where, client_folder, port):
    """The monitor events of a client with ``client_folder``'s keys (None: plain) connecting."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | keys.HANDSHAKE_FAILED)
    try:
        keys.connect(sock, f"tcp://127.0.0.1:{port}", keys.client_keys(client_folder))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if monitor.poll(100):
                event = recv_monitor_message(monitor)["event"]
                return event
        return None
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def test_the_guard_admits_the_folders_consumer_key_only(tmp_path):
    """Over loopback, the server side forced (tests/test_keys' namespace test binds tcp://*):
    ZAP admits the folder's consumer key, refuses another client key beside the right producer
    key, and a plain client; closed, its thread and context are gone."""
    where, stranger = tmp_path / "keys", tmp_path / "stranger"
    guard = keys.Guard(where)
    keys.ensure(stranger)
    (stranger / "producer.key").write_bytes((where / "producer.key").read_bytes())
    server = guard.socket(zmq.ROUTER)
    try:
        port = server.bind_to_random_port("tcp://127.0.0.1")
        assert _handshake(where, where, port) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert _handshake(where, stranger, port) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert _handshake(where, None, port) in keys.HANDSHAKE_FAILED_EVENTS
    finally:
        server.close(0)
        guard.close()
    assert not guard.auth.is_alive() and guard.context.closed


def test_a_damaged_key_is_named_before_anything_binds(tmp_path, monkeypatch):
    where = tmp_path / "keys"
    monkeypatch.setenv(keys.ENV, str(where))
    keys.ensure(where)
    (where / "producer.key_secret").write_text("not a certificate")
    with pytest.raises(keys.KeysError, match=r"producer.key_secret"):
        keys.server_socket("tcp://*:5555", zmq.ROUTER)  # (made, never bound: the key is read first)


def test_a_consumer_without_keys_fails_at_construction_naming_the_folder(tmp_path, monkeypatch):
    """Before it connects (192.0.2.1 is a documentation address: nothing is sent to it)."""
    monkeypatch.setenv(keys.ENV, str(tmp_path / "absent"))
    started = time.monotonic()
    with pytest.raises(keys.KeysError, match=r"absent.*TENSORSOCKET_KEYS"):
        Consumer(endpoint="tcp://192.0.2.1:5555", timeout=30)
    assert time.monotonic() - started < 10
    with pytest.raises(RuntimeError, match="absent"):  # `tensorsocket status` says it as an error
        query_status("tcp://192.0.2.1:5555", timeout=30)


def test_a_consumer_refuses_a_secret_key_others_may_read(tmp_path, monkeypatch):
    """As ssh refuses an unprotected private key: whoever reads it can join as a consumer. Only
    the secret's mode counts (a copy in a container may belong to another uid)."""
    where = tmp_path / "keys"
    keys.ensure(where)
    secret = where / "consumer.key_secret"
    secret.chmod(0o644)
    monkeypatch.setenv(keys.ENV, str(where))
    with pytest.raises(keys.KeysError, match=r"consumer.key_secret may be read .*mode 0o644.*chmod 600"):
        Consumer(endpoint="tcp://192.0.2.1:5555", timeout=30)
    with pytest.raises(RuntimeError, match="chmod 600"):
        query_status("tcp://192.0.2.1:5555", timeout=30)
    secret.chmod(0o600)
    assert keys.client_keys(where) is not None


SCENARIO = """
import json, os, sys, threading, time
from pathlib import Path
sys.path.insert(0, {root!r})
from tensorsocket import Consumer, Producer, ProducerLost, Refused, keys
from tensorsocket.cli.query import NoProducer, query_status
from tests.support import NestedLoader, expected_batch, same

mine, other = Path(sys.argv[1]) / "keys", Path(sys.argv[1]) / "other"
keys.ensure(other)
os.environ[keys.ENV] = str(mine)  # (not there yet: the producer makes it)
report = {{}}
BATCHES = 12
producer = Producer(NestedLoader(BATCHES), endpoint="tcp://*:*", slots=2, replay=0)
endpoint = producer.endpoint  # tcp://*:PORT
report["made"] = sorted(p.name for p in mine.iterdir() if ".key" in p.name)
report["mode"] = oct(mine.stat().st_mode & 0o777)
server = threading.Thread(target=producer.serve, kwargs={{"epochs": 1}})
server.start()
good = Consumer(endpoint=endpoint, timeout=30)  # joined: the stream starts
report["status_consumers"] = len(query_status(endpoint, timeout=10)["consumers"])


def refusal(endpoint, folder, timeout=30):
    os.environ[keys.ENV] = str(folder)
    started = time.monotonic()
    try:
        Consumer(endpoint=endpoint, timeout=timeout).close()
        return {{"joined": True}}
    except (Refused, ProducerLost) as exc:
        return {{"error": f"{{type(exc).__name__}}: {{exc}}", "seconds": time.monotonic() - started}}
    finally:
        os.environ[keys.ENV] = str(mine)


report["other_keys"] = refusal(endpoint, other, timeout=2)
# The producer's public key but a consumer key pair of its own: the ZAP handler refuses it
stranger = Path(sys.argv[1]) / "stranger"
keys.ensure(stranger)
(stranger / "producer.key").write_bytes((mine / "producer.key").read_bytes())
report["stranger"] = refusal(endpoint, stranger)
report["plain"] = refusal(endpoint.replace("*", "127.0.0.1"), mine)
try:  # a plain query of a producer that requires CURVE: said at once, not "no producer"
    query_status(endpoint.replace("*", "127.0.0.1"), timeout=30)
    report["status_plain"] = "answered"
except RuntimeError as exc:
    report["status_plain"] = str(exc)
os.environ[keys.ENV] = str(other)
try:
    query_status(endpoint, timeout=2)
    report["status_other_keys"] = "answered"
except NoProducer:
    report["status_other_keys"] = "no answer"
import subprocess
cli = subprocess.run(
    [sys.executable, "-m", "tensorsocket", "status", "--endpoint", endpoint, "--timeout", "1"],
    capture_output=True, text=True, timeout=60,
)
report["status_cli_other_keys"] = [cli.returncode, cli.stderr.strip()]
os.environ[keys.ENV] = str(mine)
seen = [same(batch, expected_batch(i, BATCHES)) for i, batch in enumerate(good)]
report["seen"] = len(seen)
report["exact"] = all(seen)
good.close()
server.join(60)
report["served"] = not server.is_alive()
print("REPORT " + json.dumps(report), flush=True)
"""


def test_a_producer_beyond_loopback_admits_only_clients_with_its_keys(tmp_path):
    prefix = private_network()
    if prefix is None:
        pytest.skip("needs `unshare -n` (a private network namespace: root), to bind every interface safely")
    script = tmp_path / "scenario.py"
    script.write_text(textwrap.dedent(SCENARIO.format(root=ROOT)))
    done = subprocess.run(
        [*prefix, sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": ROOT},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT ") :])
    assert report["made"] == KEY_FILES
    assert report["mode"] == "0o700"
    assert report["status_consumers"] == 1
    # Another folder's producer key: ZeroMQ says only that handshakes failed, as when a producer
    # is killed mid-handshake, so it waits its timeout (2 s) and then says what to check
    other = report["other_keys"]
    assert other.get("error", "").startswith("ProducerLost: no producer answered"), other
    assert "handshake(s) with a producer there failed without detail" in other["error"]
    assert "/other) is not the producer's" in other["error"]
    stranger = report["stranger"]
    assert "error" in stranger and stranger["seconds"] < 10, stranger
    assert (
        stranger["error"].startswith("Refused: ") and "refused this client's CURVE key" in stranger["error"]
    )
    # A loopback address to a producer that requires CURVE: refused, saying why
    plain = report["plain"]
    assert "error" in plain and plain["seconds"] < 10, plain
    assert plain["error"].startswith("Refused: ") and "did not use CURVE" in plain["error"]
    assert report["status_other_keys"] == "no answer"
    assert "did not use CURVE" in report["status_plain"], report["status_plain"]
    code, said = report["status_cli_other_keys"]
    assert code == 1 and "no producer that admits the CURVE keys in" in said and "other" in said, said
    # and the producer served on: every batch, exactly, to the consumer with its keys
    assert report["seen"] == 12 and report["exact"] and report["served"]
