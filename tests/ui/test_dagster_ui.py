"""The Dagster UI in a real (headless, system) Chromium: the asset graph and train_ckpt's metadata.

Materializes a tiny pipeline into a fresh persistent instance, starts ``dagster dev`` on a loopback
port against it, and drives Chromium through Selenium with the system chromedriver (Selenium
Manager is never asked to download anything). Screenshots go to ``test-artifacts/ui/``.
Install the browser with ``scripts/install_browser.sh`` (``.ci/run`` does it before this tier, and
fails when it cannot); without it these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import pipeline_testing as pt  # noqa: E402

pytestmark = pytest.mark.ui

CHROMIUM = os.environ.get("LM_PIPELINE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("LM_PIPELINE_CHROMEDRIVER", "/usr/bin/chromedriver")
ARTIFACTS = pt.REPO / "test-artifacts" / "ui"
LINEAGE = ("raw_shards", "tokenizer", "token_cache", "train_ckpt", "eval_report", "hf_export")
# raw_shards->tokenizer, raw_shards->token_cache, tokenizer->token_cache, token_cache->train_ckpt,
# token_cache->eval_report, train_ckpt->eval_report, train_ckpt->hf_export
NUM_EDGES = 7


def _need_browser() -> None:
    """Skip without the system browser; under CI=true that skip is a failure (tests/conftest.py)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: run scripts/install_browser.sh "
                    "(apt-get install chromium chromium-driver)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A materialized tiny pipeline and ``dagster dev`` serving it; yields the base URL."""
    _need_browser()
    tmp = tmp_path_factory.mktemp("ui")
    config = pt.write_config(tmp)
    home = tmp / "dagster_home"
    env = pt.subprocess_env(tmp, config, dagster_home=home)
    # no run launched by the sensor may compete with the test for the CPU: queue them
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\nrun_queue:\n  max_concurrent_runs: 0\n")
    script = ("import dagster as dg\n"
              "from assets.experiment import load_experiment\n"
              "from assets.pipeline import LINEAGE, build_assets, default_resources\n"
              "from resources import TrainingLauncherResource\n"
              "exp = load_experiment()\n"
              "res = {**default_resources(exp), 'training': TrainingLauncherResource(mode='in_process')}\n"
              "r = dg.materialize(build_assets(exp), selection=list(LINEAGE), resources=res,\n"
              "                   instance=dg.DagsterInstance.get())\n"
              "raise SystemExit(0 if r.success else 1)\n")
    done = subprocess.run([pt.python(), "-c", script], env=env, cwd=pt.REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    port = _free_port()
    log = open(tmp / "dagster_dev.log", "w")
    dagster = str(Path(pt.python()).with_name("dagster"))
    proc = subprocess.Popen([dagster, "dev", "-m", "assets.definitions", "-h", "127.0.0.1", "-p", str(port)],
                            env=env, cwd=pt.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"dagster dev exited: {(tmp / 'dagster_dev.log').read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/server_info", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "dagster dev did not start within 180 s"
            time.sleep(1)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


@pytest.fixture(scope="module")
def browser():
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="chromium-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1600,1000", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(driver, cond, timeout=60, what="the page"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.5).until(cond, message=f"timed out waiting for {what}")


def _dismiss_dialogs(driver) -> bool:
    from selenium.webdriver.common.by import By

    clicked = False
    for b in driver.find_elements(By.XPATH, "//button[normalize-space()='Skip']"):
        if b.is_displayed():
            b.click()
            clicked = True
    return clicked


def _welcomed(driver, base: str) -> None:
    """Dismiss the UI's one-time welcome dialog (it appears a few seconds after the first load)."""
    from selenium.common.exceptions import TimeoutException

    if getattr(driver, "_lm_welcomed", False):
        return
    driver._lm_welcomed = True
    driver.get(base)
    try:
        _wait(driver, lambda d: _dismiss_dialogs(d) or False, timeout=20)
    except TimeoutException:
        pass


def _shot(driver, name: str) -> Path:
    _dismiss_dialogs(driver)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    return path


def test_asset_graph_shows_six_assets_and_their_lineage(server, browser):
    from selenium.webdriver.common.by import By

    _welcomed(browser, server)
    browser.get(f"{server}/locations/assets.definitions/asset-groups/pipeline/lineage")

    def nodes(d):
        names = {e.get_attribute("data-tooltip") for e in d.find_elements(By.CSS_SELECTOR, "[data-tooltip]")}
        return names if set(LINEAGE) <= names else False

    names = _wait(browser, nodes, what="the six asset nodes")
    assert set(LINEAGE) <= names
    # the lineage edges: SVG paths ending in an arrow marker inside the graph's canvas
    edges = _wait(browser, lambda d: d.find_elements(
        By.CSS_SELECTOR, "svg[class*='AssetGraphExplorer'] path[marker-end]") or False, what="lineage edges")
    assert len(edges) >= NUM_EDGES, f"{len(edges)} edges drawn, expected {NUM_EDGES}"
    # each edge goes left to right (upstream to downstream) between two drawn nodes
    box = {n: browser.find_element(By.CSS_SELECTOR, f"[data-tooltip='{n}']").rect for n in LINEAGE}
    order = sorted(LINEAGE, key=lambda n: box[n]["x"])
    assert order.index("raw_shards") < order.index("tokenizer") < order.index("token_cache") \
        < order.index("train_ckpt") < min(order.index("eval_report"), order.index("hf_export"))
    # and each node shows its latest materialization once the live data has loaded
    _wait(browser, lambda d: len(d.find_elements(By.XPATH, "//*[normalize-space()='Materialized']")) >= len(LINEAGE)
          and not d.find_elements(By.XPATH, "//*[normalize-space()='Loading...']"), what="the nodes' status")
    time.sleep(1)
    _shot(browser, "asset_graph.png")


def test_train_ckpt_page_shows_loss_curve_and_final_metrics(server, browser):
    from selenium.webdriver.common.by import By

    _welcomed(browser, server)
    browser.get(f"{server}/assets/train_ckpt")
    _wait(browser, lambda d: d.find_elements(
        By.XPATH, "//td[.//span[normalize-space()='final_metrics']]") or False, what="train_ckpt's metadata")
    page = browser.page_source
    for key in ("final_metrics", "train/loss", "eval/loss", "final_step", "loss_curve"):
        assert key in page, f"{key} is not shown on train_ckpt's page"
    row = browser.find_element(By.XPATH, "//td[.//span[normalize-space()='final_metrics']]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", row)
    time.sleep(0.5)
    _shot(browser, "train_ckpt_metadata.png")

    show = browser.find_element(
        By.XPATH, "//tr[td//span[normalize-space()='loss_curve']]//a[contains(., 'Show Markdown')]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", show)
    show.click()
    img = _wait(browser, lambda d: [i for i in d.find_elements(By.CSS_SELECTOR, "img[src^='data:image/png']")
                                    if i.is_displayed() and i.get_property("naturalWidth") > 100] or False,
                what="the loss curve image")[0]
    assert img.get_property("naturalHeight") > 100
    time.sleep(0.5)
    _shot(browser, "train_ckpt_loss_curve.png")
