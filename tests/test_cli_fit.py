"""The max-batch and max-seq-len commands of cli.py (beside test_cli.py, which covers the others)."""

import re

import pytest

import udnn_lab as ul
from udnn_lab.cli import main


def _peak(batch: int) -> int:
    return ul.trace(ul.zoo.get("mlp3", batch=batch, optimizer="adam", device="meta"), device="cuda").cuda_peak_bytes


def test_max_batch_prints_every_probe_and_the_answer(capsys):
    assert main(["max-batch", "mlp3", "--budget", "40MiB", "--optimizer", "adam", "--multiple-of", "8",
                 "--hardware", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"largest batch size: (\d+) \(mlp3, 40.00 MiB, keep-all on h100-sxm\); batch (\d+) needs", out)
    assert found, out
    size, failed = int(found.group(1)), int(found.group(2))
    assert failed == size + 8 and _peak(size) <= ul.parse_bytes("40MiB") < _peak(failed)
    rows = [line.split() for line in out.splitlines() if line.strip().endswith(("yes", "no"))]
    assert [row[0] for row in rows if row[-1] == "yes"][-1] == str(size)
    assert f"{len(rows)} probes" in out
    assert "hardware profile: h100-sxm (NVIDIA H100" in out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["batch"])
    assert header.split() == ["batch", "peak", "fits"]  # keep-all: the plan's peak is the traced one, shown once
    assert all(len(row) == 4 for row in rows)  # size, one peak (number and unit), fits


def test_under_a_policy_max_batch_shows_the_plan_s_peak_beside_the_one_with_everything_kept(capsys):
    assert main(["max-batch", "mlp3", "--budget", "40MiB", "--policy", "vdnn-all", "--multiple-of", "8", "--limit",
                 "16", "--hardware", "h100-sxm", "--host-budget", "none"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["batch"])
    assert "peak (plan)" in header and "peak (all kept)" in header
    rows = [line.split() for line in out.splitlines() if line.strip().endswith(("yes", "no"))]
    assert rows and all(len(row) == 6 for row in rows)  # size, two peaks of two words each, fits


def test_without_hardware_the_fit_commands_use_this_machine_s_profile_and_say_which(monkeypatch, capsys):
    import udnn_lab.simulation.simulator as simulator

    asked = []

    def this_machine(hardware, device):
        asked.append((hardware, device))
        return ul.Hardware.load("a100")

    monkeypatch.setattr(simulator, "resolve_hardware", this_machine)
    assert main(["max-batch", "mlp3", "--budget", "40MiB", "--limit", "8", "--start", "8"]) == 0
    out = capsys.readouterr().out
    assert asked == [(None, "cuda")]
    assert "hardware profile: a100 (" in out and "keep-all on a100)" in out


def test_a_negative_budget_is_read_as_one_and_refused_as_one(capsys):
    assert main(["max-batch", "mlp3", "--budget", "-1GB", "--hardware", "h100-sxm"]) == 1
    err = capsys.readouterr().err
    assert "a budget cannot be negative" in err and "expected one argument" not in err


def test_max_seq_len_stops_at_its_limit(capsys):
    pytest.importorskip("transformers")
    assert main(["max-seq-len", "hf:gpt2", "--budget", "80GiB", "--start", "32", "--limit", "32"]) == 0
    out = capsys.readouterr().out
    assert "largest sequence length: 32 (hf:gpt2" in out and "80.00 GiB" in out


def test_fit_commands_say_what_was_wrong(capsys):
    assert main(["max-batch", "mlp3", "--budget", "1MiB"]) == 1
    assert "weights of mlp3 alone take 7.11 MiB" in capsys.readouterr().err
    assert main(["max-batch", "mlp3", "--budget", "0"]) == 1
    assert "more than 0 bytes" in capsys.readouterr().err
    assert main(["max-seq-len", "resnet18", "--budget", "1GiB"]) == 1
    assert "'hf:' text models" in capsys.readouterr().err
    assert main(["max-batch", "my_models:small", "--budget", "1GiB"]) == 1
    assert "--input-shape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["max-batch", "mlp3", "--policy", "fastest"])
    assert "invalid choice" in capsys.readouterr().err


def test_max_batch_answers_in_reserved_bytes_when_asked(capsys):
    common = ["max-batch", "mlp3", "--budget", "120MiB", "--hardware", "h100-sxm"]
    assert main(common) == 0
    allocated = int(re.search(r"largest batch size: (\d+)", capsys.readouterr().out).group(1))
    assert main([*common, "--counts", "reserved", "--outside", "8MiB"]) == 0
    out = capsys.readouterr().out
    reserved = int(re.search(r"largest batch size: (\d+)", out).group(1))
    assert 0 < reserved < allocated and "note: peaks counted as reserved bytes" in out and "8.00 MiB outside" in out
