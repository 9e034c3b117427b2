"""Goodput accounting on synthetic timelines: every second of every worker goes to exactly one category (each
category, a retry with recomputed steps, a preemption, a hang), the categories add up to workers x wall time, and
the execution's record survives a checkpoint's JSON across attempts."""

from __future__ import annotations

import json
import math
import os
import time

import hypothesis
import hypothesis.strategies as st
import pytest

from tests.helpers.timelines import SpanEvent, StepEvent, WorkerTimeline, attribute
from training_core.telemetry.goodput import (
    CATEGORIES,
    AttemptGoodput,
    ExecutionGoodput,
    GoodputClock,
    GoodputSeconds,
    LastProgress,
    recompute_through_step,
    settle_interrupted,
)


def _steps(first_step: int, count: int, *, start_s: float, step_s: float, data_s: float, comm_s: float):
    return tuple(
        StepEvent(
            end_s=start_s + (i + 1) * step_s,
            global_step=first_step + i,
            step_time_s=step_s,
            data_wait_s=data_s,
            comm_wait_s=comm_s,
        )
        for i in range(count)
    )


def test_a_finished_attempt_puts_each_second_in_startup_steps_checkpoint_evaluation_and_idle():
    # 0-10 s start-up, 10 steps of 1 s (0.2 data wait, 0.1 communication), a 3 s checkpoint, 1 s of loop between
    # epochs then a 4 s validation, ranks waiting 2 s at the end.
    events = (
        *_steps(1, 10, start_s=10.0, step_s=1.0, data_s=0.2, comm_s=0.1),
        SpanEvent("checkpoint", end_s=23.0),
        SpanEvent("evaluation", end_s=28.0),
    )
    seconds = attribute(WorkerTimeline(start_s=0.0, end_s=30.0, outcome="finished", events=events))

    expected = GoodputSeconds(
        productive=7.0, data_wait=2.0, communication=1.0, checkpoint=3.0, evaluation=5.0, startup=10.0, idle=2.0
    )
    assert seconds.as_list() == pytest.approx(expected.as_list())
    assert seconds.total_s == pytest.approx(30.0)
    assert seconds.goodput == pytest.approx(7.0 / 30.0)


def test_the_time_before_a_step_starts_is_its_data_wait_and_waits_never_exceed_the_step():
    clock = GoodputClock(start_s=0.0)
    clock.step(end_s=1.0, global_step=1, step_time_s=1.0, data_wait_s=0.0, comm_wait_s=0.0)
    # 0.5 s of loop between the previous step and this one, then a step whose measured waits exceed it (two clocks).
    clock.step(end_s=3.5, global_step=2, step_time_s=2.0, data_wait_s=1.5, comm_wait_s=1.5)

    seconds = clock.seconds
    assert seconds.productive == pytest.approx(1.0)
    assert seconds.data_wait == pytest.approx(0.5 + 1.0) and seconds.communication == pytest.approx(1.0)
    assert seconds.total_s == pytest.approx(3.5)


def test_a_run_killed_once_shows_recomputed_steps_and_start_up_in_its_second_attempt():
    # Attempt 0 (2 workers): start-up 5 s, steps 1-20 of 1 s, a checkpoint at step 10 (2 s, recorded at 17 s);
    # killed after step 20 (at 37 s), the peer hung on the collective until 67 s; the retry started at 80 s.
    first = AttemptGoodput(
        index=0,
        num_workers=2,
        start_unix=1000.0,
        end_unix=1017.0,
        outcome="running",
        seconds=GoodputSeconds(startup=10.0, productive=20.0, checkpoint=4.0),
    )
    progress = LastProgress(global_step=20, step_unix=1037.0, end_unix=1067.0)
    settled = settle_interrupted(first, resumed_unix=1080.0, preempted=False, progress=progress)

    assert settled.outcome == "failed" and settled.wall_s == pytest.approx(80.0)
    assert settled.seconds.productive == pytest.approx(20.0 + 2 * 20.0)
    assert settled.seconds.hung == pytest.approx(2 * 30.0)
    assert settled.seconds.startup == pytest.approx(10.0 + 2 * 13.0)
    assert settled.attributed_fraction == pytest.approx(1.0)

    # Attempt 1 resumes step 10: 6 s of start-up, steps 11-20 are trained again, 21-30 are new.
    through = recompute_through_step(10, progress)
    assert through == 20
    events = _steps(11, 20, start_s=1086.0, step_s=1.0, data_s=0.0, comm_s=0.0)
    worker = WorkerTimeline(
        start_s=1080.0, end_s=1107.0, outcome="finished", events=events, recompute_through_step=through
    )
    second_seconds = attribute(worker).scaled(2)  # both workers alike
    assert second_seconds.startup == pytest.approx(12.0)
    assert second_seconds.recomputed == pytest.approx(20.0)
    assert second_seconds.productive == pytest.approx(20.0)
    assert second_seconds.idle == pytest.approx(2.0)

    second = AttemptGoodput(1, 2, 1080.0, 1107.0, "finished", second_seconds)
    execution = ExecutionGoodput().with_attempt(settled).with_attempt(second)
    assert execution.attributed_fraction == pytest.approx(1.0)
    assert execution.worker_seconds == pytest.approx(2 * 107.0)
    assert execution.goodput == pytest.approx((60.0 + 20.0) / 214.0)
    assert second.goodput == pytest.approx(20.0 / 54.0)


def test_without_its_last_progress_an_interrupted_attempts_unrecorded_time_is_recomputed_work():
    first = AttemptGoodput(0, 4, 0.0, 50.0, "running", GoodputSeconds(startup=40.0, productive=160.0))
    settled = settle_interrupted(first, resumed_unix=75.0, preempted=False)

    assert settled.seconds.recomputed == pytest.approx(4 * 25.0)
    assert settled.attributed_fraction == pytest.approx(1.0)
    # The next attempt then trains nothing twice: the work lost is counted once, here.
    assert recompute_through_step(500, None) == 500


def test_a_killed_attempt_whose_end_is_unknown_keeps_its_steps_and_counts_the_rest_as_start_up_not_hung():
    # Recorded at its checkpoint at 50 s; its last logged step (30) at 58 s; killed, so no end; the retry at 75 s.
    first = AttemptGoodput(0, 2, 0.0, 50.0, "running", GoodputSeconds(startup=20.0, productive=80.0))
    killed = LastProgress(global_step=30, step_unix=58.0)
    settled = settle_interrupted(first, resumed_unix=75.0, preempted=False, progress=killed)

    assert settled.seconds.productive == pytest.approx(80.0 + 2 * 8.0)
    assert settled.seconds.hung == 0.0 and settled.seconds.recomputed == 0.0
    assert settled.seconds.startup == pytest.approx(20.0 + 2 * 17.0)
    assert settled.attributed_fraction == pytest.approx(1.0) and settled.last_progress == killed
    # The settled record, with where the attempt got to, survives the checkpoint's JSON.
    restored = ExecutionGoodput.from_summary(json.loads(json.dumps(ExecutionGoodput((settled,)).summary())))
    assert restored.attempts == (settled,)


def test_a_preemption_costs_the_stop_and_the_next_attempts_start_up():
    first = AttemptGoodput(0, 2, 0.0, 60.0, "running", GoodputSeconds(startup=20.0, productive=100.0))
    settled = settle_interrupted(
        first, resumed_unix=90.0, preempted=True, progress=LastProgress(global_step=5, step_unix=61.0, end_unix=62.0)
    )
    assert settled.outcome == "preempted"
    assert settled.seconds.preempted == pytest.approx(2 * 30.0)
    assert settled.seconds.productive == pytest.approx(100.0) and settled.seconds.hung == 0.0

    resumed = attribute(
        WorkerTimeline(
            start_s=0.0,
            end_s=15.0,
            outcome="finished",
            events=_steps(6, 5, start_s=8.0, step_s=1.0, data_s=0.0, comm_s=0.0),
            after_preemption=True,
        )
    )
    assert resumed.preempted == pytest.approx(8.0) and resumed.startup == 0.0
    assert resumed.productive == pytest.approx(5.0) and resumed.idle == pytest.approx(2.0)


def test_a_hang_is_the_time_from_the_last_step_to_the_collective_timeout():
    timeline = WorkerTimeline(
        start_s=0.0,
        end_s=1812.0,
        outcome="failed",
        events=_steps(1, 10, start_s=2.0, step_s=1.0, data_s=0.0, comm_s=0.0),
    )
    seconds = attribute(timeline)
    assert seconds.hung == pytest.approx(1800.0)
    assert seconds.startup == pytest.approx(2.0) and seconds.productive == pytest.approx(10.0)


def test_an_attempt_that_never_stepped_is_all_start_up():
    timeline = WorkerTimeline(start_s=0.0, end_s=9.0, outcome="failed", events=(SpanEvent("evaluation", end_s=4.0),))
    assert attribute(timeline) == GoodputSeconds(startup=9.0)


def test_the_execution_record_survives_a_checkpoints_json_and_a_newer_record_replaces_its_attempts():
    record = AttemptGoodput(0, 2, 10.0, 40.0, "running", GoodputSeconds(startup=6.0, productive=50.0, idle=4.0))
    execution = ExecutionGoodput().with_attempt(record)
    restored = ExecutionGoodput.from_summary(json.loads(json.dumps(execution.summary())))
    assert restored == execution

    newer = AttemptGoodput(0, 2, 10.0, 50.0, "running", GoodputSeconds(startup=6.0, productive=70.0, idle=4.0))
    assert restored.with_attempt(newer).attempts == (newer,)
    assert ExecutionGoodput.from_summary(None) == ExecutionGoodput()
    assert ExecutionGoodput().goodput == 0.0 and ExecutionGoodput().attributed_fraction == 1.0


def test_ranks_seconds_summed_as_lists_equal_the_records_sum():
    a = GoodputSeconds(productive=3.0, hung=1.0)
    b = GoodputSeconds(productive=1.0, data_wait=2.0, idle=0.5)
    summed = [x + y for x, y in zip(a.as_list(), b.as_list())]  # what an all-reduce of as_list() gives
    assert GoodputSeconds.from_list(summed) == a + b
    assert len(a.as_list()) == len(CATEGORIES)


_event = st.one_of(
    st.tuples(
        st.just("step"),
        st.floats(0.0, 5.0),  # time since the previous event
        st.floats(0.0, 6.0),  # measured step time (may exceed the gap: clocks differ)
        st.floats(0.0, 3.0),
        st.floats(0.0, 3.0),
    ),
    st.tuples(st.sampled_from(["checkpoint", "evaluation"]), st.floats(0.0, 20.0)),
    st.tuples(st.just("backwards"), st.floats(0.0, 2.0)),  # a moment reported out of order
)


@st.composite
def _timelines(draw) -> WorkerTimeline:
    now = start = draw(st.floats(0.0, 1e6))
    events: list[StepEvent | SpanEvent] = []
    for index, event in enumerate(draw(st.lists(_event, max_size=40))):
        if event[0] == "step":
            _, gap, step_s, data_s, comm_s = event
            now += gap
            events.append(StepEvent(now, index + 1, step_s, data_s, comm_s))
        elif event[0] == "backwards":
            events.append(StepEvent(now - event[1], index + 1, 0.1, 0.0, 0.0))
        else:
            now += event[1]
            events.append(SpanEvent(event[0], now))
    end = now + draw(st.floats(0.0, 100.0))
    return WorkerTimeline(
        start_s=start,
        end_s=end,
        outcome=draw(st.sampled_from(["finished", "failed", "preempted"])),
        events=tuple(events),
        recompute_through_step=draw(st.integers(0, 20)),
        after_preemption=draw(st.booleans()),
    )


@hypothesis.settings(max_examples=200, deadline=None, database=None, derandomize=True)
@hypothesis.given(
    attempts=st.lists(st.tuples(st.lists(_timelines(), min_size=1, max_size=4), st.floats(0.0, 50.0)), max_size=3)
)
def test_the_categories_add_up_to_workers_times_wall_time_over_workers_and_attempts(attempts):
    execution = ExecutionGoodput()
    for index, (timelines, unrecorded_s) in enumerate(attempts):
        seconds = GoodputSeconds()
        for timeline in timelines:
            worker = attribute(timeline)
            assert all(value >= -1e-12 for value in worker.as_list())  # none negative, but for float rounding
            assert math.isclose(worker.total_s, timeline.end_s - timeline.start_s, rel_tol=1e-9, abs_tol=1e-6)
            seconds = seconds + worker
        # The attempt's wall: its longest worker's; the others are idle up to it, as the real ranks wait at the end.
        wall = max(t.end_s - t.start_s for t in timelines)
        seconds = seconds.plus("idle", math.fsum(wall - (t.end_s - t.start_s) for t in timelines))
        attempt = AttemptGoodput(index, len(timelines), 0.0, wall, "running", seconds)
        if index < len(attempts) - 1:
            attempt = settle_interrupted(attempt, resumed_unix=wall + unrecorded_s, preempted=index % 2 == 0)
        execution = execution.with_attempt(attempt)
    assert math.isclose(execution.attributed_fraction, 1.0, rel_tol=1e-9, abs_tol=1e-9)


def test_the_train_tasks_typed_output_carries_the_executions_goodput_through_flytes_type_engine():
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    from tasks.types import TrainGoodput

    first = AttemptGoodput(0, 2, 100.0, 130.0, "failed", GoodputSeconds(productive=40.0, recomputed=10.0, startup=10.0))
    second = AttemptGoodput(1, 2, 130.0, 150.0, "finished", GoodputSeconds(productive=30.0, startup=10.0))
    summary = ExecutionGoodput((first, second)).summary()
    typed = TrainGoodput.from_summary(summary)
    assert typed.attempts == 2 and typed.goodput == 70.0 / 100.0
    assert (typed.productive_s, typed.recomputed_s, typed.startup_s, typed.hung_s) == (70.0, 10.0, 20.0, 0.0)
    assert TrainGoodput.from_summary(None) == TrainGoodput()  # a checkpoint written before goodput was recorded
    ctx = FlyteContextManager.current_context()
    literal = TypeEngine.to_literal(ctx, typed, TrainGoodput, TypeEngine.to_literal_type(TrainGoodput))
    assert TypeEngine.to_python_value(ctx, literal, TrainGoodput) == typed


def test_a_worker_process_start_is_read_to_the_clock_tick_not_to_the_boot_times_whole_second():
    """Start-up counts from the worker process's start. psutil's ``create_time`` adds a boot time the kernel gives
    in whole seconds (here it read 0.4 s early): an attempt of a few seconds then held more worker-seconds than its
    wall time. The start read here lies between the moments before and after the process was spawned."""
    import subprocess
    import sys

    code = "from training_core.parallel.distributed import process_start_unix; print(process_start_unix())"
    before = time.time()
    started = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    after = time.time()
    assert before - 0.02 <= started <= after


def test_the_progress_record_beside_the_checkpoints_keeps_the_newest_note_and_a_bad_one_is_ignored(tmp_path, caplog):
    from training_core import checkpoint as ckpt
    from training_core.train.accounting import PROGRESS_FILE, ProgressLog, ProgressRecord

    storage = ckpt.CheckpointStorage(str(tmp_path / "run"))
    written = ProgressLog(storage)
    assert written.read() is None
    for step in range(1, 51):
        written.note(ProgressRecord(attempt_start_unix=100.5, global_step=step, step_unix=100.5 + step))
    written.note(ProgressRecord(100.5, 50, 150.5, end_unix=165.25))
    written.close()
    assert ProgressLog(storage).read() == ProgressRecord(100.5, 50, 150.5, end_unix=165.25)
    assert storage.list_steps() == [] and sorted(p.name for p in (tmp_path / "run").iterdir()) == [PROGRESS_FILE]

    # Not a record, or not a regular file (read without blocking): a warning, and the attempt is settled without it.
    (tmp_path / "run" / PROGRESS_FILE).write_text('{"global_step": "x"}')
    assert ProgressLog(storage).read() is None
    (tmp_path / "run" / PROGRESS_FILE).unlink()
    os.mkfifo(tmp_path / "run" / PROGRESS_FILE)
    assert ProgressLog(storage).read() is None
    assert [r.levelname for r in caplog.records if "progress record" in r.getMessage()] == ["WARNING", "WARNING"]
