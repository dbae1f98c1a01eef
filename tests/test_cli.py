import json

import pandas as pd
import pytest

from udnn_lab.cli import main


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
    assert "checking" in err and f"udnn-lab: error: {message}" in err
    assert not out.exists()


def test_report_needs_a_budget(capsys):
    with pytest.raises(SystemExit):
        main(["report", "resnet18"])
    assert "--budget" in capsys.readouterr().err
