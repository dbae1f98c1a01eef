"""The runtime's host probe (NOTE [host probes]): its figures are measured with the runtime's own code."""

import subprocess
import sys

import pytest
import torch

from udnn_lab.errors import UnmeasuredFigureWarning
from udnn_lab.hardware import Hardware
from udnn_lab.hardware import host_probes as host_probes_module
from udnn_lab.hardware.host_probes import HostFigures, ProbedStep, host_probes, step_probes
from udnn_lab.runtime._host_probe import runtime_host_figures, solve_nonnegative
from udnn_lab.runtime._step_probes import step_hook_figures, step_replay_figures
from udnn_lab.zoo import get as zoo_get


def test_the_probe_is_registered_when_the_runtime_is_imported():
    assert runtime_host_figures in host_probes()
    probes = step_probes()
    # the stand-in after the probe that supersedes it (NOTE [host probes] 4)
    assert probes.index(step_hook_figures) < probes.index(step_replay_figures)


def test_the_step_probe_measures_a_replay_on_the_steps_own_forward():
    torch.set_num_threads(1)
    work = zoo_get("mlp3", batch=4)
    step = ProbedStep(lambda: work.model(work.example_input), lambda: None, None, torch.device("cpu"), 0.01)
    measured = step_replay_figures(step, 2, {})
    assert set(measured.figures) == {"replay_op_s"} and 0 < measured.figures["replay_op_s"] < 1e-2
    assert "this step's" in measured.source


def test_the_stand_in_replay_does_not_run_where_the_runtime_measured_the_replay(monkeypatch):
    import udnn_lab as ul
    from udnn_lab.runtime import _step_probes

    def unexpected(*args, **kwargs):
        raise AssertionError("the stand-in recording ran")

    monkeypatch.setattr(_step_probes, "replay_op_s_on", unexpected)
    step = ProbedStep(lambda: None, lambda: None, None, torch.device("cpu"), 0.01)
    assert step_replay_figures(step, 2, {"replay_op_s": 2e-5}).figures == {}
    seen = []

    def runtime_replay(step, repeats, measured):
        return HostFigures({"replay_op_s": 2e-5}, "the runtime")

    def stand_in(step, repeats, measured):
        seen.append(dict(measured))
        return step_replay_figures(step, repeats, measured)

    monkeypatch.setattr(host_probes_module, "_STEP_PROBES", {"hooks": runtime_replay, "stand-in": stand_in})
    profile = ul.profile(zoo_get("mlp3", batch=4), repeats=1)
    assert seen == [{"replay_op_s": 2e-5}] and profile.replay_op_s == 2e-5


def test_a_step_probe_that_fails_leaves_the_profiles_figure_unmeasured_and_says_why(monkeypatch):
    import udnn_lab as ul

    def broken(step, repeats, measured):
        raise RuntimeError("a view of another dtype")

    monkeypatch.setattr(host_probes_module, "_STEP_PROBES", {"broken": broken})
    with pytest.warns(UnmeasuredFigureWarning, match="a view of another dtype"):
        profile = ul.profile(zoo_get("mlp3", batch=4), repeats=1)
    assert profile.replay_op_s is None and profile.dispatch_mode_op_s is not None


@pytest.mark.compat
@pytest.mark.timing
def test_the_probe_measures_hook_calls_offloads_and_replays_on_this_cpu():
    torch.set_num_threads(1)
    measured = runtime_host_figures(torch.device("cpu"), 1, {})
    assert set(measured.figures) == {"hook_call_s", "offload_action_s", "replay_op_s"}
    assert all(0 <= seconds < 1e-2 for seconds in measured.figures.values()), measured.figures
    assert measured.figures["hook_call_s"] > 0 and measured.figures["replay_op_s"] > 0  # Python calls: never free
    assert "hook calls" in measured.source and "forward ops" in measured.source


def test_two_unknowns_are_solved_and_never_negative():
    """Per hook call and per offload, from two plans; noise that would make one negative leaves it 0."""
    assert solve_nonnegative([(100, 1), (200, 40)], [100 * 5e-6 + 30e-6, 200 * 5e-6 + 40 * 30e-6]) == \
        pytest.approx((5e-6, 30e-6), rel=1e-9)
    a, b = solve_nonnegative([(100, 1), (200, 40)], [1e-3, 1.1e-3])  # more offloads, hardly more time: noise
    assert a >= 0 and b >= 0 and (a, b) != (0.0, 0.0)
    assert solve_nonnegative([(100, 1), (200, 2)], [1e-3, 2e-3]) is None  # calls in proportion to offloads


def test_the_package_registers_the_probe_with_the_hardware_it_hands_out():
    """NOTE [host probes] 2: ``ul.Hardware.measure`` in a fresh process finds the runtime's probe."""
    code = ("import udnn_lab as ul; ul.Hardware; from udnn_lab.hardware.host_probes import host_probes; "
            "print(len(host_probes()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "1"


def test_a_probe_that_fails_leaves_its_figures_unmeasured_and_says_why(monkeypatch):
    def broken(device, repeats, measured):
        raise RuntimeError("no hook points here")

    monkeypatch.setattr(host_probes_module, "_PROBES", {"broken": broken})
    with pytest.warns(UnmeasuredFigureWarning, match="no hook points here"):
        profile = Hardware.measure("cpu", sizes=(4096,), repeats=1, matmul_size=32, conv_size=8, progress=False)
    assert profile.hook_call_s is None and profile.dispatch_mode_op_s is not None


def test_the_step_probe_keeps_to_its_time_once_it_has_three_rounds():
    from udnn_lab.runtime._host_probe import replay_op_s_on

    calls = []
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)

    def forward():
        calls.append(1)
        return layer(x).relu()

    _, ops = replay_op_s_on(forward, torch.device("cpu"), rounds=50, limit_s=0.0)
    assert ops == 3  # t, addmm, relu
    assert len(calls) == 3 * (2 + 3)  # two warm-up rounds, three measured: recorded, passed through, plain
