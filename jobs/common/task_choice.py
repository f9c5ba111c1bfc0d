"""The task of a training job (`tasks.task.Task`): found by its `--task` name, or by the model
(`tasks.choice.task_of`, which reads the side files `confidant export` writes), and checked against
the lowered model, with a JobError that says what to do when either does not fit."""
from __future__ import annotations

from pathlib import Path

from jobs.common.errors import JobError
from tasks.choice import task_named
from tasks.task import Task, TaskMismatch


def task_for(name: str) -> Task:
    """The task called `name`; a JobError lists the task names otherwise."""
    try:
        return task_named(name)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def check_graph(task: Task, model: Path, graph, data, eval_path: Path | None = None) -> None:
    """`task.check_graph`: a model that does not fit the task is a JobError (a model that does not
    fit the data stays an `ir.errors.InputFileError`, a bad input)."""
    try:
        task.check_graph(model, graph, data, eval_path)
    except TaskMismatch as exc:
        raise JobError(str(exc)) from None
