"""`confidant plan --on-failure` (issue 32): the room a plan leaves for the fault policy follows the
policy. Under "replan" (the default) each device of a pipeline keeps 16 MiB of its budget for the
snapshot copies' working bytes (`runtime.pipeline.snapshots.peer_snapshot_bytes`); a plan on one
device has no peer to copy to and keeps none; under "stop" nothing is copied and nothing kept.
plan.json records the policy, and `train PLAN` runs with it and refuses another; `estimate` prices
a lone device as `plan` plans it.

MiniLM priced by the graph's nominal profile (`planner.memory_defaults.default_profile`): its
trainable state (~350 MiB with AdamW) is large beside the reserve, so a budget can be set that a
two-device cut fits only without the reserve, from the cost model's own figures for every cut."""
from __future__ import annotations

import json

import pytest

from ir.bundle import load_plan
from jobs.common.errors import FlagError, JobError
from jobs.estimate import EstimateSettings, estimate_memory
from jobs.planning import PlanSettings, plan_model
from jobs.train.from_plan import plan_policy
from planner.cluster import load_cluster
from planner.emit import load_plan_cluster
from planner.onnx_import import load_model
from runtime.pipeline.snapshots import peer_snapshot_bytes
from support import best_cut_in_two_bytes, run_cli, whole_model_bytes, write_nominal_cluster

MIB = 2 ** 20
SHAPE = dict(batch=4, seq=16, microbatches=2)
RESERVE = peer_snapshot_bytes([0, 0])[0]  # what the default policy keeps on each device of a pipeline
FAST = dict(time_limit_s=5.0)


@pytest.fixture(scope="module")
def minilm(minilm_onnx):
    return minilm_onnx, load_model(minilm_onnx, SHAPE["batch"] // SHAPE["microbatches"], SHAPE["seq"])


def _device(cluster_file):
    return load_cluster(cluster_file).devices[0]


def test_a_budget_that_fits_only_without_the_reserve_plans_under_stop_and_not_under_the_default(minilm, tmp_path):
    model, graph = minilm
    probe = write_nominal_cluster(tmp_path / "probe", graph, [("a", 2 << 30), ("b", 2 << 30)])
    M = SHAPE["microbatches"]
    two, alone = best_cut_in_two_bytes(graph, _device(probe), M), whole_model_bytes(graph, _device(probe), M)
    budget = two + RESERVE // 2  # a cut fits beside half the reserve, and no device holds the model alone
    assert budget < alone, (two / MIB, alone / MIB)
    cluster = write_nominal_cluster(tmp_path, graph, [("a", budget), ("b", budget)])
    with pytest.raises(JobError, match="snapshot copies"):
        plan_model(model, cluster, PlanSettings(**SHAPE, **FAST), tmp_path / "default")
    plan = load_plan(plan_model(model, cluster, PlanSettings(**SHAPE, **FAST, on_failure="stop"), tmp_path / "stop"))
    figures = [(d.name, d.memory_bytes / MIB, d.reserved_bytes, d.memory_budget_bytes / MIB) for d in plan.devices]
    assert plan.on_failure == "stop" and len(plan.devices) == 2, figures
    assert all(d.reserved_bytes == 0 and d.memory_bytes <= budget for d in plan.devices), figures
    assert max(d.memory_bytes for d in plan.devices) > budget - RESERVE, figures  # it needed the reserve's room
    assert all(d.reserved_bytes == 0 for d in load_plan_cluster(tmp_path / "stop").devices)
    assert json.loads((tmp_path / "stop" / "plan.json").read_text())["on_failure"] == "stop"
    # train runs the plan with its policy, and refuses another in one line, exit 2, before any worker starts
    assert plan_policy(tmp_path / "stop", plan, None) == "stop" == plan_policy(tmp_path / "stop", plan, "stop")
    with pytest.raises(FlagError, match="planned for --on-failure stop"):
        plan_policy(tmp_path / "stop", plan, "replan")
    proc = run_cli("train", tmp_path / "stop", "--data", tmp_path / "absent.txt", "--on-failure", "replan",
                   "--insecure")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("warning")]
    assert len(said) == 1 and "--on-failure replan" in said[0] and "planned for --on-failure stop" in said[0], said


def test_a_plan_on_one_device_keeps_no_reserve(minilm, tmp_path):
    """A lone device has no peer to hold its copies: planned within its whole budget, plan.json's
    reserve 0, under the default policy. Two ways to end on one device: the other cannot hold a
    block beside its runtime and the reserve, and the big device takes all (it fits with the reserve
    too); or the big device's budget holds the model only without the reserve."""
    model, graph = minilm
    probe = write_nominal_cluster(tmp_path / "probe", graph, [("a", 2 << 30)])
    alone = whole_model_bytes(graph, _device(probe), SHAPE["microbatches"])
    for name, budget in (("roomy", 2 << 30), ("tight", alone + RESERVE // 2)):
        cluster = write_nominal_cluster(tmp_path / name, graph, [("big", budget), ("small", 60 * MIB)])
        plan = load_plan(plan_model(model, cluster, PlanSettings(**SHAPE, **FAST), tmp_path / name / "plan"))
        figures = [(d.name, d.memory_bytes / MIB, d.reserved_bytes, d.memory_budget_bytes / MIB) for d in plan.devices]
        assert [d.name for d in plan.devices] == ["big"] and plan.on_failure == "replan", (name, figures)
        assert plan.devices[0].reserved_bytes == 0 and plan.devices[0].memory_budget_bytes == budget, (name, figures)
        assert plan.devices[0].memory_bytes <= budget, (name, figures)
        if name == "tight":  # it needed the reserve's room
            assert plan.devices[0].memory_bytes > budget - RESERVE, figures
        # `estimate` prices it as `plan` makes it: the big device alone, its whole budget
        est = estimate_memory(model, EstimateSettings(**SHAPE), cluster_file=cluster).requested
        assert est.fits and [(st.device, st.memory_bytes, st.budget_bytes) for st in est.stages] == \
            [("big", plan.devices[0].memory_bytes, budget)], (name, est.stages)


def test_the_lora_fit_hint_gives_no_line_when_the_solver_finds_no_assignment_in_its_time(minilm, tmp_path):
    """`plan`'s LoRA fit hint under a limit CP-SAT cannot search in (its one second on a loaded machine):
    where not even a least-overflow assignment is found in time (`does_not_fit`'s TimeoutError), the
    hint is no line and `plan`'s own refusal stands, instead of the TimeoutError escaping."""
    from jobs.planning import lora_fit_hint

    _, graph = minilm
    cluster = load_cluster(write_nominal_cluster(tmp_path, graph, [("a", 1 << 20), ("b", 1 << 20)]))
    assert lora_fit_hint(graph, cluster, "1f1b-flush", SHAPE["microbatches"], "adamw", time_limit_s=1e-9) == ""
