"""The streams of a step (`autosp.timing.Timeline`): hand-built programs whose times are derivable by hand."""
from __future__ import annotations

import pytest

from autosp.timing import StepTime, Timeline


def test_a_copy_hidden_behind_the_compute_between_it_and_its_reader_costs_nothing():
    t = Timeline(streams=True)
    t.run("matmul", 1.0, writes={"x"})            # 0 -> 1
    t.run("copy", 0.5, reads={"x"}, writes={"h"})  # 1 -> 1.5 on the copy stream
    t.run("matmul", 2.0)                           # 1 -> 3
    t.run("memory", 0.25, reads={"h"})             # 3 -> 3.25: h ready since 1.5
    time = t.finish()
    assert time.iteration_s == pytest.approx(3.25)
    assert time.exposed_copy_s == 0.0
    assert time.by_class == {"matmul": 3.0, "copy": 0.5, "memory": 0.25}


def test_a_copy_longer_than_the_compute_it_overlaps_is_exposed_by_the_readers_wait():
    t = Timeline(streams=True)
    t.run("matmul", 1.0, writes={"x"})            # 0 -> 1
    t.run("copy", 3.0, reads={"x"}, writes={"h"})  # 1 -> 4
    t.run("matmul", 1.0)                           # 1 -> 2
    t.run("matmul", 1.0, reads={"h"})              # waits 2 s: 4 -> 5
    time = t.finish()
    assert time.iteration_s == pytest.approx(5.0)
    assert time.exposed_copy_s == pytest.approx(2.0)
    assert time.exposed_collective_s == 0.0


def test_side_streams_running_past_compute_are_exposed_once():
    t = Timeline(streams=True)
    t.run("matmul", 1.0, writes={"g"})
    t.run("collective", 2.0, reads={"g"})  # 1 -> 3
    t.run("copy", 3.0, reads={"g"})        # 1 -> 4
    time = t.finish()
    assert time.iteration_s == pytest.approx(4.0)
    assert time.exposed_collective_s == pytest.approx(2.0)  # 1 -> 3
    assert time.exposed_copy_s == pytest.approx(1.0)        # 3 -> 4: the tail beyond the collective's


def test_a_collective_read_at_once_is_exposed_whole_and_a_stream_runs_in_order():
    t = Timeline(streams=True)
    t.run("collective", 1.0, writes={"a"})  # 0 -> 1
    t.run("collective", 1.0, writes={"b"})  # 1 -> 2: the comm stream is in order
    t.run("attention", 1.0, reads={"b"})    # 2 -> 3
    time = t.finish()
    assert time.iteration_s == pytest.approx(3.0)
    assert time.exposed_collective_s == pytest.approx(2.0)


def test_on_one_cpu_thread_every_copy_and_collective_runs_in_line():
    t = Timeline(streams=False)
    t.run("matmul", 1.0, writes={"x"}, flops=10.0)
    t.run("copy", 0.5, reads={"x"}, writes={"h"})
    t.run("collective", 0.25)
    t.run("matmul", 2.0, flops=20.0)
    time = t.finish()
    assert time.iteration_s == pytest.approx(3.75)
    assert (time.exposed_copy_s, time.exposed_collective_s) == (0.5, 0.25)
    assert time.executed_flops == 30.0


def test_a_step_at_depth_is_the_line_through_two_depths_one_layer_apart():
    two = StepTime(iteration_s=3.0, exposed_copy_s=0.5, executed_flops=100.0, by_class={"matmul": 2.0})
    three = StepTime(iteration_s=4.0, exposed_copy_s=0.75, executed_flops=150.0, by_class={"matmul": 2.5})
    at_ten = two.line(three, 7)
    assert (at_ten.iteration_s, at_ten.exposed_copy_s, at_ten.executed_flops) == (11.0, 2.5, 500.0)
    assert at_ten.by_class == {"matmul": 6.0}
