"""The runbook as a person steps through it: 02-diagnosis in JupyterLab, run by a real (headless) Chromium
against the lab, and a run's index.html in the same browser.

Asserted: the progress widget renders while cells run, the node table appears, no cell errors and every
code cell ran; the index links every notebook of its run (and its nbconvert page) and shows its decisions; the
committed failed run's page shows its cause and the log lines that decided it on its first screen. Screenshots go to
$SPARKBOOK_BROWSER_SHOTS (else the test's tmp dir).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import nbformat
import pytest
from lab_browser import CHROMEDRIVER, CHROMIUM, chromium, start_lab, widgets_extension_active

import sparkbook.lab as sblab
from sparkbook.core.cluster.progress import WIDGET_CLASS
from sparkbook.core.values.params import load_params
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions

pytestmark = pytest.mark.lab
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "02-diagnosis.ipynb"
RUN_ALL_TIMEOUT_S = 300
STDERR = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
WIDGET = f".{WIDGET_CLASS} .widget-hprogress"  # ipywidgets 8: a horizontal progress bar in our box


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("SPARKBOOK_BROWSER_SHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    for tool in (CHROMIUM, CHROMEDRIVER):
        assert tool.exists(), f"{tool} is missing: `make setup` installs Debian's chromium and chromium-driver"
    driver = chromium(tmp_path_factory.mktemp("chromium") / "profile")
    yield driver
    driver.quit()


def parameterised_copy(folder: Path, params_file: Path, run_dir: Path) -> Path:
    """The notebook with its parameters cell pointed at this lab's params and a run dir of the test."""
    nb = nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    kept = [line for line in cell.source.splitlines() if not line.startswith(("params_file", "run_dir"))]
    cell.source = "\n".join([f"params_file = {str(params_file)!r}", f"run_dir = {str(run_dir)!r}", *kept])
    path = folder / NOTEBOOK
    nbformat.write(nb, path)
    return path


def prompts(driver) -> list[str]:  # type: ignore[no-untyped-def]
    """The input prompt of every code cell, e.g. '[3]:', '[*]:' or '[ ]:'."""
    return driver.execute_script(
        "return [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim())")


def click_menu(driver, menu: str, item: str) -> None:  # type: ignore[no-untyped-def]
    """Open a menu of the menu bar and click one of its items, by their labels, as a person does."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 30)
    wait.until(ec.element_to_be_clickable(
        (By.XPATH, f"//li[contains(@class,'lm-MenuBar-item')][.//*[normalize-space(text())='{menu}']]"))).click()
    wait.until(ec.element_to_be_clickable(
        (By.XPATH, f"//li[contains(@class,'lm-Menu-item')][.//*[normalize-space(text())='{item}']]"))).click()


def test_02_diagnosis_in_jupyterlab(lab, browser, shots: Path, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    assert widgets_extension_active(), "ipywidgets' JupyterLab extension is not enabled: progress cannot render"
    params_file = sblab.params_file(2)
    nodes = [n.name for n in load_params(params_file).nodes]
    work = tmp_path / "work"
    work.mkdir()
    notebook = parameterised_copy(work, params_file, tmp_path / "run")
    server = start_lab(work, tmp_path / "jupyter")
    try:
        browser.get(server.url(f"lab/tree/{NOTEBOOK}"))
        WebDriverWait(browser, 120).until(lambda d: len(prompts(d)) > 0)
        WebDriverWait(browser, 120).until(  # the kernel is up before anything is run
            lambda d: "Idle" in d.execute_script("return document.querySelector('#jp-main-statusbar').innerText"))
        n_code = sum(c.cell_type == "code" for c in nbformat.read(notebook, as_version=4).cells)
        click_menu(browser, "Run", "Run All Cells")

        t0 = time.monotonic()
        widget_seen_running = False
        while time.monotonic() - t0 < RUN_ALL_TIMEOUT_S:
            current = prompts(browser)
            running = any("*" in p for p in current)
            bars = browser.find_elements(By.CSS_SELECTOR, WIDGET)
            if not widget_seen_running and running and bars:
                widget_seen_running = True
                browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", bars[-1])
                browser.save_screenshot(str(shots / "02-diagnosis-running.png"))
            if not running and all(p[1:-2].strip().isdigit() for p in current):
                break
            if browser.find_elements(By.CSS_SELECTOR, STDERR) and not running:
                break
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
        browser.execute_script("document.querySelector('.jp-WindowedPanel-outer, .jp-Notebook').scrollTop = 1e9")
        time.sleep(1)
        browser.save_screenshot(str(shots / "02-diagnosis-finished.png"))
        current = prompts(browser)
        errors = [e.text[-1500:] for e in browser.find_elements(By.CSS_SELECTOR, STDERR)]
        click_menu(browser, "File", "Save Notebook")
        print(f"Run All: {elapsed:.1f} s; prompts {current}")

        assert not errors, "cells wrote errors / stderr:\n" + "\n---\n".join(errors)
        assert len(current) == n_code and all(p[1:-2].strip().isdigit() for p in current), \
            f"not every code cell ran within {RUN_ALL_TIMEOUT_S} s: {current}"
        assert widget_seen_running, "no progress widget appeared while a cell was running"
        finished_bars = browser.find_elements(By.CSS_SELECTOR, f"{WIDGET} .progress-bar-success")
        assert finished_bars, "no finished (green) progress bar is on the page: the widget did not update"
        tables = [t.text for t in browser.find_elements(By.CSS_SELECTOR, ".jp-RenderedHTMLCommon table")]
        node_table = [t for t in tables if t.startswith("node") and "os" in t.split("\n")[0]]
        assert node_table and all(n in node_table[0] for n in nodes), f"no node table naming {nodes}: {tables[:3]}"

        time.sleep(2)  # the save request
        saved = nbformat.read(notebook, as_version=4)
        code = [c for c in saved.cells if c.cell_type == "code"]
        assert all(c.execution_count for c in code), [c.execution_count for c in code]
        assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    except Exception:
        browser.save_screenshot(str(shots / "02-diagnosis-failed.png"))
        raise
    finally:
        server.stop()


def test_run_index_links_every_notebook_and_shows_decisions(lab, browser, shots: Path, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    params_file = sblab.params_file(2)
    run_dir, _ = driver.execute(params_file, RunOptions(out_root=tmp_path, only="01"))  # plan only: nothing is stopped
    run_dir, manifest = driver.execute(params_file, RunOptions(resume=run_dir, only="02"))
    ran = [nb for nb in manifest.notebooks if nb.status in ("ok", "failed")]
    assert [(nb.name[:2], nb.status) for nb in ran] == [("01", "ok"), ("02", "ok")], \
        json.dumps([nb.exception for nb in ran])
    decisions = [d for nb in ran for d in nb.decisions]
    assert decisions, "01-cleanup records its decision"
    for nb in ran:  # headless: progress is text, never widget JSON
        assert "application/vnd.jupyter.widget" not in (run_dir / nb.name).read_text(), nb.name

    browser.get((run_dir / "index.html").as_uri())
    browser.save_screenshot(str(shots / "run-index.png"))
    hrefs = {a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "a")}
    for nb in ran:
        assert (run_dir / nb.name).as_uri() in hrefs, f"index.html does not link {nb.name}"
        assert (run_dir / nb.name.replace(".ipynb", ".html")).as_uri() in hrefs, f"no HTML page of {nb.name}"
    page = browser.find_element(By.TAG_NAME, "body").text
    for d in decisions:
        assert d["question"] in page and d["choice"] in page, f"index.html does not show the decision {d}"


def test_the_failed_runs_first_screen_shows_its_cause_and_log_lines(browser, shots: Path, tmp_path: Path) -> None:
    """Issue 31: the committed failed lab run, copied elsewhere, opened as a colleague would: without scrolling,
    the cause and the lines of each node's log around its first error, which name the planted flag."""
    import shutil

    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "lab" / "20261201T200508Z"
    shutil.copytree(ROOT / "outputs" / "examples" / "lab" / run_dir.name, run_dir)
    browser.get((run_dir / "index.html").as_uri())
    browser.save_screenshot(str(shots / "failed-run-index.png"))
    height = browser.execute_script("return window.innerHeight")

    def on_first_screen(element) -> bool:  # type: ignore[no-untyped-def]
        return element.is_displayed() and element.rect["y"] + element.rect["height"] <= height

    cause = browser.find_element(By.CSS_SELECTOR, "p.cause")
    assert on_first_screen(cause) and "unrecognized arguments: --planted-unknown-flag" in cause.text
    logs = [p for p in browser.find_elements(By.TAG_NAME, "pre") if "planted-unknown-flag" in p.text]
    assert len(logs) >= 2 and all(on_first_screen(p) for p in logs[:2]), "both nodes' log lines, unscrolled"
    hrefs = {a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "a")}
    assert (run_dir / "logs" / "serve-lab-0-attempt1.log").as_uri() in hrefs
    assert (run_dir / "05-serve.html").as_uri() in hrefs
