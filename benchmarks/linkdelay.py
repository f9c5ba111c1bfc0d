"""A userspace delay line between network namespaces: a stand-in for ``tc qdisc ... netem delay``.

This kernel has no netem (no sch_netem module, no /lib/modules to load one from, no BPF toolchain
for EDT tricks), so a link with latency is built in user space. For each pair of namespaces the
relay process opens two TUN devices through /dev/net/tun (``TUNSETIFF``, ``IFF_TUN | IFF_NO_PI``),
moves one into each namespace (``ip link set DEV netns NS``: the file descriptor stays valid) and
forwards every packet read from one device to the other ``delay`` seconds later: one timestamped
FIFO per direction, one ``select`` loop over all devices, so packets are never reordered and never
dropped by the relay. Bandwidth stays with the kernel: ``tc qdisc ... tbf`` on each TUN device's
egress (the sender's side), as on the plain veth pairs.

Packet size and Python's per-packet cost. With ``gso`` (the default) the devices are opened with
``IFF_VNET_HDR`` and TSO/checksum offloads (``TUNSETOFFLOAD``): the MTU stays 1500 (TCP sees the
segment size, initial window and slow start of a real Ethernet/Wi-Fi link) while the kernel hands
the relay TCP super-packets of up to 64 KiB, each passed through unchanged with its virtio-net
header, so the relay handles ~1000 instead of ~9000 packets per second at 100 Mbit/s. tbf's burst is
raised above the largest super-packet, or tbf would split them again. ``--no-gso --mtu 1500`` is the
plain, per-packet variant (for comparison); ``--no-gso --mtu 65000`` the jumbo variant (cheap too,
but TCP's initial window then holds 650 kB, so slow start all but disappears).

Usage
    # self-check: two namespaces, RTT (UDP ping-pong), TCP bulk rate, order/loss, relay CPU
    .venv/bin/python benchmarks/linkdelay.py --selftest [--rate 100mbit] [--delays 0ms,5ms,20ms]
    # the relay itself (what DelayLine starts; root): one --pair per link
    .venv/bin/python benchmarks/linkdelay.py relay --delay 5ms --pair NS_A:DEV_A,NS_B:DEV_B [--pair ...]

From Python (root): ``with DelayLine([Pair("ns-a", "d1", "10.0.0.1", "ns-b", "d0", "10.0.0.2")],
delay_s=0.005, rate="100mbit") as line: ...``; ``line.stats`` after the block holds the relay's
packet counts, timing error and CPU seconds. The relay exits when its stdin closes (its parent
died) or on SIGTERM, and prints its statistics as one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import re
import resource
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
READ_BYTES = 65536 + 64          # the largest IP packet plus the 10-byte virtio-net header
DRAIN = 64                       # packets read from one device before the due ones are written again
READY, STATS = "linkdelay-ready", "linkdelay-stats "
_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
PR_SET_TIMERSLACK = 29


def parse_delay(text: str) -> float:
    """'5ms', '500us', '0.02s', '0' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|)\s*", str(text))
    if not m:
        raise ValueError(f"cannot read a delay from {text!r} (e.g. 5ms, 500us, 0.02s)")
    return float(m.group(1)) * {"s": 1.0, "": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(2)]


def parse_rate(text: str) -> float:
    """tc's rate syntax ('100mbit', '20Mbit', '1gbit', '500kbit') -> bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)\s*", str(text).lower())
    if not m:
        raise ValueError(f"cannot read a rate from {text!r} (e.g. 100mbit)")
    bits = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return bits * (8 if m.group(3) == "bps" else 1)


def tbf_burst_bytes(mtu: int, gso: bool) -> int:
    """tbf's bucket: 32 kB as on the veth pairs, and never smaller than the largest packet the
    device sees (a 64 KiB super-packet with gso, else one MTU), or tbf drops or splits it."""
    return max(32 * 1024, (65536 if gso else mtu) + 1024)


# --------------------------------------------------------------------------
# The relay (a process of its own: run in the root namespace, as root)
# --------------------------------------------------------------------------

def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


def open_tun(name: str, gso: bool) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if gso else 0)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), flags))
    if gso:
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


class _Dir:
    """One direction of one pair: packets read from `src`, written to `dst` when due."""
    __slots__ = ("src", "dst", "queue", "name", "packets", "bytes", "errors", "max_queue", "late_sum", "late_max")

    def __init__(self, src: int, dst: int, name: str):
        self.src, self.dst, self.name = src, dst, name
        self.queue: deque = deque()
        self.packets = self.bytes = self.errors = self.max_queue = 0
        self.late_sum = self.late_max = 0.0

    def summary(self) -> dict:
        return {"dir": self.name, "packets": self.packets, "bytes": self.bytes, "write_errors": self.errors,
                "left_in_queue": len(self.queue), "max_queue_packets": self.max_queue,
                "late_mean_us": round(self.late_sum / max(self.packets, 1) * 1e6, 1),
                "late_max_us": round(self.late_max * 1e6, 1)}


def relay(dirs: list[_Dir], delay_s: float, watch_fd: int | None = None) -> None:
    """Forward until `watch_fd` reaches end of file (or an exception such as SystemExit)."""
    by_src = {d.src: d for d in dirs}
    rlist = list(by_src) + ([watch_fd] if watch_fd is not None else [])
    clock, read, write = time.monotonic, os.read, os.write
    while True:
        now = clock()
        due = None
        for d in dirs:
            q = d.queue
            while q and q[0][0] <= now:
                t, pkt = q.popleft()
                try:
                    write(d.dst, pkt)
                except OSError:
                    d.errors += 1
                    continue
                late = now - t
                d.packets += 1
                d.bytes += len(pkt)
                d.late_sum += late
                if late > d.late_max:
                    d.late_max = late
            if q and (due is None or q[0][0] < due):
                due = q[0][0]
        ready, _, _ = select.select(rlist, [], [], None if due is None else max(0.0, due - clock()))
        now = clock()
        for fd in ready:
            if fd == watch_fd:
                if not read(fd, 4096):
                    return
                continue
            d = by_src[fd]
            q = d.queue
            for _ in range(DRAIN):
                try:
                    pkt = read(fd, READ_BYTES)
                except BlockingIOError:
                    break
                if delay_s <= 0:
                    try:
                        write(d.dst, pkt)
                        d.packets += 1
                        d.bytes += len(pkt)
                    except OSError:
                        d.errors += 1
                else:
                    q.append((now + delay_s, pkt))
            if len(q) > d.max_queue:
                d.max_queue = len(q)


def relay_main(args) -> int:
    delay_s = parse_delay(args.delay)
    fds, dirs, moved = [], [], []
    tag = os.getpid() % 100000
    for k, spec in enumerate(args.pair):
        try:
            (ns_a, dev_a), (ns_b, dev_b) = (side.split(":") for side in spec.split(","))
        except ValueError:
            raise SystemExit(f"--pair wants NS_A:DEV_A,NS_B:DEV_B, got {spec!r}")
        ends = []
        for side, (ns, dev) in enumerate(((ns_a, dev_a), (ns_b, dev_b))):
            tmp = f"ld{tag}x{k}{'ab'[side]}"  # unique in the root namespace, renamed once moved
            fd = open_tun(tmp, args.gso)
            fds.append(fd)
            _run(["ip", "link", "set", "dev", tmp, "netns", ns])
            _run(["ip", "-n", ns, "link", "set", "dev", tmp, "name", dev])
            moved.append((ns, dev))
            ends.append(fd)
        dirs.append(_Dir(ends[0], ends[1], f"{ns_a}:{dev_a}>{ns_b}:{dev_b}"))
        dirs.append(_Dir(ends[1], ends[0], f"{ns_b}:{dev_b}>{ns_a}:{dev_a}"))

    def on_term(signum, frame):
        raise SystemExit(0)

    _libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake select at the due time, not up to 50 us later
    sched = "normal"
    if args.realtime:
        # a link does not wait for the devices' CPUs: wake on time even when the workers keep both
        # cores busy (the relay sleeps in select between packets, so it cannot hog a core)
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
            sched = "SCHED_FIFO 10"
        except (OSError, AttributeError):
            with contextlib.suppress(OSError):
                os.nice(-10)
                sched = "nice -10"

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    t0 = time.monotonic()
    print(READY, flush=True)
    try:
        relay(dirs, delay_s, None if args.no_stdin_watch else sys.stdin.fileno())
    except SystemExit:
        pass
    finally:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        print(STATS + json.dumps({"delay_s": delay_s, "gso": args.gso, "sched": sched,
                                  "wall_s": round(time.monotonic() - t0, 3),
                                  "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
                                  "dirs": [d.summary() for d in dirs]}), flush=True)
        for fd in fds:
            os.close(fd)  # a TUN device that is not persistent disappears with its last descriptor
    return 0


# --------------------------------------------------------------------------
# Python API: start the relay, configure both ends
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Pair:
    """One link: device `dev_a` in namespace `ns_a`, `dev_b` in `ns_b`. When `addr_a`/`addr_b` are
    given, `ns_a` routes addr_b/32 over dev_a and `ns_b` routes addr_a/32 over dev_b."""
    ns_a: str
    dev_a: str
    addr_a: str | None
    ns_b: str
    dev_b: str
    addr_b: str | None


class DelayLine:
    """The relay process for `pairs`, every device up with `mtu`, tbf-shaped to `rate` (None: not
    shaped) on each device's egress, routes added; the relay runs SCHED_FIFO unless not `realtime`.
    `stats` holds the relay's report after `close`."""

    def __init__(self, pairs: list[Pair], delay_s: float, rate: str | None = "100mbit", mtu: int = 1500,
                 gso: bool = True, tbf_latency: str = "400ms", realtime: bool = True):
        self.pairs, self.delay_s, self.rate, self.mtu, self.gso = list(pairs), delay_s, rate, mtu, gso
        self.realtime = realtime
        self.tbf_latency = tbf_latency
        self.proc: subprocess.Popen | None = None
        self.stats: dict | None = None

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "relay", "--delay", f"{self.delay_s}s"]
        argv += ([] if self.gso else ["--no-gso"]) + ([] if self.realtime else ["--no-realtime"])
        for p in self.pairs:
            argv += ["--pair", f"{p.ns_a}:{p.dev_a},{p.ns_b}:{p.dev_b}"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        if line.strip() != READY:
            self.proc.wait(10)
            raise RuntimeError(f"delay line relay did not start: {(line + self.proc.stderr.read())[-2000:]}")
        for p in self.pairs:
            for ns, dev, peer in ((p.ns_a, p.dev_a, p.addr_b), (p.ns_b, p.dev_b, p.addr_a)):
                _run(["ip", "-n", ns, "link", "set", "dev", dev, "mtu", str(self.mtu), "addrgenmode", "none"])
                _run(["ip", "-n", ns, "link", "set", "dev", dev, "up"])
                if self.rate:
                    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                          "rate", self.rate, "burst", str(tbf_burst_bytes(self.mtu, self.gso)),
                          "latency", self.tbf_latency])
                if peer:
                    _run(["ip", "-n", ns, "route", "add", f"{peer}/32", "dev", dev])

    def cpu_s(self) -> float:
        """CPU seconds the relay has used so far (schedstat: nanoseconds, not clock ticks)."""
        with open(f"/proc/{self.proc.pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9

    def close(self) -> dict | None:
        if self.proc is None:
            return self.stats
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        for line in out.splitlines():
            if line.startswith(STATS):
                self.stats = json.loads(line[len(STATS):])
        return self.stats


# --------------------------------------------------------------------------
# Self-check
# --------------------------------------------------------------------------



def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_netns(name: str):
    """Sockets created inside the block belong to namespace `name` (this thread only)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _setns(f"/var/run/netns/{name}")
        try:
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(home)


def _netstat(ns: str) -> dict:
    with in_netns(ns):
        text = open("/proc/thread-self/net/snmp").read()
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("Tcp:")]
    return dict(zip(rows[0][1:], (int(x) for x in rows[1][1:])))


def _tbf_drops(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
                         capture_output=True, text=True).stdout
    m = re.search(r"dropped (\d+)", out)
    return int(m.group(1)) if m else -1


def _ping(cli: socket.socket, dst, n: int, interval_s: float) -> list[float]:
    rtts = []
    for i in range(n):
        t0 = time.perf_counter()
        cli.sendto(struct.pack("!I", i) + b"p" * 60, dst)
        while True:
            data, _ = cli.recvfrom(2048)
            if struct.unpack("!I", data[:4])[0] == i:
                break
        rtts.append(time.perf_counter() - t0)
        time.sleep(interval_s)
    return rtts


def _servers(ns: str, addr: str, port: int):
    """In namespace `ns`, on daemon threads: a UDP echo (datagrams starting b"SEQ!" are recorded in
    `received` instead) and a TCP sink that answers b"k" after every `expect["n"]` bytes."""
    with in_netns(ns):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((addr, port))
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((addr, port))
        tcp.listen(8)
    expect = {"n": 0}
    received: list[int] = []

    def udp_loop():
        while True:
            try:
                data, peer = udp.recvfrom(4096)
            except OSError:
                return
            if not data:
                return
            if data[:4] == b"SEQ!":
                received.append(struct.unpack("!I", data[4:8])[0])
            else:
                udp.sendto(data, peer)

    def tcp_loop():
        while True:
            try:
                conn, _ = tcp.accept()
            except OSError:
                return
            with conn:
                while True:
                    got = 0
                    while got < expect["n"]:
                        b = conn.recv(1 << 20)
                        if not b:
                            break
                        got += len(b)
                    if got < expect["n"]:
                        break
                    conn.sendall(b"k")

    for fn in (udp_loop, tcp_loop):
        threading.Thread(target=fn, daemon=True).start()
    return udp, tcp, expect, received


def selftest(rate: str, delays: list[float], variants: list[tuple[int, bool]], bulk_mb: float) -> int:
    if os.geteuid() != 0:
        print("selftest needs root (network namespaces, /dev/net/tun)")
        return 1
    ns_a, ns_b = "ldtest-a", "ldtest-b"
    addr_a, addr_b = "10.231.78.1", "10.231.78.2"
    port = 27100
    rate_bps = parse_rate(rate)
    bulk = int(bulk_mb * 1e6)
    act = 2 * 128 * 384 * 4  # one MiniLM activation of a micro-batch of 2 rows (part (d)'s transfer)
    for ns in (ns_a, ns_b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    failed = 0
    try:
        for ns in (ns_a, ns_b):
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        print(f"linkdelay self-check: namespaces {ns_a} <-> {ns_b} through the relay, tbf {rate} on each "
              f"device's egress; UDP ping-pong RTT (20 pings), TCP bulk {bulk_mb:g} MB, cold/warm "
              f"{act / 1e3:.0f} kB transfers, 2000 numbered UDP datagrams (order/loss), relay CPU")
        cases = [(d, 1500, True) for d in delays] + [(v_delay, mtu, gso) for mtu, gso in variants
                                                     for v_delay in delays[1:2] or delays[:1]]
        for delay_s, mtu, gso in cases:
            port += 1
            pair = Pair(ns_a, "ld0", addr_a, ns_b, "ld0", addr_b)
            with DelayLine([pair], delay_s, rate, mtu=mtu, gso=gso) as line:
                _run(["ip", "-n", ns_a, "addr", "add", f"{addr_a}/32", "dev", "ld0"])
                _run(["ip", "-n", ns_b, "addr", "add", f"{addr_b}/32", "dev", "ld0"])
                udp_srv, tcp_srv, expect, received = _servers(ns_b, addr_b, port)
                with in_netns(ns_a):
                    cli = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    cli.bind((addr_a, 0))
                cli.settimeout(5)
                _ping(cli, (addr_b, port), 2, 0.0)  # warm-up
                rtts = _ping(cli, (addr_b, port), 20, 0.01)
                rtt = statistics.median(rtts)
                # order and loss: 2000 numbered datagrams, paced below the rate
                for i in range(2000):
                    cli.sendto(b"SEQ!" + struct.pack("!I", i) + b"u" * 492, (addr_b, port))
                    if i % 50 == 49:
                        time.sleep(50 * 520 * 8 / rate_bps * 1.5)
                time.sleep(2 * delay_s + 0.2)
                in_order = received == list(range(2000))
                # TCP: bulk rate, then cold and warm activation-sized transfers
                retrans0 = _netstat(ns_a)["RetransSegs"]
                expect["n"] = bulk
                cpu0, t0 = line.cpu_s(), time.perf_counter()
                bulk_cold, bulk_s = _tcp_send_ns(ns_a, (addr_b, port), bulk, 2)
                cpu_bulk = line.cpu_s() - cpu0
                wall_bulk = time.perf_counter() - t0
                expect["n"] = act
                time.sleep(0.3)
                cold_warm = _tcp_send_ns(ns_a, (addr_b, port), act, 4)
                retrans = _netstat(ns_a)["RetransSegs"] - retrans0
                drops = _tbf_drops(ns_a, "ld0") + _tbf_drops(ns_b, "ld0")
                cli.close()
                for srv in (udp_srv, tcp_srv):
                    with contextlib.suppress(OSError):
                        srv.shutdown(socket.SHUT_RDWR)
                    srv.close()
            st = line.stats or {}
            lost = sum(d["write_errors"] for d in st.get("dirs", []))
            # one-way transfer time of `bulk` bytes: acknowledged after one more one-way trip
            tput = bulk * 8 / max(bulk_s - rtt / 2, 1e-9)
            tput_cold = bulk * 8 / max(bulk_cold - rtt / 2, 1e-9)
            ideal_act = act * 8 / rate_bps + 2 * delay_s
            ok = (abs(rtt - 2 * delay_s) < 0.001 + 0.1 * 2 * delay_s and 0.85 < tput / rate_bps < 1.05
                  and in_order and lost == 0)
            failed += not ok
            pkts = sum(d["packets"] for d in st.get("dirs", []))
            late = max((d["late_max_us"] for d in st.get("dirs", [])), default=0)
            late_mean = max((d["late_mean_us"] for d in st.get("dirs", [])), default=0)
            print(f"  delay {delay_s * 1e3:4.1f} ms, mtu {mtu:5d}, {'gso' if gso else 'no gso'}: "
                  f"RTT median {rtt * 1e3:6.2f} ms (min {min(rtts) * 1e3:.2f}, max {max(rtts) * 1e3:.2f}; "
                  f"expected {2 * delay_s * 1e3:.1f} + overhead)")
            print(f"      TCP {bulk_mb:g} MB twice on one connection: warm {tput / 1e6:.1f} Mbit/s "
                  f"({tput / rate_bps:.0%} of tbf {rate}; cold, slow start included: {tput_cold / 1e6:.1f}); "
                  f"relay CPU {cpu_bulk / wall_bulk:.0%} of a core during it "
                  f"({cpu_bulk / (2 * bulk / 1e6) * 1e3:.1f} ms per MB), {st.get('cpu_s', 0):.2f} s over "
                  f"{st.get('wall_s', 0):.1f} s in all, {pkts} packets forwarded in all")
            print(f"      {act / 1e3:.0f} kB + 1-byte reply: cold (new connection) {cold_warm[0] * 1e3:.1f} ms, "
                  f"warm {statistics.median(cold_warm[1:]) * 1e3:.1f} ms; ideal bytes/rate + 2 x delay "
                  f"{ideal_act * 1e3:.1f} ms")
            print(f"      order/loss: {len(received)}/2000 datagrams "
                  f"{'in order' if in_order else 'OUT OF ORDER/LOST'}; "
                  f"relay write errors {lost}, left in queue {sum(d['left_in_queue'] for d in st.get('dirs', []))}; "
                  f"tbf drops {drops}, TCP retransmitted segments {retrans}; relay lateness mean "
                  f"{late_mean:.0f} us, max {late:.0f} us ({st.get('sched')}); {'OK' if ok else 'FAIL'}")
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    print("self-check " + ("passed" if not failed else f"FAILED in {failed} case(s)"))
    return 1 if failed else 0


def _tcp_send_ns(ns: str, addr, nbytes: int, repeats: int) -> list[float]:
    """Send `nbytes` `repeats` times on one new connection from namespace `ns`, each time until the
    sink acknowledges all of them with one byte (transfer + one trip back); the first is cold."""
    with in_netns(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(addr)
    chunk = b"x" * (1 << 16)
    times = []
    with s:
        for _ in range(repeats):
            t0 = time.perf_counter()
            left = nbytes
            while left:
                left -= s.send(chunk[:min(left, len(chunk))])
            if s.recv(1) != b"k":
                raise RuntimeError("bulk sink answered wrongly")
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["relay"]:
        ap = argparse.ArgumentParser(prog="linkdelay.py relay")
        ap.add_argument("--delay", default="5ms", help="one-way delay, e.g. 5ms (default 5ms)")
        ap.add_argument("--pair", action="append", required=True, help="NS_A:DEV_A,NS_B:DEV_B (repeatable)")
        ap.add_argument("--no-gso", dest="gso", action="store_false",
                        help="no virtio-net header/offloads: one relay packet per MTU-sized packet")
        ap.add_argument("--no-stdin-watch", action="store_true", help="do not exit when stdin closes")
        ap.add_argument("--no-realtime", dest="realtime", action="store_false",
                        help="stay a normal process (default: SCHED_FIFO priority 10, else nice -10)")
        return relay_main(ap.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--selftest", action="store_true", help="run the self-check")
    ap.add_argument("--rate", default="100mbit", help="tbf rate for the self-check (default 100mbit)")
    ap.add_argument("--delays", default="0ms,5ms,20ms", help="one-way delays to check (default 0ms,5ms,20ms)")
    ap.add_argument("--variants", default="1500:nogso,65000:nogso",
                    help="extra MTU:gso|nogso variants, checked at the second delay (default 1500:nogso,65000:nogso)")
    ap.add_argument("--bulk-mb", type=float, default=4.0, help="TCP bulk transfer size (default 4 MB)")
    args = ap.parse_args(argv)
    if not args.selftest:
        ap.print_help()
        return 2
    variants = []
    for v in filter(None, args.variants.split(",")):
        mtu, mode = v.split(":")
        variants.append((int(mtu), mode == "gso"))
    return selftest(args.rate, [parse_delay(d) for d in args.delays.split(",")], variants, args.bulk_mb)


if __name__ == "__main__":
    sys.exit(main())
