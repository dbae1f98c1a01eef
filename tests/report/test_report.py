"""udnn-lab report: a papermill run of the report template, written as one offline HTML file."""

import datetime
import html
import platform
import re
import shlex
import sys

import pytest
import torch

import udnn_lab as ul
from udnn_lab.cli import _parser, main, registered_names
from udnn_lab.report.writing import TEMPLATE, ReportRequest
from udnn_lab.units import format_budget

pytestmark = pytest.mark.slow
LOADS_FROM_NETWORK = re.compile(r"\b(src|href)\s*=\s*[\"']?(https?:)?//", re.IGNORECASE)


def header(page: str) -> dict[str, str]:
    """The report's header table as label -> text (tags stripped, entities decoded)."""
    rows = re.findall(r"<th[^>]*>(.*?)</th>\s*<td[^>]*>(.*?)</td>", page, re.DOTALL)
    return {html.unescape(label): html.unescape(re.sub(r"<[^>]+>", "", value)) for label, value in rows}


def test_report_of_a_plan_at_a_budget(tmp_path, capfd):
    out = tmp_path / "resnet18.html"
    assert main(["report", "resnet18", "--batch", "16", "--image-size", "96", "--budget", "180MiB",
                 "--hardware", "h100-sxm", "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    err = capfd.readouterr().err  # the kernel's own output too: it writes to the terminal's file descriptors
    assert "running the report notebook" in err and "without encryption" not in err

    # header: the command, the versions, the date and the hardware profile
    top = header(page)
    command = top["reproduce with"]
    assert command.startswith("udnn-lab report resnet18 --batch 16 --image-size 96 --budget 180MiB "
                              "--hardware h100-sxm")
    request = _parser().parse_args(shlex.split(command)[1:])
    assert (request.model, request.batch, request.image_size, request.budget, request.out) == \
        ("resnet18", 16, 96, "180MiB", out)
    assert (top["udnn_lab"], top["torch"]) == (ul.__version__, torch.__version__)
    assert top["python"].startswith(platform.python_version())
    assert top["python"].endswith(sys.executable)  # the kernel ran in this interpreter
    today = {datetime.datetime.now(datetime.timezone.utc).date() - datetime.timedelta(days=d) for d in (0, 1)}
    assert datetime.datetime.fromisoformat(top["date"]).date() in today
    assert top["hardware profile"].startswith("h100-sxm: NVIDIA H100")

    # peak, breakdown, the plan and its simulation, the minimum
    graph = ul.trace(ul.zoo.get("resnet18", batch=16, image_size=96, device="meta"), device="cuda")
    assert ul.format_bytes(graph.cuda_peak_bytes) in page and "feature_map" in page
    assert "Fits:" in page and "Infeasible" not in page
    minimum = ul.min_budget(graph, "auto", hardware="h100-sxm")
    assert f"<b>{ul.format_bytes(minimum)}</b> ({minimum:,} bytes)" in page

    # charts drawn inline, nothing loaded from the network
    assert page.count("<svg") == 3
    roots = re.findall(r"<svg[^>]*>", page)
    assert all('style="width:100%;height:auto"' in root and "viewbox" in root.lower() for root in roots)  # page-wide
    copies = ("device → host",) if ul.plan(graph, "180MiB", "auto", hardware="h100-sxm").offloads else ()
    for title in ("resnet18, batch 16: every tensor kept", "memory under the plan (auto)",
                  "streams over one step (simulated)", "budget 180.00 MiB", *copies):
        assert f">{title}<" in page
    assert not LOADS_FROM_NETWORK.search(page)
    assert "<script" not in page


def test_an_infeasible_budget_is_reported_with_the_minimum(tmp_path):
    out = tmp_path / "mlp3.html"
    assert main(["report", "mlp3", "--batch", "4", "--budget", "1 MiB", "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    graph = ul.trace(ul.zoo.get("mlp3", batch=4, device="meta"), device="cuda")
    minimum = ul.min_budget(graph, "auto", hardware="h100-sxm")
    assert "Infeasible:" in page and "Fits:" not in page
    assert f"The minimum feasible budget is <b>{ul.format_bytes(minimum)}</b>" in page
    suggested = format_budget(minimum)  # a size people read, and the command line takes
    assert f"<code>--budget {suggested}</code>" in page and minimum <= ul.parse_bytes(suggested)
    assert _parser().parse_args(["report", "mlp3", "--budget", suggested]).budget == suggested
    assert "No plan" in page and page.count("<svg") == 1
    assert "--budget '1 MiB'" in header(page)["reproduce with"]  # the budget as typed, quoted for a shell


def test_a_report_of_your_own_module(tmp_path, monkeypatch):
    (tmp_path / "my_nets.py").write_text(
        "import torch\n\ndef small():\n    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),\n"
        "                               torch.nn.Linear(32, 4))\n")
    monkeypatch.chdir(tmp_path)  # the kernel starts here, and finds my_nets as the command line does
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "mine.html"
    assert main(["report", "my_nets:small", "--input-shape", "16", "--batch", "4", "--budget", "1MiB",
                 "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert "Memory report: Sequential, batch 4" in page
    assert "--input-shape 16" in header(page)["reproduce with"]


def test_a_snapshot_of_a_real_run_is_laid_over_the_prediction(tmp_path):
    work = ul.zoo.get("mlp3", batch=4)
    snapshot = ul.write_cpu_snapshot(tmp_path / "mlp3.pickle.gz", work)
    out = tmp_path / "mlp3.html"
    assert main(["report", "mlp3", "--batch", "4", "--budget", "1GiB", "--hardware", "cpu-amd-epyc-2cpu",
                 "--snapshot", str(snapshot), "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert f"--snapshot {snapshot}" in header(page)["reproduce with"]
    assert "A real run&#x27;s memory snapshot" in page or "A real run's memory snapshot" in page
    assert f">{snapshot} over the prediction<" in page and page.count("<svg") == 4
    graph = ul.trace(ul.zoo.get("mlp3", batch=4, device="meta"), device="cpu")
    assert f"peak predicted {ul.format_bytes(graph.peak_bytes)}, measured {ul.format_bytes(graph.peak_bytes)}" in page
    assert "size_bytes" in page and "same count" in page  # the differences table: the same storages on both sides
    assert not LOADS_FROM_NETWORK.search(page)


def test_the_template_ships_inside_the_package_with_a_parameters_cell():
    import nbformat

    notebook = nbformat.read(TEMPLATE, as_version=4)
    tagged = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1
    assert all(f"{name} =" in tagged[0].source for name in ("model", "budget", "hardware", "command"))


@pytest.mark.parametrize("change, message", [
    ({"model": "resnet-9000x"}, "unknown model"),
    ({"hardware": "h9000"}, "unknown hardware"),
    ({"budget": "6 gigs"}, "cannot read the budget '6 gigs'"),
    ({"budget": "0"}, "more than 0 bytes"),
    ({"policy": "fastest"}, "unknown policy 'fastest'"),
    ({"model": "mlp3", "image_size": 32}, "not images"),
    ({"model": "hf:gpt2", "image_size": 32}, "leave out the image size"),
    ({"optimizer": "lion"}, "unknown optimizer 'lion'; use one of default,"),
    ({"model": "hf:gpt-9000"}, "unknown Hugging Face model 'hf:gpt-9000'"),
    ({"batch": 0}, "the batch size must be a whole number of at least 1, got 0"),
    ({"snapshot": "no/such/run.pickle"}, "no snapshot at no/such/run.pickle"),
])
def test_a_bad_request_is_refused_before_any_kernel_starts(change, message):
    fields = {"model": "resnet18", "budget": "6GiB", **change}
    with pytest.raises(ValueError, match=re.escape(message)):
        ReportRequest(**fields).check_names()


@pytest.mark.parametrize("model, by_construction", [
    ("resnet18", True), ("ResNet-18", True), ("densenet121", True),
    ("hf:gpt2", False), ("resnet164", False), ("mlp5", False), ("my_nets:small", False),
])
def test_only_the_zoos_fixed_models_skip_the_build_before_the_notebook(model, by_construction):
    """A fixed model builds in the kernel alone (building it here too would load torchvision twice); a family
    member's size, an hf: model's config and your own factory are checked by building them first."""
    assert ReportRequest(model, "6GiB").builds_by_construction is by_construction


def test_a_request_for_a_hugging_face_model_or_the_default_optimizer_passes_its_checks():
    ReportRequest("hf:gpt2", "6GiB").check()
    ReportRequest("resnet18", "6GiB", optimizer="default").check()


def test_the_hf_options_reach_the_command_and_read_back():
    request = ReportRequest("hf:llama-3-8b", "80GiB", batch=1, seq_len=4096, attn_implementation="sdpa",
                            lora_rank=16)
    request.check_names()
    words = shlex.split(request.command("llama.html"))
    assert words[words.index("--seq-len") + 1] == "4096" and words[words.index("--lora-rank") + 1] == "16"
    parsed = _parser(registered_names()).parse_args(words[1:])
    assert (parsed.seq_len, parsed.attn_implementation, parsed.lora_rank) == (4096, "sdpa", 16)
    assert "--seq-len" not in ReportRequest("hf:gpt2", "6GiB").command("gpt2.html")


@pytest.mark.parametrize("change, message", [
    ({"model": "resnet18", "lora_rank": 8}, "lora_rank: for Hugging Face models (hf:<name>) only, not resnet18"),
    ({"attn_implementation": "flash"}, "unknown attention 'flash'; use one of sdpa, eager"),
    ({"lora_rank": 0}, "lora_rank must be a positive int, got 0"),
    ({"seq_len": -4}, "seq_len must be a positive int, got -4"),
])
def test_bad_hf_options_are_refused_before_any_kernel_starts(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ReportRequest(**{"model": "hf:gpt2", "budget": "6GiB", **change}).check_names()


def test_a_report_of_a_hugging_face_step_in_todays_precision(tmp_path):
    """Precision, accumulation, clipping, sequence length, attention and LoRA rank reach the traced step and the
    page says them; the peak is that of the step with two micro-batches, not one."""
    out = tmp_path / "gpt2.html"
    assert main(["report", "hf:gpt2", "--batch", "1", "--seq-len", "32", "--lora-rank", "4",
                 "--attn-implementation", "eager", "--precision", "bf16-mixed", "--grad-accumulation", "2",
                 "--clip-grad-norm", "1.0", "--budget", "1GiB", "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    work = ul.zoo.get("hf:gpt2", batch=1, seq_len=32, lora_rank=4, attn_implementation="eager",
                      precision="bf16-mixed", device="meta")
    accumulated = ul.trace(work, device="cuda", grad_accumulation=2, clip_grad_norm=1.0)
    single = ul.trace(work, device="cuda")
    assert accumulated.cuda_peak_bytes != single.cuda_peak_bytes

    assert "Memory report: hf:gpt2 (eager attention, LoRA r=4), batch 1, 32 tokens, bf16-mixed, 2 micro-batches" \
        in html.unescape(page)
    top = header(page)
    assert top["precision"] == "bf16-mixed: float32 weights, forward and loss under autocast in bfloat16"
    assert top["step"] == (f"optimizer AdamW, 2 micro-batches of 1 per optimizer step, gradients clipped to total "
                           f"norm 1, traced for cuda ({len(accumulated.ops)} ops)")
    parsed = _parser(registered_names()).parse_args(shlex.split(top["reproduce with"])[1:])
    assert (parsed.precision, parsed.grad_accumulation, parsed.clip_grad_norm) == ("bf16-mixed", 2, 1.0)
    assert (parsed.seq_len, parsed.lora_rank, parsed.attn_implementation) == (32, 4, "eager")

    assert f"{ul.format_bytes(accumulated.cuda_peak_bytes)} ({accumulated.cuda_peak_bytes:,} bytes)" in page
    assert f"({single.cuda_peak_bytes:,} bytes)" not in page
    assert accumulated.breakdown().loc["weight_cast", "bytes_at_peak"] > 0
    assert re.search(r">\s*weight_cast\s*<", page)  # the breakdown's row
    assert "Fits:" in page and "one optimizer step (2 micro-batches) takes" in page


def test_the_step_options_reach_the_command_and_read_back():
    request = ReportRequest("resnet18", "6GiB", precision="16-mixed", grad_accumulation=4, clip_grad_norm=0.5)
    request.check_names()
    parsed = _parser(registered_names()).parse_args(shlex.split(request.command("r.html"))[1:])
    assert (parsed.precision, parsed.grad_accumulation, parsed.clip_grad_norm) == ("16-mixed", 4, 0.5)
    plain = ReportRequest("resnet18", "6GiB").command("r.html")
    assert not {"--precision", "--grad-accumulation", "--clip-grad-norm"} & set(shlex.split(plain))


@pytest.mark.parametrize("change, message", [
    ({"precision": "fp8"}, "unknown precision 'fp8': use one of 32-true, bf16-mixed"),
    ({"grad_accumulation": 0}, "grad_accumulation counts micro-batches per optimizer step: a positive int, got 0"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm is the largest total gradient norm allowed: a positive number"),
    ({"dtype": "bfloat16", "precision": "bf16-mixed"},
     "dtype bfloat16 means precision bf16-true, but precision bf16-mixed was asked for"),
])
def test_bad_step_options_are_refused_before_any_kernel_starts(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ReportRequest(**{"model": "resnet18", "budget": "6GiB", **change}).check_names()


def test_a_precision_that_agrees_with_the_dtype_passes():
    ReportRequest("resnet18", "6GiB", dtype="bfloat16", precision="bf16-true").check_names()


def test_without_hardware_the_report_is_for_this_machine_s_profile_and_its_command_names_none():
    request = ReportRequest("mlp3", "1GiB")
    assert request.hardware is None
    request.check_names()  # no profile to load by name: the notebook finds this machine's
    assert "--hardware" not in request.command("r.html")
    assert "--hardware a100" in ReportRequest("mlp3", "1GiB", hardware="a100").command("r.html")
