"""Addresses (ir.address): one parser for the command line's flags, cluster files and the ZeroMQ
transport; a bad address is one line naming where it came from, what it is and the form it needs,
at parse time, never a hang or a ZeroMQ traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import runtime.transport.zeromq as zeromq
from ir.address import Address, AddressError, parse_address
from ir.errors import InputFileError
from ir.profile import BackendProfile, BlockCost, DeviceProfile
from planner.cluster import ClusterError, load_cluster

ROOT = Path(__file__).resolve().parents[2]
FORM = "is not of the form tcp://HOST:PORT"


@pytest.mark.parametrize("text, listen, want", [
    ("tcp://192.0.2.10:5555", False, Address("192.0.2.10", 5555)),
    ("tcp://phone.local:5555", False, Address("phone.local", 5555)),
    ("tcp://*:5600", True, Address("*", 5600)),
    ("tcp://127.0.0.1:0", True, Address("127.0.0.1", 0)),
    ("tcp://eth0:*", True, Address("eth0", 0)),
])
def test_good_addresses_parse_and_print_back(text, listen, want):
    assert parse_address(text, listen=listen) == want
    assert str(want) == (text[:-1] + "0" if text.endswith(":*") else text)  # port * is port 0


@pytest.mark.parametrize("text, listen, problem", [
    ("5602", False, "it does not start with tcp://"),
    ("bogus", True, "it does not start with tcp://"),
    ("ipc:///tmp/w", False, "the transport 'ipc' is not tcp"),
    ("tcp://5602", False, "no :PORT after the host"),
    ("tcp://:5602", False, "no host before the :PORT"),
    ("tcp://h:99999", False, "port '99999' is not a number from 1 to 65535"),
    ("tcp://h:x", True, "port 'x' is not a number from 0 to 65535, or *"),
    ("tcp://h:0", False, "port 0 only picks a free port when listening; give the peer's port"),
    ("tcp://*:5555", False, "host * means every interface, which only a listening address may use"),
    ("tcp://not an address:5", False, "host 'not an address' is not a host name or IPv4 address"),
    ("tcp://10.0.0.256:5", False, "host '10.0.0.256' is not an IPv4 address"),
    ("tcp://[::1]:5", False, "IPv6 addresses are not supported; give an IPv4 address or a host name"),
])
def test_bad_addresses_say_what_is_wrong(text, listen, problem):
    with pytest.raises(AddressError) as info:
        parse_address(text, listen=listen)
    assert str(info.value) == f"{text!r} {FORM} ({problem})"


def test_the_transport_refuses_a_bad_address_before_any_socket_uses_it():
    with pytest.raises(ValueError) as info:
        zeromq.ZmqTransport("worker", "bogus", insecure=True)
    assert str(info.value) == f"transport 'worker': listen address 'bogus' {FORM} (it does not start with tcp://)"
    t = zeromq.ZmqTransport("coordinator", None, insecure=True)
    try:
        with pytest.raises(ValueError) as info:
            t.connect("w2", "5602")
        assert str(info.value) == (f"transport 'coordinator': peer 'w2': address '5602' {FORM} (it does not start "
                                   f"with tcp://)")
        assert t.peers == {}
    finally:
        t.close()


def test_a_connect_that_zeromq_refuses_closes_its_socket_so_close_does_not_hang(monkeypatch):
    """An address the parser lets through but ZeroMQ refuses (the parser let through too much): the
    send says so, and the socket made for it is closed, so the context can terminate."""
    monkeypatch.setattr(zeromq, "parse_address", lambda text, listen=False: None)
    t = zeromq.ZmqTransport("coordinator", None, insecure=True)
    t.connect("w2", "5602")
    with pytest.raises(ValueError) as info:
        t.send_control("w2", {"type": "stop"})
    assert str(info.value) == "transport 'coordinator' cannot connect to peer 'w2' at '5602': Invalid argument"
    closer = threading.Thread(target=t.close, daemon=True)
    closer.start()
    closer.join(10.0)
    assert not closer.is_alive(), "close() hangs on the socket the failed connect left open"


def test_a_port_in_use_is_one_line_not_a_zeromq_traceback():
    first = zeromq.ZmqTransport("a", "tcp://127.0.0.1:0", insecure=True)
    try:
        with pytest.raises(ValueError) as info:
            zeromq.ZmqTransport("b", first.address, insecure=True)
        assert str(info.value) == f"transport 'b' cannot listen at {first.address!r}: Address already in use"
    finally:
        first.close()


def _cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONFIDANT_HOME": str(cwd / "home"), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "confidant", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_address_flags_are_checked_as_the_command_line_is_parsed(tmp_path):
    """Exit 2 (bad input) and one line naming the flag, the address and its form; nothing starts
    (the model and data named here do not even exist)."""
    run = ("train-pipeline", "m.onnx", "--data", "d.txt")
    cases = [
        (run + ("--workers", "w1=tcp://127.0.0.1:5601,w2=5602"),
         "confidant train-pipeline: error: argument --workers: w2=5602: '5602' " + FORM
         + " (it does not start with tcp://)"),
        (run + ("--workers", "w1=tcp://127.0.0.1:5601", "--listen", "bogus"),
         "confidant train-pipeline: error: argument --listen: 'bogus' " + FORM + " (it does not start with tcp://)"),
        (("worker", "--listen", "bogus", "--insecure"),
         "confidant worker: error: argument --listen: 'bogus' " + FORM + " (it does not start with tcp://)"),
        (("train", "plan", "--data", "d.txt", "--listen", "tcp://h:70000"),
         "confidant train: error: argument --listen: 'tcp://h:70000' " + FORM
         + " (port '70000' is not a number from 0 to 65535, or *)"),
    ]
    for args, line in cases:
        proc = _cli(*args, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == line


def _cluster_file(tmp_path: Path, address: str) -> Path:
    blocks = {"encoder/p10/f10/a10": BlockCost(0.01, 0.02, 0.005, 100)}
    profile = DeviceProfile("a", "tiny", 8, 32, (BackendProfile("mnn:cpu:t1", blocks),), 4 * 2**30, 1000)
    (tmp_path / "a.json").write_text(json.dumps(profile.to_json()))
    devices = [{"name": "a", "address": "tcp://127.0.0.1:5621", "profile": "a.json", "memory_budget": "1GiB"},
               {"name": "b", "address": address, "profile": "a.json", "memory_budget": "1GiB"}]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"devices": devices, "links": {"default": {"bandwidth": "100Mbit/s",
                                                                           "latency": "5ms"}}}))
    return path


def test_a_cluster_file_with_a_bad_address_is_refused_when_loaded(tmp_path):
    path = _cluster_file(tmp_path, "not an address")
    with pytest.raises(ClusterError) as info:
        load_cluster(path)
    assert isinstance(info.value, InputFileError)  # the command line's bad input: exit 2
    assert str(info.value) == (f"{path}: device 'b': address 'not an address' {FORM} (it does not start with "
                               f"tcp://)")
    proc = _cli("plan", "m.onnx", "--cluster", path, "--batch", 8, "--microbatches", 1, "--seq", 32, "-o", "p",
                "--insecure", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"confidant plan: error: {info.value}"
    assert load_cluster(_cluster_file(tmp_path, "tcp://127.0.0.1:5622")).device("b").address == "tcp://127.0.0.1:5622"
