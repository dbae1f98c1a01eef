import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from udnn_lab.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _run_command(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "udnn_lab.cli", *words], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


def test_analyze_prints_breakdown_and_peak_and_writes_the_curve(tmp_path, capsys):
    out = tmp_path / "curve"
    assert main(["analyze", "resnet18", "--batch", "2", "--image-size", "32", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "feature_map" in text and "peak" in text and "CUDA caching allocator" in text
    curve = pd.read_csv(out.with_suffix(".csv"))
    document = json.loads(out.with_suffix(".json").read_text())
    assert len(curve) == len(document["curve"]) > 100
    assert document["peak_bytes"] == curve["live_bytes"].max()
    assert document["breakdown"]["total"]["bytes_at_peak"] == document["peak_bytes"]
    assert document["optimizer"] == "SGD"  # the zoo's own for a CNN


def test_the_default_optimizer_is_the_zoo_s_own(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "gpt2"
    assert main(["analyze", "hf:gpt2", "--batch", "1", "--out", str(out)]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["optimizer"] == "AdamW"


def test_analyze_takes_the_step_options(tmp_path, capsys):
    out = tmp_path / "mixed"
    assert main(["analyze", "mlp2", "--batch", "2", "--precision", "16-mixed", "--grad-accumulation", "2",
                 "--clip-grad-norm", "1.0", "--optimizer", "adamw-fused", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "weight_cast" in captured.out
    assert "2 micro-batches, precision 16-mixed, optimizer AdamW, clip grad norm 1" in captured.err
    document = json.loads(out.with_suffix(".json").read_text())
    assert (document["precision"], document["grad_accumulation"], document["clip_grad_norm"]) == ("16-mixed", 2, 1.0)
    assert document["breakdown"]["weight_cast"]["max_bytes"] > 0
    assert main(["analyze", "mlp2", "--dtype", "bfloat16", "--precision", "bf16-mixed"]) == 1
    assert "give one of them" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["analyze", "mlp2", "--grad-accumulation", "0"])
    assert "expected a positive whole number" in capsys.readouterr().err


def test_analyze_takes_your_own_module(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(
        "import torch\n\ndef small():\n    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["analyze", "my_models:small", "--batch", "2", "--input-shape", "4"]) == 0
    assert "Sequential" in capsys.readouterr().out
    assert main(["analyze", "my_models:small", "--batch", "2"]) == 1
    assert "--input-shape" in capsys.readouterr().err
    assert main(["analyze", "torch.nn:Identity", "--batch", "2", "--input-shape", "4"]) == 1
    assert "nothing to train" in capsys.readouterr().err


def test_analyze_can_measure_here(capsys):
    assert main(["analyze", "mlp2", "--batch", "2", "--optimizer", "adam", "--measure"]) == 0
    assert "measured peak" in capsys.readouterr().out


def test_unknown_model_is_an_error_listing_the_zoo(capsys):
    assert main(["analyze", "resnet-9000x"]) == 1
    err = capsys.readouterr().err
    assert "unknown model" in err and "densenet201" in err


def test_zoo_lists_models(capsys):
    assert main(["zoo"]) == 0
    assert "resnet<depth>" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2


@pytest.mark.parametrize("argv, message", [
    (["report", "resnet-9000x", "--budget", "6GiB"], "unknown model 'resnet-9000x'"),
    (["report", "resnet18", "--budget", "6GiB", "--hardware", "h9000"], "unknown hardware 'h9000'"),
    (["report", "resnet18", "--budget", "lots"], "cannot read the budget 'lots'"),
])
def test_report_refuses_a_bad_request_and_writes_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main([*argv, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"udnn-lab: error: {message}" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_report_takes_a_factory_but_needs_its_input_shape(tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", "torch.nn:Identity", "--budget", "1GiB", "--out", str(out)]) == 1
    assert "give its input shape" in capsys.readouterr().err and not out.exists()


def test_report_needs_a_budget(capsys):
    with pytest.raises(SystemExit):
        main(["report", "resnet18"])
    assert "--budget" in capsys.readouterr().err


def test_help_answers_at_once_without_loading_torch():
    code = "import sys, udnn_lab.cli; assert 'torch' not in sys.modules, 'udnn_lab.cli imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    start = time.perf_counter()
    answer = _run_command("--help")
    elapsed = time.perf_counter() - start
    assert answer.returncode == 0 and "analyze" in answer.stdout and "report" in answer.stdout
    assert elapsed < 1.5, f"udnn-lab --help took {elapsed:.2f} s"  # about 0.2 s; generous for a loaded machine


def test_the_command_exits_with_its_code():
    assert _run_command("zoo").returncode == 0
    assert _run_command().returncode == 2  # no command: the help
    failed = _run_command("analyze", "resnet-9000x")
    assert failed.returncode == 1 and "unknown model 'resnet-9000x'" in failed.stderr


def test_the_options_list_the_names_they_accept(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for names in ("{default,sgd,adam,adamw,adamw-foreach,adamw-fused,adafactor,none}", "{float32,float16,bfloat16}",
                  "vdnn++", "pin-dp", "h100-sxm", "a100"):
        assert names in text
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{32-true,bf16-mixed,16-mixed,bf16-true,16-true,64-true}" in text
    assert "--grad-accumulation N" in text and "--clip-grad-norm MAX_NORM" in text
    with pytest.raises(SystemExit):
        main(["report", "resnet18", "--budget", "1GiB", "--policy", "fastest"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["3x32x32", "3,32,32", "3 x 32 x 32"])
def test_an_input_shape_reads_with_x_or_commas(shape, tmp_path, monkeypatch, capsys):
    (tmp_path / "conv_models.py").write_text(
        "import torch\n\ndef conv():\n    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["analyze", "conv_models:conv", "--batch", "2", "--input-shape", shape]) == 0
    assert "Sequential" in capsys.readouterr().out


def test_a_shape_that_is_not_one_says_how_to_write_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["analyze", "mlp2", "--input-shape", "3by32"])
    assert exit_.value.code == 2
    assert "cannot read '3by32' as a shape" in capsys.readouterr().err


def test_a_failing_factory_is_one_line_naming_it_and_the_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_models.py").write_text(
        "def broken():\n    raise RuntimeError('weights file missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["analyze", "broken_models:broken", "--input-shape", "4"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "udnn-lab: error: the model factory broken_models:broken raised RuntimeError: weights file missing "
        "(--debug shows the traceback)"]
    for debug in (["analyze", "broken_models:broken", "--input-shape", "4", "--debug"],
                  ["--debug", "analyze", "broken_models:broken", "--input-shape", "4"]):
        assert main(debug) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "in broken" in err
    assert main(["analyze", "no_such_module:build", "--input-shape", "4"]) == 2
    assert "cannot load the model factory no_such_module:build" in capsys.readouterr().err


def test_analyze_takes_the_sequence_length_attention_and_lora_rank_of_an_hf_model(tmp_path, capsys):
    pytest.importorskip("peft")
    out = tmp_path / "gpt2"
    assert main(["analyze", "hf:gpt2", "--batch", "1", "--seq-len", "64", "--attn-implementation", "eager",
                 "--lora-rank", "4", "--out", str(out)]) == 0
    document = json.loads(out.with_suffix(".json").read_text())
    assert document["model"] == "hf:gpt2 (eager attention, LoRA r=4)"
    assert (document["seq_len"], document["attn_implementation"], document["lora_rank"]) == (64, "eager", 4)
    # rank 4 on GPT-2's 12 c_attn projections (768 -> 2304): the only gradients, in float32
    assert document["breakdown"]["parameter_gradient"]["max_bytes"] == 4 * 12 * 4 * (768 + 2304)


def test_the_hf_options_list_their_choices_and_refuse_other_models(capsys):
    for command in ("analyze", "report"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--attn-implementation {sdpa,eager}" in text and "--lora-rank" in text and "--seq-len" in text
    with pytest.raises(SystemExit):
        main(["analyze", "hf:gpt2", "--attn-implementation", "flash"])
    assert "invalid choice: 'flash'" in capsys.readouterr().err
    assert main(["analyze", "resnet18", "--lora-rank", "8"]) == 1
    assert "lora_rank is for Hugging Face models" in capsys.readouterr().err


def test_train_runs_over_ranks_under_a_plan_and_prints_every_rank_s_peak(capsys):
    assert main(["train", "mlp3", "--batch", "8", "--steps", "2", "--parallel", "ddp", "--world-size", "2",
                 "--policy", "vdnn-all", "--hardware", "cpu-amd-epyc-2cpu"]) == 0
    captured = capsys.readouterr()
    assert "ddp over 2 ranks, plan vdnn-all" in captured.err
    assert "hardware profile: cpu-amd-epyc-2cpu (" in captured.err
    assert [line.split(":")[0] for line in captured.err.splitlines() if line.startswith("step ")] == ["step 0",
                                                                                                     "step 1"]
    table = captured.out.splitlines()
    assert table[0].split() == ["step", "loss", "time", "offloaded", "peak", "rank", "0", "peak", "rank", "1"]
    assert [line.split()[0] for line in table[1:3]] == ["0", "1"] and table[3] == ""
    assert "2 steps, policy=vdnn-all" in captured.out and "DDP over 2 ranks" in captured.out


def test_train_refuses_a_batch_that_does_not_split_over_the_ranks(capsys):
    assert main(["train", "mlp3", "--batch", "7", "--parallel", "fsdp", "--world-size", "2"]) == 1
    assert "--batch 7 does not split over --world-size 2" in capsys.readouterr().err


@pytest.mark.parametrize("error", [MemoryError("the step needs 90 GiB"), RuntimeError("CUDA out of memory.\nmore"),
                                   ValueError("bad input")])
def test_any_error_is_one_line_and_the_traceback_comes_with_debug(error, monkeypatch, capsys):
    import udnn_lab.cli as cli

    def failing(args):
        raise error

    monkeypatch.setattr(cli, "_zoo", failing)
    assert main(["zoo"]) == 1
    err = capsys.readouterr().err
    first, *more = str(error).splitlines()
    assert err.strip().splitlines() == [f"udnn-lab: error: {first} (--debug shows "
                                        f"{'more' if more else 'the traceback'})"]
    assert main(["zoo", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().endswith(str(error).splitlines()[-1])


@pytest.mark.parametrize("argv", [["train", "mlp3", "--budget", "-1GB", "--hardware", "cpu-amd-epyc-2cpu"],
                                  ["report", "mlp3", "--budget", "-1GB", "--hardware", "h100-sxm"],
                                  ["max-seq-len", "hf:gpt2", "--budget", "-1GB", "--hardware", "h100-sxm"],
                                  ["max-batch", "mlp3", "--budget", "1GiB", "--policy", "vdnn-all", "--limit", "8",
                                   "--host-budget", "-2GB", "--hardware", "h100-sxm"]])
def test_a_size_option_takes_a_negative_value_and_says_what_is_wrong_with_it(argv, tmp_path, capsys):
    assert main([*argv, *(["--out", str(tmp_path / "r.html")] if argv[0] == "report" else [])]) == 1
    err = capsys.readouterr().err
    assert "a budget cannot be negative" in err and "expected one argument" not in err
    assert [line for line in err.splitlines() if line.startswith("udnn-lab: error:")] == err.strip().splitlines()[-1:]


def test_the_hardware_options_default_to_this_machine_s_profile():
    from udnn_lab.cli import _parser

    parser = _parser()
    for argv in (["report", "mlp3", "--budget", "1GiB"], ["train", "mlp3"], ["max-batch", "mlp3"],
                 ["max-seq-len", "hf:gpt2"]):
        assert parser.parse_args(argv).hardware is None, argv


def test_report_without_hardware_plans_on_this_machine_s_profile_and_says_which(monkeypatch, tmp_path, capsys):
    import udnn_lab.cli as cli
    import udnn_lab.simulation.simulator as simulator
    from udnn_lab.hardware import Hardware

    asked, written = [], []
    monkeypatch.setattr(simulator, "resolve_hardware", lambda hardware, device: asked.append((hardware, device))
                        or Hardware.load("a100"))
    monkeypatch.setattr("udnn_lab.report.write_report", lambda request, out, **kwargs: written.append(request))
    assert cli.main(["report", "mlp3", "--budget", "1GiB", "--out", str(tmp_path / "r.html")]) == 0
    assert asked == [(None, "cuda")] and written[0].hardware == "a100"
    assert "hardware profile: a100 (" in capsys.readouterr().out
