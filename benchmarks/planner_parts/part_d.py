"""Part (d) of benchmarks/planner.py: a real slow link, workers in network namespaces.

The coordinator runs in its own namespace as a child, ``benchmarks/planner.py --child-d CONFIG``
(`child_d` below), so that its sockets live there.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import NoiseMeter, make_batches
from benchmarks.planner_parts.minilm import (PRED_HEADER, _colocated_lines, _pred_meas_rows, compare_row,
                                             identical_cluster, measured_compute_cost, measured_compute_sim,
                                             measured_figures, plan_and_predict, profile_corun, profile_here,
                                             summarize_training)
from benchmarks.planner_parts.shared import (BATCH, CPUS, LR, MARKER, NUM_LABELS, OPTIMIZER, ROOT, SEQ, _log,
                                             _table)

ENTRY = ROOT / "benchmarks" / "planner.py"  # the entry script, whose --child-d runs child_d

NS_PREFIX = "cbplan"
SUBNET = "10.231.77"


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {ns}: {proc.stderr.strip()}")


class Netns:
    """A coordinator namespace with a bridge, one namespace per worker on that bridge (unshaped
    control), and a tbf-shaped link between every two workers (/32 routes send worker-to-worker
    traffic over it): a veth pair when `delay_s` is None, else a TUN pair joined by the userspace
    delay line of benchmarks/linkdelay.py (`delay_s` one way; this kernel has no netem), whose
    statistics (packets, CPU seconds) land in `relay_stats` at `close`. Everything is removed by
    `close` (the relay first, then the namespaces, which takes their interfaces along)."""

    def __init__(self, workers: int, rate: str, delay_s: float | None = None):
        self.coord = f"{NS_PREFIX}-c"
        self.workers = [f"{NS_PREFIX}-w{i}" for i in range(workers)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(workers)]
        self.coord_address = f"{SUBNET}.254"
        self.created: list[str] = []
        self.rate = rate
        self.delay_s = delay_s
        self.line = None  # the DelayLine, when delay_s is set
        self.relay_stats: dict | None = None

    def __enter__(self):
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _setup(self) -> None:
        c = self.coord
        self._add_ns(c)
        _ip("-n", c, "link", "add", "br0", "type", "bridge")
        _ip("-n", c, "addr", "add", f"{self.coord_address}/24", "dev", "br0")
        _ip("-n", c, "link", "set", "br0", "up")
        for i, (w, addr) in enumerate(zip(self.workers, self.addresses)):
            self._add_ns(w)
            _ip("-n", c, "link", "add", f"ctl{i}", "type", "veth", "peer", "name", "ctl", "netns", w)
            _ip("-n", c, "link", "set", f"ctl{i}", "master", "br0")
            _ip("-n", c, "link", "set", f"ctl{i}", "up")
            _ip("-n", w, "addr", "add", f"{addr}/24", "dev", "ctl")
            _ip("-n", w, "link", "set", "ctl", "up")
        if self.delay_s is not None:
            from benchmarks.linkdelay import DelayLine, Pair

            pairs = [Pair(self.workers[i], f"d{j}", self.addresses[i], self.workers[j], f"d{i}", self.addresses[j])
                     for i, j in itertools.combinations(range(len(self.workers)), 2)]
            self.line = DelayLine(pairs, self.delay_s, self.rate)  # TUN devices up, tbf, /32 routes
            self.line.start()
            return
        for i, j in itertools.combinations(range(len(self.workers)), 2):
            wi, wj = self.workers[i], self.workers[j]
            _ip("-n", wi, "link", "add", f"d{j}", "type", "veth", "peer", "name", f"d{i}", "netns", wj)
            for ns, dev, peer_addr in ((wi, f"d{j}", self.addresses[j]), (wj, f"d{i}", self.addresses[i])):
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "route", "add", f"{peer_addr}/32", "dev", dev)
                _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "32kb",
                    "latency", "400ms")

    def relay_cpu_s(self) -> float:
        """CPU seconds the delay line's relay has used so far (0 without one)."""
        return self.line.cpu_s() if self.line is not None and self.line.proc is not None else 0.0

    def close(self) -> None:
        if self.line is not None:
            self.relay_stats = self.line.close()
            self.line = None
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()

    def popen(self, ns: str, argv: list[str], **kwargs) -> subprocess.Popen:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=str(ROOT), env=env, **kwargs)


def netns_available() -> str | None:
    """None when part (d) can run, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (install iproute2: apt-get update && apt-get install -y iproute2)"
    probe = f"{NS_PREFIX}-probe"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"cannot create a network namespace: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (a throw-away namespace and dummy veth)."""
    ns = f"{NS_PREFIX}-nt"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
        return False
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "x0", "type", "veth", "peer", "name", "x1"], capture_output=True)
        proc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "x0", "root", "netem",
                               "delay", "1ms"], capture_output=True)
        return proc.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure_netns_link(net: Netns, port: int, sizes=(1 << 10, 1 << 18, 1 << 20), reps: int = 4):
    """measure_link from worker 0's namespace to a probe server in worker 1's, through the shaped veth."""
    from ir.profile import Link

    server = net.popen(net.workers[1], [sys.executable, "-m", "confidant", "profile", "--serve-link", "--listen",
                                        f"tcp://{net.addresses[1]}:{port}"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if not line.startswith("listening"):
            raise RuntimeError(f"link probe server did not start: {line!r}")
        code = ("import json, sys; from runtime.profiling import measure_link; "
                f"l = measure_link('tcp://{net.addresses[1]}:{port}', sizes={tuple(sizes)!r}, reps={reps}); "
                "print(json.dumps([l.bandwidth_bytes_per_s, l.latency_s]))")
        client = net.popen(net.workers[0], [sys.executable, "-c", code], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        out, err = client.communicate(timeout=300)
        if client.returncode != 0:
            raise RuntimeError(f"measure_link failed: {err[-2000:]}")
        bw, lat = json.loads(out.strip().splitlines()[-1])
        return Link(bw, lat)
    finally:
        _stop([server])


def child_d(config_path: str) -> int:
    """The coordinator, run inside the coordinator's namespace: train, print figures as JSON."""
    from jobs.train.pipeline import FaultPolicy, train_pipeline
    from planner.onnx_import import load_model
    from runtime.pipeline.coordinator import PipelineConfig

    cfg = json.loads(Path(config_path).read_text())
    M, steps = cfg["microbatches"], cfg["steps"]
    graph = load_model(cfg["model"], BATCH // M, SEQ)
    batches = make_batches(steps)
    config = PipelineConfig(schedule=cfg["schedule"], microbatches=M, optimizer=OPTIMIZER, lr=LR, timeout_s=300)
    cuts = [a for a, _ in cfg["ranges"][1:]]
    res = train_pipeline(graph, batches, NUM_LABELS, cfg["addresses"], config, steps, cuts=cuts or None,
                         listen=cfg["listen"], insecure=True, faults=FaultPolicy(on_failure="stop"))
    print(MARKER + json.dumps(summarize_training(res, cfg["schedule"], M)), flush=True)
    return 0


def train_netns(net: Netns, model: Path, ranges, schedule: str, M: int, n_steps: int, port: int) -> dict:
    n = len(ranges)
    workers = []
    try:
        for i in range(n):
            # plaintext on the benchmark's own namespaces: this part measures the link model, and
            # benchmarks/faults.py measures what CURVE costs
            workers.append(net.popen(net.workers[i], [sys.executable, "-m", "confidant", "worker", "--insecure",
                                                      "--listen", f"tcp://{net.addresses[i]}:{port}"],
                                     stdout=subprocess.PIPE, text=True))
        addresses = []
        for w in workers:
            line = w.stdout.readline()
            if not line.startswith("listening "):
                raise RuntimeError(f"worker did not start: {line!r}")
            addresses.append(line.split()[1])
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"model": str(model), "microbatches": M, "steps": n_steps, "schedule": schedule,
                       "ranges": [list(r) for r in ranges], "addresses": addresses,
                       "listen": f"tcp://{net.coord_address}:{port + 100}"}, f)
            cfg = f.name
        try:
            coord = net.popen(net.coord, [sys.executable, str(ENTRY), "--child-d", cfg],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = coord.communicate(timeout=900)
        finally:
            os.unlink(cfg)
        lines = [ln for ln in out.splitlines() if ln.startswith(MARKER)]
        if coord.returncode != 0 or not lines:
            raise RuntimeError(f"coordinator failed (rc {coord.returncode}): {(out + err)[-3000:]}")
        codes = [w.wait(60) for w in workers]
        if any(codes):
            raise RuntimeError(f"workers exited with {codes}")
        return json.loads(lines[-1][len(MARKER):])
    finally:
        _stop(workers)


def part_d(model: Path, M: int, steps: int, time_limit: float,
           configs=((2, "100mbit"), (2, "20mbit"), (3, "100mbit")), delay_s: float | None = 0.005) -> dict:
    """`delay_s`: one-way delay of every worker-to-worker link, added by the userspace delay line
    (benchmarks/linkdelay.py: TUN pairs, tbf on their egress); None: plain tbf-shaped veth pairs."""
    from planner.onnx_import import load_model

    why = netns_available()
    if why:
        _log(f"(d) skipped: {why}")
        return {"skipped": why}
    netem = netem_available()
    graph = load_model(str(model), BATCH // M, SEQ)
    profile, _ = profile_here(graph)
    loaded, _ = profile_corun(model, graph, min(max(n for n, _ in configs), CPUS))
    rows = []
    port = 26000
    schedule = "1f1b-flush"
    for n, rate in configs:
        how = "veths" if delay_s is None else f"TUN pairs through the delay line ({delay_s * 1e3:g} ms one way)"
        _log(f"(d) {n} workers in namespaces, worker-to-worker {how} shaped to {rate} ...")
        with Netns(n, rate, delay_s) as net:
            port += 10
            link = measure_netns_link(net, port)
            _log(f"    measured link {link.bandwidth_bytes_per_s * 8 / 1e6:.1f} Mbit/s, "
                 f"latency {link.latency_s * 1e3:.2f} ms")
            cluster = identical_cluster(profile, n, link, profile.memory_available_bytes // 3)
            part, solved, solve_s, pred = plan_and_predict(graph, profile, loaded, n, link, schedule, M, steps,
                                                           time_limit)
            ranges = [tuple(r) for r in part.ranges]
            _log(f"    ranges {ranges}, predicted {pred['cost_s']:.3f} s; training ...")
            port += 10
            relay0, t0 = net.relay_cpu_s(), time.perf_counter()
            with NoiseMeter() as noise:
                run = train_netns(net, model, ranges, schedule, M, steps + 1, port)
            relay_cpu, train_wall = net.relay_cpu_s() - relay0, time.perf_counter() - t0
        others = noise.others
        relay = None
        if delay_s is not None:
            # the relay is our own child but not yet waited for, so NoiseMeter counted it as another process
            if others is not None:
                others = max(0.0, others - relay_cpu / (CPUS * train_wall))
            relay = {"cpu_s": relay_cpu, "wall_s": train_wall, "core_share": relay_cpu / train_wall,
                     "stats": net.relay_stats}
        meas = measured_figures([run], schedule, M, steps)
        pred["sim_measured_compute_s"] = measured_compute_sim(graph, cluster, part, schedule, M, steps, meas)
        pred["cost_measured_compute_s"] = measured_compute_cost(graph, cluster, part, schedule, M, meas)
        row = {"workers": n, "rate": rate, "delay_s": delay_s, "schedule": schedule, "ranges": ranges,
               "link": {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s},
               "solver_stages": len(solved.stages), "solve_s": solve_s, "predicted": pred, "measured": meas,
               **compare_row(pred, meas), "others_cpu": others, "relay": relay, "runs": [run]}
        _log(f"    measured {meas['step_s']:.3f} s ({row['err_cost']:+.1%} vs cost, {row['err_sim']:+.1%} vs sim)"
             + ("" if relay is None else f"; delay line relay used {relay['core_share']:.0%} of a core"))
        rows.append(row)
    return {"netem": netem, "delay_s": delay_s, "microbatches": M, "steps": steps, "rows": rows}


def format_d(d: dict) -> str:
    if d.get("skipped"):
        return f"(d) skipped: {d['skipped']}"
    delay_s = d.get("delay_s")
    netem = "netem is available in this kernel" if d["netem"] else "this kernel has no netem"
    if delay_s is None:
        how = (f"worker-to-worker veth pairs shaped with tbf, no delay added ({netem}): latency is the bare "
               "veth's")
    else:
        how = (f"worker-to-worker links are TUN pairs joined by a USERSPACE DELAY LINE (benchmarks/linkdelay.py, "
               f"{delay_s * 1e3:g} ms one way, {'used for comparability' if d['netem'] else 'because ' + netem}), "
               "bandwidth shaped with tbf on each TUN's egress")
    lines = [f"(d) predicted vs measured over a shaped link: workers in network namespaces; {how}; "
             f"MiniLM, 1f1b-flush, M={d['microbatches']}, {d['steps']} timed steps",
             "    link = bandwidth/latency measured by measure_link through that link (the prediction uses these); "
             "link ms = predicted transfer time per stage and micro-batch (both directions)"]

    def extra(r):
        l = r["link"]
        return [r["rate"] + ("" if r.get("delay_s") is None else f"+{r['delay_s'] * 1e3:g}ms"),
                f"{l['bandwidth_bytes_per_s'] * 8 / 1e6:.1f}Mb/{l['latency_s'] * 1e3:.2f}ms",
                ",".join(f"{x * 1000:.0f}" for x in r["predicted"]["stage_link_s"])]

    lines += _table(_pred_meas_rows(d["rows"], extra), ["N", "tbf+delay", "link", "link ms", "schedule", "blocks",
                                                        *PRED_HEADER])
    lines += _colocated_lines(d["rows"])
    for r in d["rows"]:
        relay = r.get("relay")
        if relay:
            st = relay.get("stats") or {}
            dirs = st.get("dirs", [])
            lines.append(f"    delay line, {r['workers']} workers {r['rate']}: relay used {relay['cpu_s']:.1f} s CPU in "
                         f"{relay['wall_s']:.0f} s of training ({relay['core_share']:.0%} of one core, not counted in "
                         f"'others'); {sum(x['packets'] for x in dirs)} packets, "
                         f"{sum(x['bytes'] for x in dirs) / 1e6:.0f} MB forwarded, write errors "
                         f"{sum(x['write_errors'] for x in dirs)}, lateness mean "
                         f"{max((x['late_mean_us'] for x in dirs), default=0):.0f} us, max "
                         f"{max((x['late_max_us'] for x in dirs), default=0) / 1e3:.1f} ms")
    return "\n".join(lines)
