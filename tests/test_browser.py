"""A real browser: JupyterLab on 127.0.0.1, driven by Playwright with the system's chromium.

It opens a copy of the quickstart, runs every cell from the Run menu, moves MemoryLab's
budget slider from the keyboard and checks that the memory chart was drawn again; clicks
the memory curve and reads the table of the tensors live at the op clicked; drags across ops
on the curve and sees the stream bars of the other ops fade, and across time on the streams
and sees the ops that start then marked on the curve; then types a
budget no plan meets and checks the message is whole on screen, measures a real step and
reads both lines in the legend, lays a real run's memory snapshot over the prediction (and refuses
one that would run code, in one line), trains two steps and checks that another network clears
the training view. It checks that the line saying whether the plan fits sits right under the
budget's box and slider, that the live-tensor table's module names are whole, and that the app
comes back in a new page opened while the kernel runs. Outside CI the test skips when chromium
or playwright is missing; with CI set it fails instead (``make test`` installs both on Debian).
"""

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

QUICKSTART = Path(__file__).resolve().parent.parent / "notebooks" / "00_quickstart.ipynb"
SETTINGS = {
    # windowing off: every cell stays in the page, so outputs below the fold can be found and read
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}

DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never through a proxy


def missing(what: str, how: str):
    message = f"{what} is missing: {how}"
    if os.environ.get("CI"):
        pytest.fail(f"{message}. In CI this test must run: make test installs it (see the Makefile)")
    pytest.skip(message)


@pytest.fixture
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        missing("chromium", "apt-get install chromium (or run make test)")
    return path


@pytest.fixture
def playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright", "pip install -e '.[dev]'")
    with sync_playwright() as driver:
        yield driver


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a copy of the quickstart on a free port of 127.0.0.1: yields (url, token)."""
    root, home = tmp_path / "notebooks", tmp_path / "jupyter"
    root.mkdir()
    shutil.copy(QUICKSTART, root)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces")}
    for name, values in SETTINGS.items():
        path = home / "settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    token = secrets.token_hex(16)
    log = tmp_path / "jupyterlab.log"
    with log.open("w") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", "--port=0", "--allow-root",
             f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}"],
            stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = wait_until_serving(server, home / "runtime", token, log)
        yield url, token
    finally:
        stop(server)


def wait_until_serving(server: subprocess.Popen, runtime: Path, token: str, log: Path, timeout_s: float = 60) -> str:
    """The server's URL once its API answers (it picked the port: --port=0 avoids a race for a free one)."""
    info, deadline = runtime / f"jpserver-{server.pid}.json", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"jupyter lab exited with {server.returncode}:\n{log.read_text()}")
        try:
            url = json.loads(info.read_text())["url"].rstrip("/")
            with DIRECT.open(f"{url}/api/status?token={token}", timeout=5) as answer:
                if answer.status == 200:
                    return url
        except (OSError, ValueError):  # no file yet, half written, or not answering yet
            pass
        time.sleep(0.5)
    pytest.fail(f"jupyter lab did not answer within {timeout_s:.0f} s:\n{log.read_text()}")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM makes the server shut its kernels down; the group kill catches anything left of it."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait(timeout=10)


class _RunsCode:
    """What a hostile 'snapshot' holds: a pickle that runs a command when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def snapshots(tmp_path) -> tuple[Path, Path, Path]:
    """A real CPU step written as a memory snapshot, a pickle that would run code, and the file it would touch."""
    import pickle

    import torch

    import udnn_lab as ul

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    good = ul.write_cpu_snapshot(tmp_path / "run.pickle.gz", model, torch.randn(32, 64),
                                 torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                                 target=torch.randint(10, (32,)))
    marker = tmp_path / "ran"
    bad = tmp_path / "hostile.pickle"
    bad.write_bytes(pickle.dumps(_RunsCode(marker)))
    return good, bad, marker


def test_quickstart_runs_in_jupyterlab_and_the_budget_slider_redraws_the_chart(chromium, playwright, lab, tmp_path,
                                                                                snapshots):
    url, token = lab
    browser = playwright.chromium.launch(executable_path=chromium)
    page = browser.new_page(viewport={"width": 1680, "height": 1100})
    page.set_default_timeout(30_000)
    try:
        app = run_all_cells(page, f"{url}/lab/tree/{QUICKSTART.name}?token={token}")
        summary = app.locator(".widget-html", has_text="of budget")
        before = budget_rule(app)
        assert before == pytest.approx(budget_shown(app), abs=0.05)

        handle = app.locator(".noUi-handle").first
        handle.focus()
        for _ in range(8):
            handle.press("PageDown")
        deadline = time.monotonic() + 30  # the app waits for the keys to stop (debounce), then replans
        while budget_rule(app) == before:
            assert time.monotonic() < deadline, "the memory chart was not redrawn after the budget moved"
            time.sleep(0.25)
        after = budget_shown(app)
        assert after < before and budget_rule(app) == pytest.approx(after, abs=0.05)
        summary.filter(has_text=f"of budget {after:.2f} MiB").wait_for()
        assert "fits" in summary.inner_text() and "Error" not in app.inner_text()
        the_fit_line_sits_under_the_budget(app)
        module_names_are_whole(app)

        a_click_on_the_memory_curve_lists_the_live_tensors(app)
        ops_and_time_spans_select_across_the_curve_and_the_streams(app)
        measure_shows_both_lines(app)
        an_infeasible_budget_is_said_in_full(page, app)
        a_snapshot_of_a_real_run_lies_over_the_prediction(app, snapshots)
        another_network_clears_the_training_view(app)

        app.scroll_into_view_if_needed()
        screenshot = tmp_path / "memorylab.png"
        page.screenshot(path=screenshot)
        print(f"screenshot: {screenshot}")
        the_app_comes_back_in_a_new_page(browser, page, f"{url}/lab/tree/{QUICKSTART.name}?token={token}", tmp_path)
    except Exception:
        page.screenshot(path=tmp_path / "failure.png")
        print(f"screenshot of the failure: {tmp_path / 'failure.png'}; server log: {tmp_path / 'jupyterlab.log'}")
        raise
    finally:
        browser.close()


def run_all_cells(page, notebook_url: str):
    """Open the notebook, run every cell from the Run menu, and return MemoryLab's output once it has drawn."""
    page.goto(notebook_url)
    # the toolbar's indicator reads idle before there is a kernel; the status bar names the kernel once connected
    page.locator(".jp-StatusBar-Widget").get_by_text(re.compile(r"\(ipykernel\) \| Idle")).wait_for(timeout=60_000)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    app = page.locator(".jp-OutputArea-output").filter(has=page.locator(".noUi-handle"))
    app.locator(".vega-embed svg.marks").first.wait_for(timeout=120_000)
    page.locator(".jp-InputPrompt", has_text="[*]").first.wait_for(state="detached", timeout=60_000)
    app.locator(".widget-html", has_text="of budget").wait_for()
    prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
    assert all(re.fullmatch(r"\[\d+\]:", prompt) for prompt in prompts), f"not every cell ran: {prompts}"
    assert page.locator("[data-mime-type='application/vnd.jupyter.error']").count() == 0
    assert page.locator(".jp-OutputArea-output .vega-embed").count() >= 3  # two charts above, one in the app
    return app


def fit_line(app):
    return app.locator(".udnn-fit-status")


def the_fit_line_sits_under_the_budget(app) -> None:
    """The line saying whether the plan fits is right under the budget's box and slider, beside the controls."""
    line, box = fit_line(app), budget_entry(app).bounding_box()
    slider = app.locator(".widget-hslider").first.bounding_box()  # the budget's: the app's one slider
    said = line.bounding_box()
    # on a CUDA step: the peak as torch.cuda.max_memory_allocated counts it, the live tensors' beside it
    counted = r"(as torch\.cuda\.max_memory_allocated counts it \(live tensors [\d,.]+ MiB, [^)]*\) )?"
    assert re.match(rf"fits: peak [\d,.]+ MiB {counted}within the budget", line.inner_text()), line.inner_text()
    assert 0 <= said["y"] - (slider["y"] + slider["height"]) < 24, (said, slider)  # directly under the slider
    assert said["y"] - (box["y"] + box["height"]) < 60, (said, box)
    assert said["x"] < box["x"] + box["width"] and said["x"] + said["width"] > box["x"]  # the same column


def module_names_are_whole(app) -> None:
    """Every module name in the live-tensor table shows whole inside the app, its cell's tooltip the name."""
    table = app.locator(".udnn-live-tensors")
    cells = table.locator("td.udnn-wraps").all()
    assert cells
    right = app.bounding_box()["x"] + app.bounding_box()["width"]
    for cell in cells:
        box = cell.bounding_box()
        assert cell.get_attribute("title") == cell.inner_text().replace("\n", "")
        assert cell.evaluate("e => e.scrollWidth <= e.clientWidth"), cell.inner_text()
        assert box["x"] + box["width"] <= right + 1, (cell.inner_text(), box, right)


def the_app_comes_back_in_a_new_page(browser, page, notebook_url: str, tmp_path: Path) -> None:
    """Save, then open the notebook in a new page while the kernel still runs: the app is drawn again."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^File$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Save Notebook$")).click()
    page.locator(".jp-mod-dirty").first.wait_for(state="detached", timeout=30_000)
    again = browser.new_page(viewport={"width": 1680, "height": 1100})
    again.set_default_timeout(60_000)
    try:
        again.goto(notebook_url)
        app = again.locator(".jp-OutputArea-output").filter(has=again.locator(".noUi-handle"))
        app.locator(".vega-embed svg.marks").first.wait_for(timeout=120_000)
        app.locator(".udnn-fit-status").wait_for()
        assert again.get_by_text("model not found").count() == 0
        assert again.locator(".jp-OutputArea-output .vega-embed").count() >= 3  # the two charts above, the app's
        app.scroll_into_view_if_needed()
        again.screenshot(path=tmp_path / "memorylab-new-page.png")
        print(f"screenshot of the new page: {tmp_path / 'memorylab-new-page.png'}")
    finally:
        again.close()


def budget_rule(app) -> float:
    """MiB on the budget rule's label in the app's memory chart (the first vega-embed in the app, drawn as SVG)."""
    text = app.locator(".vega-embed svg.marks").first.text_content()
    found = re.findall(r"budget ([\d,.]+) MiB", text)
    assert len(found) == 1, f"expected one budget rule in the memory chart, found {found}"
    return float(found[0].replace(",", ""))


def budget_entry(app):
    """The box the budget is typed in (a text widget labelled 'budget')."""
    return app.locator(".widget-text").filter(has=app.page.get_by_text("budget", exact=True)).locator("input")


def budget_shown(app) -> float:
    """MiB of the budget the app displays in its box above the slider ('181.27 MiB')."""
    text = budget_entry(app).input_value()
    return float(re.fullmatch(r"([\d,.]+) MiB", text).group(1).replace(",", ""))


def legend_of_memory_chart(app) -> str:
    return app.locator(".vega-embed svg.marks").first.text_content()


def inspected_op(app) -> int:
    """The op the live-tensors table is of ('live at op 123 (...)')."""
    text = app.locator(".udnn-live-tensors").inner_text()
    return int(re.search(r"live at op (\d+)", text).group(1))


def a_click_on_the_memory_curve_lists_the_live_tensors(app) -> None:
    """The table lists the tensors at the peak; a click on the curve lists those at the op nearest the click."""
    app.locator(".udnn-live-tensors").wait_for()
    before = inspected_op(app)
    chart = app.locator(".vega-embed svg.marks").first
    chart.scroll_into_view_if_needed()
    line = chart.locator(".mark-line path").first.bounding_box()
    for at in (0.1, 0.6):  # a second place, should the first be nearest the op already shown
        app.page.mouse.click(line["x"] + at * line["width"], line["y"] + 0.5 * line["height"])
        deadline = time.monotonic() + 15
        while inspected_op(app) == before and time.monotonic() < deadline:
            time.sleep(0.25)
        if inspected_op(app) != before:
            break
    clicked = inspected_op(app)
    assert clicked != before, "a click on the memory curve did not pick an op"
    rows = app.locator(".udnn-live-tensor")
    assert rows.count() > 0 and re.search(r"\d", rows.first.inner_text())
    assert f"live at op {clicked}" in app.locator(".udnn-live-tensors").inner_text()
    assert app.locator(".widget-text").filter(has=app.page.get_by_text("inspect op", exact=True)).locator(
        "input").input_value() == str(clicked)


def drag_across(page, box: dict, start: float, end: float) -> None:
    """Press at ``start`` of the box's width, move to ``end``, release: halfway down the box."""
    y = box["y"] + 0.5 * box["height"]
    page.mouse.move(box["x"] + start * box["width"], y)
    page.mouse.down()
    for step in range(1, 11):
        page.mouse.move(box["x"] + (start + (end - start) * step / 10) * box["width"], y)
    page.mouse.up()


def ops_and_time_spans_select_across_the_curve_and_the_streams(app) -> None:
    """The memory curve and the streams are one chart: ops dragged across on the curve fade the bars of the
    other ops; a span of time dragged across on the streams marks the ops that start in it on the curve."""
    chart = app.locator(".vega-embed svg.marks").first
    chart.scroll_into_view_if_needed()
    faded = chart.locator("path[aria-roledescription='bar'][opacity='0.15']")
    marked = chart.locator("line[stroke='#ff7f0e']")  # charts.linked's rules at the ops in a span of time
    assert faded.count() == 0 and marked.count() == 0
    drag_across(app.page, chart.locator(".mark-line path").first.bounding_box(), 0.15, 0.35)
    deadline = time.monotonic() + 15
    while faded.count() == 0:
        assert time.monotonic() < deadline, "dragging across ops on the memory curve faded no stream bar"
        time.sleep(0.25)
    bars = [box for box in (bar.bounding_box() for bar in chart.locator("path[aria-roledescription='bar']").all())
            if box is not None]
    lanes = {"x": min(b["x"] for b in bars), "y": min(b["y"] for b in bars)}
    lanes.update(width=max(b["x"] + b["width"] for b in bars) - lanes["x"],
                 height=max(b["y"] + b["height"] for b in bars) - lanes["y"])
    drag_across(app.page, lanes, 0.55, 0.75)
    deadline = time.monotonic() + 15
    while marked.count() == 0:
        assert time.monotonic() < deadline, "dragging across time on the streams marked no op on the curve"
        time.sleep(0.25)


def measure_shows_both_lines(app) -> None:
    """Measure: the memory chart's legend names the predicted and the measured line, of one device and plan."""
    app.get_by_role("button", name="Measure").click()
    deadline = time.monotonic() + 120
    while "measured (" not in legend_of_memory_chart(app):
        assert time.monotonic() < deadline, "Measure drew no measured line"
        time.sleep(0.5)
    text = legend_of_memory_chart(app)
    predicted = re.search(r"predicted \((\w+), ([\w+-]+)\)", text)
    measured = re.search(r"measured \((\w+), ([\w+-]+)\)", text)
    assert predicted and measured and predicted.groups() == measured.groups(), text
    assert "minimum feasible" in text  # the policy's minimum on this machine's step
    if predicted.group(1) != "cuda":  # the chart changed device: its subtitle says so, in one line
        assert f"Measure ran it on this machine's {predicted.group(1).upper()}, replacing" in text, text


def an_infeasible_budget_is_said_in_full(page, app) -> None:
    """A budget no plan meets: the message wraps in the footer, which grows to hold it (nothing to scroll)."""
    entry, fitting = budget_entry(app), budget_entry(app).input_value()
    entry.fill("1 MiB")
    entry.press("Enter")
    message = fit_line(app).filter(has_text="cannot fit")
    message.wait_for(timeout=60_000)
    # two sentences: what would lower the floor (a smaller batch, or what one op needs at once), then the chart's
    assert re.search(r"(lower the batch size|keeps the batch\))\. The chart shows every tensor kept\.",
                     message.inner_text()), message.inner_text()
    said, box = message.bounding_box(), budget_entry(app).bounding_box()
    assert 0 < said["y"] - box["y"] < 80, (said, box)  # under the box the budget was typed in
    clipped = message.evaluate("""element => {
        const clipped = [];
        for (let e = element; e && !e.classList.contains('jp-OutputArea-output'); e = e.parentElement) {
            if (e.scrollHeight > e.clientHeight + 1 || e.scrollWidth > e.clientWidth + 1) {
                clipped.push(`${e.className}: ${e.scrollWidth}x${e.scrollHeight} in ${e.clientWidth}x` +
                             `${e.clientHeight}`);
            }
        }
        return clipped;
    }""")
    assert clipped == [], f"the message is cut or scrolls in: {clipped}"
    entry.fill(fitting)  # the budget that fits, again
    entry.press("Enter")
    fit_line(app).filter(has_text="cannot fit").wait_for(state="detached", timeout=60_000)


def a_snapshot_of_a_real_run_lies_over_the_prediction(app, snapshots: tuple[Path, Path, Path]) -> None:
    """A pickle that would run code is refused in one line, unrun; a real run's snapshot draws its overlay chart
    and the line of both peaks under it."""
    good, bad, marker = snapshots
    path = app.locator(".widget-text").filter(has=app.page.get_by_text("snapshot", exact=True)).locator("input")
    overlay = app.get_by_role("button", name="Overlay snapshot")
    charts_before = app.locator(".vega-embed svg.marks").count()
    path.fill(str(bad))
    path.press("Enter")  # the path is sent, and read, on Enter
    refused = app.locator(".udnn-snapshot-message").filter(has_text="refused")
    refused.wait_for(timeout=60_000)
    assert "\n" not in refused.inner_text().strip() and not marker.exists(), refused.inner_text()
    path.fill(str(good))
    path.press("Enter")
    peaks = app.locator(".udnn-snapshot-differences").filter(has_text="peak: predicted")
    peaks.wait_for(timeout=60_000)
    overlay.click()  # read again: the same overlay
    assert re.search(r"measured [\d.]+ [KMG]?i?B", peaks.inner_text()), peaks.inner_text()
    deadline = time.monotonic() + 30
    while app.locator(".vega-embed svg.marks").count() == charts_before:
        assert time.monotonic() < deadline, "the snapshot's overlay chart was not drawn"
        time.sleep(0.25)
    assert app.locator(".udnn-snapshot-message").inner_text().strip() == ""  # the refusal went with the good file


def another_network_clears_the_training_view(app) -> None:
    """Train two steps, then pick another network: the old run's chart and progress go."""
    steps = app.locator(".widget-text").filter(has=app.page.get_by_text("steps", exact=True)).locator("input")
    steps.fill("2")
    steps.press("Enter")
    charts_before = app.locator(".vega-embed svg.marks").count()
    app.get_by_role("button", name="Train").click()
    app.locator(".widget-html", has_text="trained 2 steps").wait_for(timeout=180_000)
    assert app.locator(".vega-embed svg.marks").count() == charts_before + 1  # the training chart
    network = app.locator(".widget-text").filter(has=app.page.get_by_text("network", exact=True)).locator("input")
    network.click()
    network.press("Control+a")
    network.press_sequentially("resnet34")
    network.press("Tab")  # a combobox sends its value when it loses the focus
    deadline = time.monotonic() + 60
    while app.locator(".vega-embed svg.marks").count() > charts_before:
        assert time.monotonic() < deadline, f"the old run's chart stayed under the new network: {app.inner_text()}"
        time.sleep(0.25)
    assert app.locator(".progress-bar").first.evaluate("e => e.style.width") in ("0%", "0px", "")
