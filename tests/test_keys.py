"""CURVE keys for a producer bound beyond loopback (tensorsocket/keys.py): the folder, the
errors of a client without keys, and, in a private network namespace (where a producer bound
to every interface reaches loopback only), a producer on ``tcp://*`` that admits the consumer
with its keys and refuses, promptly and clearly, one with other keys or none, while it serves
on."""

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

from tensorsocket import Consumer, keys
from tensorsocket.cli.query import query_status
from tests.support import private_network

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_folder_is_made_private_once_and_kept(tmp_path, monkeypatch):
    where = tmp_path / "conf" / "keys"
    keys.ensure(where)
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert sorted(p.name for p in where.iterdir()) == [
        "consumer.key", "consumer.key_secret", "producer.key", "producer.key_secret",
    ]  # fmt: skip
    before = {p.name: p.read_bytes() for p in where.iterdir()}
    keys.ensure(where)  # a second producer, or the next run: the same keys
    assert {p.name: p.read_bytes() for p in where.iterdir()} == before

    monkeypatch.delenv(keys.ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert keys.folder() == tmp_path / "xdg" / "tensorsocket" / "keys"
    monkeypatch.setenv(keys.ENV, str(where))
    assert keys.folder() == where


def test_loopback_and_ipc_stay_plain(tmp_path, monkeypatch):
    monkeypatch.setenv(keys.ENV, str(tmp_path / "none"))  # no keys: nothing may ask for them
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        for endpoint in ("tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555", "ipc:///tmp/x"):
            assert not keys.secure_client(sock, endpoint)
        assert sock.mechanism == zmq.NULL
    finally:
        sock.close(0)
    assert not (tmp_path / "none").exists()


def test_a_damaged_key_is_named_before_anything_binds(tmp_path, monkeypatch):
    monkeypatch.setenv(keys.ENV, str(tmp_path))
    keys.ensure(tmp_path)
    (tmp_path / "producer.key_secret").write_text("not a certificate")
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


SCENARIO = """
import json, os, sys, threading, time
from pathlib import Path
sys.path.insert(0, {root!r})
from tensorsocket import Consumer, Producer, Refused, keys
from tensorsocket.cli.query import NoProducer, query_status
from tests.support import NestedLoader, expected_batch, same

mine, other = Path(sys.argv[1]) / "keys", Path(sys.argv[1]) / "other"
keys.ensure(other)
os.environ[keys.ENV] = str(mine)  # (not there yet: the producer makes it)
report = {{}}
BATCHES = 12
producer = Producer(NestedLoader(BATCHES), endpoint="tcp://*:*", slots=2, replay=0)
endpoint = producer.endpoint  # tcp://*:PORT
report["made"] = sorted(p.name for p in mine.iterdir())
report["mode"] = oct(mine.stat().st_mode & 0o777)
server = threading.Thread(target=producer.serve, kwargs={{"epochs": 1}})
server.start()
good = Consumer(endpoint=endpoint, timeout=30)  # joined: the stream starts
report["status_consumers"] = len(query_status(endpoint, timeout=10)["consumers"])


def refusal(endpoint, folder):
    os.environ[keys.ENV] = str(folder)
    started = time.monotonic()
    try:
        Consumer(endpoint=endpoint, timeout=30).close()
        return {{"joined": True}}
    except Refused as exc:
        return {{"error": str(exc), "seconds": time.monotonic() - started}}
    finally:
        os.environ[keys.ENV] = str(mine)


report["other_keys"] = refusal(endpoint, other)
# The producer's public key but a consumer key pair of its own: the ZAP handler refuses it
stranger = Path(sys.argv[1]) / "stranger"
keys.ensure(stranger)
(stranger / "producer.key").write_bytes((mine / "producer.key").read_bytes())
report["stranger"] = refusal(endpoint, stranger)
report["plain"] = refusal(endpoint.replace("*", "127.0.0.1"), mine)
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
    assert report["made"] == ["consumer.key", "consumer.key_secret", "producer.key", "producer.key_secret"]
    assert report["mode"] == "0o700"
    assert report["status_consumers"] == 1
    # Other keys: refused at the third failed handshake, well within its 30 s timeout
    other = report["other_keys"]
    assert "error" in other and other["seconds"] < 10, other
    assert "must be a copy of the producer's key folder" in other["error"]
    stranger = report["stranger"]
    assert "error" in stranger and stranger["seconds"] < 10, stranger
    assert "the producer refused this client's CURVE key" in stranger["error"]
    # A loopback address to a producer that requires CURVE: refused, saying why
    plain = report["plain"]
    assert "error" in plain and plain["seconds"] < 10, plain
    assert "did not use CURVE" in plain["error"]
    assert report["status_other_keys"] == "no answer"
    code, said = report["status_cli_other_keys"]
    assert code == 1 and "no producer that admits the CURVE keys in" in said and "other" in said, said
    # and the producer served on: every batch, exactly, to the consumer with its keys
    assert report["seen"] == 12 and report["exact"] and report["served"]
