"""Cluster files (planner.cluster): unit parsing, a good file in YAML and JSON, and one exact
message per kind of mistake, each naming the file, the device or link, and the field."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import ClusterError, load_cluster, parse_bandwidth, parse_bytes, parse_duration

GIB = 2**30


@pytest.mark.parametrize("text, expected", [
    ("3GiB", 3 * GIB), ("512MB", 512_000_000), ("1.5 GiB", 3 * GIB // 2), ("1000000", 1_000_000),
    (1_000_000, 1_000_000), ("1e9", 10**9), ("2 KiB", 2048), ("0", 0), ("10kB", 10_000), ("7B", 7),
    (4096.0, 4096), ("1TiB", 2**40),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["3 GB/s", "-1", "abc", True, None, "3 gb", [1], math.nan, -5, "1.5.2GB", ""])
def test_parse_bytes_rejects_with_the_text_quoted(text):
    with pytest.raises(ValueError) as exc:
        parse_bytes(text)
    assert str(exc.value) == f"{text!r} is not a size (examples: 3GiB, 512MB, 1000000)"


@pytest.mark.parametrize("text, expected", [
    ("100Mbit/s", 12.5e6), ("12.5MB/s", 12.5e6), ("1Gbit/s", 125e6), ("1 Gbps", 125e6), ("100 Mbps", 12.5e6),
    (12_500_000, 12.5e6), ("1e6", 1e6), ("2 MiB/s", 2.0 * 2**20), ("8 bit/s", 1.0), ("3 B/s", 3.0),
])
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-12)


def test_parse_bandwidth_errors():
    with pytest.raises(ValueError) as exc:
        parse_bandwidth("100 Mbit")
    assert str(exc.value) == "'100 Mbit' is not a bandwidth (examples: 100Mbit/s, 12.5MB/s, 1Gbit/s, 12500000)"
    with pytest.raises(ValueError) as exc:
        parse_bandwidth("0 MB/s")
    assert str(exc.value) == ("'0 MB/s' is not a bandwidth: it must be more than 0 "
                              "(examples: 100Mbit/s, 12.5MB/s, 1Gbit/s, 12500000)")


@pytest.mark.parametrize("text, expected", [
    ("5ms", 5e-3), ("200us", 2e-4), ("200µs", 2e-4), ("0.01", 0.01), (0, 0.0), ("1 s", 1.0), ("50ns", 5e-8),
    (0.25, 0.25),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text", ["5 min", "-1", "fast", "5 ms ms"])
def test_parse_duration_errors(text):
    with pytest.raises(ValueError) as exc:
        parse_duration(text)
    assert str(exc.value) == f"{text!r} is not a duration (examples: 5ms, 200us, 0.01)"


# --- cluster files ---------------------------------------------------------------------------

def _profile(name: str, model: str = "tiny", available: int = 4 * GIB, seq: int = 32) -> DeviceProfile:
    blocks = {"encoder/p10/f10/a10": BlockCost(0.01, 0.02, 0.005, 100)}
    return DeviceProfile(name, model, 8, seq, (BackendProfile("mnn:cpu:t1", blocks), BackendProfile("mnn:cpu:t4", blocks)),
                         available, 1000)


def _device(name: str, **over) -> dict:
    return {"name": name, "address": f"tcp://{name}:5555", "profile": f"profiles/{name}.json",
            "memory_budget": "1GiB"} | over


def _write(tmp_path: Path, doc: dict, name: str = "cluster.yaml", profiles: dict | None = None) -> Path:
    (tmp_path / "profiles").mkdir(exist_ok=True)
    for pname, prof in (profiles or {"phone": _profile("phone"), "laptop": _profile("laptop")}).items():
        prof.save(tmp_path / "profiles" / f"{pname}.json")
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps(doc))
    else:
        import yaml
        path.write_text(yaml.safe_dump(doc))
    return path


GOOD = {
    "devices": [_device("phone", memory_budget="3GiB", backend="mnn:cpu:t4"), _device("laptop", memory_budget="1.5 GiB")],
    "links": {"default": {"bandwidth": "100Mbit/s", "latency": "5ms"},
              "pairs": [{"between": ["laptop", "phone"], "bandwidth": "12.5MB/s", "latency": "200us"}]},
}


def test_yaml_cluster_loads(tmp_path):
    cluster = load_cluster(_write(tmp_path, GOOD))
    assert cluster.names == ("phone", "laptop")
    phone, laptop = cluster.devices
    assert (phone.address, phone.memory_budget_bytes, phone.backend) == ("tcp://phone:5555", 3 * GIB, "mnn:cpu:t4")
    assert (laptop.memory_budget_bytes, laptop.backend) == (3 * GIB // 2, None)
    assert phone.profile == _profile("phone")
    assert cluster.default_link == Link(12.5e6, 0.005)
    assert cluster.link("phone", "laptop") == cluster.link("laptop", "phone") == Link(12.5e6, 200e-6)


def test_json_cluster_loads_and_the_default_link_covers_unnamed_pairs(tmp_path):
    doc = {"devices": GOOD["devices"] + [_device("tablet")], "links": {"default": {"bandwidth": 1e6, "latency": 0.001}}}
    path = _write(tmp_path, doc, "cluster.json",
                  {n: _profile(n) for n in ("phone", "laptop", "tablet")})
    cluster = load_cluster(path)
    assert cluster.link("tablet", "phone") == Link(1e6, 0.001)
    assert cluster.device("tablet").memory_budget_bytes == GIB
    with pytest.raises(KeyError, match="no device 'watch' in the cluster"):
        cluster.link("watch", "phone")
    with pytest.raises(ValueError, match="needs no link to itself"):
        cluster.link("phone", "phone")


def test_one_device_needs_no_links(tmp_path):
    cluster = load_cluster(_write(tmp_path, {"devices": [_device("phone")]}))
    assert cluster.default_link.bandwidth_bytes_per_s == math.inf


def _error(tmp_path: Path, doc: dict, profiles: dict | None = None, name: str = "cluster.yaml") -> str:
    path = _write(tmp_path, doc, name, profiles)
    with pytest.raises(ClusterError) as exc:
        load_cluster(path)
    return str(exc.value).replace(str(path), "FILE")


def _with_device(i: int, **over) -> dict:
    devices = [dict(d) for d in GOOD["devices"]]
    devices[i].update(over)
    return GOOD | {"devices": [{k: v for k, v in d.items() if v is not None} for d in devices]}


def test_budget_that_is_not_a_size(tmp_path):
    assert _error(tmp_path, _with_device(0, memory_budget="3 GB/s")) == (
        "FILE: device 'phone': memory_budget '3 GB/s' is not a size (examples: 3GiB, 512MB, 1000000)")


def test_missing_fields(tmp_path):
    assert _error(tmp_path, _with_device(1, memory_budget=None)) == "FILE: device 'laptop': missing field 'memory_budget'"
    assert _error(tmp_path, _with_device(1, address=None)) == "FILE: device 'laptop': missing field 'address'"
    assert _error(tmp_path, _with_device(0, profile=None)) == "FILE: device 'phone': missing field 'profile'"
    assert _error(tmp_path, _with_device(1, name=None)) == "FILE: devices[1]: missing field 'name' (a non-empty string)"
    assert _error(tmp_path, {"links": GOOD["links"]}) == "FILE: 'devices' must be a non-empty list of devices"
    assert _error(tmp_path, {"devices": GOOD["devices"]}) == (
        "FILE: missing field 'links' (a cluster of 2 devices needs at least links.default with bandwidth and latency)")
    assert _error(tmp_path, GOOD | {"links": {"default": {"bandwidth": "1MB/s"}}}) == (
        "FILE: links.default: missing field 'latency'")


def test_unknown_fields(tmp_path):
    assert _error(tmp_path, _with_device(0, memory="3GiB")) == (
        "FILE: device 'phone': unknown field 'memory' (fields: address, backend, key, memory_budget, name, profile)")
    assert _error(tmp_path, GOOD | {"device": []}) == "FILE: unknown field 'device' (fields: devices, links)"


def test_a_device_may_carry_its_workers_public_key(tmp_path):
    key = "ed25519:" + "ab" * 32
    cluster = load_cluster(_write(tmp_path, _with_device(0, key=key)))
    assert [d.key for d in cluster.devices] == [key, None]
    assert _error(tmp_path, _with_device(1, key="ed25519:xyz")) == (
        "FILE: device 'laptop': key 'ed25519:xyz' is not a public key ('ed25519:' and 64 lowercase hex digits: the "
        "first word of the NAME.pub `confidant keys` wrote for this device)")


def test_duplicate_device_name_and_address(tmp_path):
    doc = GOOD | {"devices": GOOD["devices"] + [_device("phone", address="tcp://other:1")]}
    assert _error(tmp_path, doc) == (
        "FILE: device 'phone' appears twice (devices[0] and devices[2]); device names must be unique")
    assert _error(tmp_path, _with_device(1, address="tcp://phone:5555")) == (
        "FILE: device 'laptop': address 'tcp://phone:5555' is already device 'phone''s; each worker needs its own address")


def test_link_errors(tmp_path):
    def pairs(*items):
        return GOOD | {"links": {"default": GOOD["links"]["default"], "pairs": list(items)}}
    assert _error(tmp_path, pairs({"between": ["phone", "watch"], "bandwidth": "1MB/s", "latency": 0})) == (
        "FILE: link between 'phone' and 'watch': 'watch' is not a device (devices: phone, laptop)")
    assert _error(tmp_path, pairs({"between": ["phone", "phone"], "bandwidth": "1MB/s", "latency": 0})) == (
        "FILE: link between 'phone' and 'phone': a link needs two different devices")
    assert _error(tmp_path, pairs({"between": ["phone"], "bandwidth": "1MB/s", "latency": 0})) == (
        "FILE: links.pairs[0]: between must be a list of two device names, got ['phone']")
    twice = {"between": ["phone", "laptop"], "bandwidth": "1MB/s", "latency": 0}
    assert _error(tmp_path, pairs(twice, twice | {"between": ["laptop", "phone"]})) == (
        "FILE: link between 'laptop' and 'phone': the pair is listed twice")
    assert _error(tmp_path, pairs({"between": ["phone", "laptop"], "bandwidth": "1MB", "latency": 0})) == (
        "FILE: link between 'phone' and 'laptop': bandwidth '1MB' is not a bandwidth "
        "(examples: 100Mbit/s, 12.5MB/s, 1Gbit/s, 12500000)")
    assert _error(tmp_path, GOOD | {"links": {"default": {"bandwidth": "1MB/s", "latency": "soon"}}}) == (
        "FILE: links.default: latency 'soon' is not a duration (examples: 5ms, 200us, 0.01)")


def test_budget_above_what_the_profile_measured(tmp_path):
    profiles = {"phone": _profile("phone", available=2 * GIB), "laptop": _profile("laptop")}
    assert _error(tmp_path, GOOD, profiles) == (
        "FILE: device 'phone': memory_budget 3221225472 bytes (3.00 GiB) is more than the 2147483648 bytes "
        "(2.00 GiB) its profile 'profiles/phone.json' measured as available; lower the budget or re-profile the device")
    assert _error(tmp_path, _with_device(0, memory_budget=0)) == (
        "FILE: device 'phone': memory_budget must be more than 0 bytes")


def test_profile_missing_unreadable_or_of_another_model(tmp_path):
    msg = _error(tmp_path, _with_device(1, profile="profiles/nope.json"))
    assert msg == (f"FILE: device 'laptop': profile 'profiles/nope.json' not found (looked at "
                   f"{(tmp_path / 'profiles/nope.json').resolve()}); make it with `confidant profile`")
    (tmp_path / "profiles").mkdir(exist_ok=True)
    (tmp_path / "profiles" / "bad.json").write_text("{not json")
    assert _error(tmp_path, _with_device(1, profile="profiles/bad.json")).startswith(
        "FILE: device 'laptop': profile 'profiles/bad.json' cannot be read: ")
    profiles = {"phone": _profile("phone"), "laptop": _profile("laptop", model="bert-large")}
    assert _error(tmp_path, GOOD, profiles) == (
        "FILE: device 'laptop': profile model 'bert-large' differs from device 'phone''s 'tiny'; "
        "profile every device with the same model, batch and sequence length")
    profiles = {"phone": _profile("phone"), "laptop": _profile("laptop", seq=64)}
    assert _error(tmp_path, GOOD, profiles) == (
        "FILE: device 'laptop': profile seq 64 differs from device 'phone''s 32; "
        "profile every device with the same model, batch and sequence length")


def test_backend_not_in_the_profile(tmp_path):
    assert _error(tmp_path, _with_device(0, backend="torch:cuda")) == (
        "FILE: device 'phone': backend 'torch:cuda' is not in its profile 'profiles/phone.json' "
        "(profiled backends: mnn:cpu:t1, mnn:cpu:t4)")


def test_files_that_do_not_parse(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{")
    with pytest.raises(ClusterError, match=r"c\.json: not JSON"):
        load_cluster(path)
    path = tmp_path / "c.yaml"
    path.write_text("devices: [")
    with pytest.raises(ClusterError, match=r"c\.yaml: not YAML"):
        load_cluster(path)
    path.write_text("- just a list")
    with pytest.raises(ClusterError, match="expected a mapping with 'devices' and 'links' at the top, got list"):
        load_cluster(path)
    with pytest.raises(ClusterError, match="no such cluster file"):
        load_cluster(tmp_path / "missing.yaml")


def test_links_given_in_either_order_are_found():
    from planner.cluster import Cluster, DeviceSpec

    fast, slow = Link(1e9, 0.0), Link(1e6, 0.01)
    devices = tuple(DeviceSpec(n, f"tcp://{n}:1", _profile(n), GIB) for n in ("dev2", "dev10"))
    # "dev10" sorts before "dev2": the pair must be found whichever order it was given in
    cl = Cluster(devices, slow, {("dev2", "dev10"): fast})
    assert cl.link("dev10", "dev2") == cl.link("dev2", "dev10") == fast
    with pytest.raises(ValueError, match="links 'dev10'-'dev2' given twice with different values"):
        Cluster(devices, slow, {("dev2", "dev10"): fast, ("dev10", "dev2"): slow})


def test_a_budget_without_a_unit_that_would_be_a_few_bytes_is_refused(tmp_path):
    """Issue 13: `memory_budget: 512` was read as 512 bytes and the device silently left out."""
    links = {"links": GOOD["links"]}
    doc = {"devices": [_device("phone", memory_budget=512), _device("laptop")], **links}
    with pytest.raises(ClusterError, match=r"memory_budget 512 has no unit and would be 512 bytes.*512MiB or 512GiB"):
        load_cluster(_write(tmp_path, doc))
    doc = {"devices": [_device("phone", memory_budget=str(2 * GIB)), _device("laptop")], **links}  # bytes, plausible
    assert load_cluster(_write(tmp_path, doc)).device("phone").memory_budget_bytes == 2 * GIB


def test_device_names_that_differ_only_in_case_are_refused_when_read(tmp_path):
    """Issue 13: devices `A` and `a` clashed only after solving (their bundle folders collide)."""
    doc = {"devices": [_device("phone"), _device("Phone", address="tcp://other:5555", profile="profiles/phone.json")],
           "links": GOOD["links"]}
    with pytest.raises(ClusterError, match=r"'phone' \(devices\[0\]\) and 'Phone' \(devices\[1\]\) differ only in case"):
        load_cluster(_write(tmp_path, doc))


def test_the_coordinator_takes_worker_keys_from_the_cluster_file_before_the_keys_folder(tmp_path):
    """`confidant train PLAN --cluster FILE`: a device's `key:` is its worker's key; a device without
    one is NAME.pub in --keys; one with neither is an error naming both places."""
    from jobs.common.errors import JobError
    from jobs.train.from_plan import PlanRunSettings, _remote_keys
    from runtime.keys import KeyPair, write_keypair

    phone, laptop, coordinator = (KeyPair.generate(n) for n in ("phone", "laptop", "coordinator"))
    keys = tmp_path / "keys"
    write_keypair(keys, coordinator)
    write_keypair(keys, laptop)
    cluster = _write(tmp_path, _with_device(0, key=phone.public.text))
    settings = PlanRunSettings(steps=1, keys=keys, cluster=cluster)
    got = _remote_keys(settings, coordinator, ["phone", "laptop"], ["tcp://p:1", "tcp://l:1"])
    assert got.workers == {"tcp://p:1": phone.public, "tcp://l:1": laptop.public}
    (keys / "laptop.pub").unlink()
    with pytest.raises(JobError, match=r"laptop\.pub.*\(the coordinator needs each device's public key: `key:` in "
                                       r"the cluster file, or NAME\.pub in --keys DIR\)"):
        _remote_keys(settings, coordinator, ["phone", "laptop"], ["tcp://p:1", "tcp://l:1"])
