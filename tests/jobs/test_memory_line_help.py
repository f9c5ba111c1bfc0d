"""README's "How much memory a device needs" against the command line itself: every flag it names is one the
commands it goes with take (their real --help), and the training commands' --help says what the memory line
that ends every run means (MEASURED the process's VmHWM, PLANNED, BUDGET). A one-device run over its memory
is told which of those flags lower it, not to re-profile a device no profile priced."""
from __future__ import annotations

import re
from pathlib import Path

from jobs.common.memory_check import ONE_DEVICE_ADVICE, OVER_PLAN_SHARE, check_memory, local_check
from jobs.common.metrics import DeviceFigures, StepFigures, TrainingMetrics
from planner.onnx_import import load_model
from support import run_cli

MIB = 2 ** 20
ROOT = Path(__file__).resolve().parents[2]
# the commands a flag of the section's table goes with where the row names none: the training commands, `plan`
TRAINING_COMMANDS = ("train-local", "train-pipeline", "train", "plan")


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## How much memory a device needs")
    return text[start:text.index("\n## ", start + 1)]


def _help(command: str) -> str:
    run = run_cli(command, "--help")
    assert run.returncode == 0, run.stderr
    return " ".join(run.stdout.split())  # argparse's wrapping undone


def test_every_flag_the_memory_section_names_is_taken_by_its_commands():
    section = _section()
    helps = {c: _help(c) for c in (*TRAINING_COMMANDS, "export", "estimate", "show")}
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", section))
    assert {"--lora", "--base-dtype", "--activations", "--on-failure", "--microbatches", "--optimizer"} <= named
    for flag in sorted(named):
        assert any(re.search(rf"{flag}\b", helps[c]) for c in TRAINING_COMMANDS), flag
    # a flag the section gives a command (`export --base-dtype int4`) is that command's
    for command, flag in re.findall(r"`(?:confidant )?([a-z-]+) (--[a-z-]+)", section):
        assert re.search(rf"{flag}\b", helps[command]), (command, flag)
    # the commands the section sends the reader to exist
    for command in re.findall(r"`confidant ([a-z-]+)", section):
        assert command in helps, command


def test_the_training_commands_help_says_what_the_memory_line_means():
    for command in ("train-local", "train", "train-pipeline"):
        said = _help(command)
        assert "MEASURED / PLANNED /" in said and "peak resident memory (Linux VmHWM" in said, (command, said)
    local = _help("train-local")
    assert "VmHWM, never reset) over its whole life: set-up, the evaluations before and after training" in local
    assert "what the memory model says a step adds" in local and "the memory model's whole figure" in local
    assert "BUDGET: what this machine had free when the run started" in local
    plan = _help("train")
    assert "PLANNED is the plan's figure for the device" in plan and "BUDGET its memory in the plan's cluster" in plan
    assert f"over PLANNED by more than {OVER_PLAN_SHARE:.0%}" in plan


def test_a_one_device_run_over_its_memory_is_told_the_flags_that_lower_it(tiny_onnx):
    """`train-local`'s check (the memory model's figure for the tiny model, a room of 1 MiB): the warning
    says the run was planned over it too and names the README's flags, each one train-local takes."""
    tiny_graph = load_model(tiny_onnx["torchscript-14"], 8, 16)
    metrics = TrainingMetrics("train-local", "m.onnx", 8, 16, (StepFigures(1, 2.0, 0.5, 16.0),),
                              (DeviceFigures("this-device", 0, 0, len(tiny_graph.blocks) - 1, 300 * MIB),))
    notes = _Lines()
    out = local_check(metrics, tiny_graph, "adamw", "mnn", MIB, notes)
    assert [e["over"] for e in out.events] == ["budget"]
    (warning,) = [line for line in notes if line.startswith("warning:")]
    assert warning.startswith("warning: this-device used 300 MiB, over its 1 MiB budget (planned ")
    assert warning.endswith(f"; planned over it too: {ONE_DEVICE_ADVICE}"), warning
    local = _help("train-local")
    for flag in re.findall(r"--[a-z-]+", ONE_DEVICE_ADVICE):
        assert re.search(rf"{flag}\b", local), flag
    # a plan's device that the memory model put within its budget: its profile missed part of it
    planned = check_memory(metrics, {"this-device": 200 * MIB}, {"this-device": 256 * MIB}, notes)
    assert planned.events[-1]["over"] == "budget"
    assert notes[-1].endswith("; the memory model missed part of it: re-profile the device, or give it more room"), \
        notes[-1]


class _Lines(list):
    """A Reporter that keeps what it is told (check_memory only notes)."""

    note = list.append
