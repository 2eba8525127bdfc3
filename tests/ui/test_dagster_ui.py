"""The Dagster UI in a real (headless, system) Chromium: the deployment's global asset graph (two
experiments, each with its own assets, the comparison), a shared artifact shown as shared, a
training asset's metadata, the comparison, the Checks tab, an experiment group's Materialize all.

Materializes two tiny experiments and their comparison into a fresh persistent instance, starts
``dagster dev`` on a loopback port against their folder (``$LM_PIPELINE_EXPERIMENTS_DIR``), and
drives Chromium through Selenium with the system chromedriver (Selenium Manager is never asked to
download anything). Screenshots go to ``test-artifacts/ui/``.
Install the browser with ``scripts/install_browser.sh`` (``.ci/run`` does it before this tier, and
fails when it cannot); without it these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import pipeline as pt

pytestmark = pytest.mark.ui

CHROMIUM = os.environ.get("LM_PIPELINE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("LM_PIPELINE_CHROMEDRIVER", "/usr/bin/chromedriver")
ARTIFACTS = pt.REPO / "test-artifacts" / "ui"
# The deployment of pt.write_experiments: gpt and llama share their data and tokenizer (same config:
# the same artifacts in the store), and train (and everything after) on their own. Each has its own
# assets. Asset group -> the assets drawn in it.
_STAGES = ("data_sources", "raw_shards", "tokenizer", "token_cache", "train_ckpt", "eval_report", "hf_export")
# each experiment's partitioned checkpoint evaluations in a group of their own
GROUPS = {"gpt": _STAGES, "llama": _STAGES, "gpt_checkpoints": ("checkpoint_eval",),
          "llama_checkpoints": ("checkpoint_eval",), "experiments": ("comparison",)}
# The lineage edges (upstream, downstream) between "<group>/<name>" nodes: every stage also depends
# on the data source directly; the comparison on both experiments' runs and evaluations.
EDGES = set()
for _e in ("gpt", "llama"):
    EDGES |= {(f"{_e}/data_sources", f"{_e}/raw_shards"), (f"{_e}/data_sources", f"{_e}/tokenizer"),
              (f"{_e}/data_sources", f"{_e}/token_cache"), (f"{_e}/raw_shards", f"{_e}/tokenizer"),
              (f"{_e}/raw_shards", f"{_e}/token_cache"), (f"{_e}/tokenizer", f"{_e}/token_cache"),
              (f"{_e}/token_cache", f"{_e}/train_ckpt"), (f"{_e}/token_cache", f"{_e}/eval_report"),
              (f"{_e}/data_sources", f"{_e}/train_ckpt"), (f"{_e}/data_sources", f"{_e}/eval_report"),
              (f"{_e}/data_sources", f"{_e}/hf_export"), (f"{_e}/train_ckpt", f"{_e}/eval_report"),
              (f"{_e}/train_ckpt", f"{_e}/hf_export"), (f"{_e}/train_ckpt", f"{_e}_checkpoints/checkpoint_eval"),
              (f"{_e}/eval_report", "experiments/comparison"), (f"{_e}/train_ckpt", "experiments/comparison")}
# What the deployment starts RUNNING, stopped before the daemon starts (see the server fixture).
AUTOMATION = (("sensor", "new_checkpoint_sensor"), ("sensor", "comparison_automation"),
              ("schedule", "observe_data_sources"), ("schedule", "reevaluate_gpt"), ("schedule", "reevaluate_llama"))


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
    """Two materialized tiny experiments (gpt, llama: the same data and tokenizer) and their
    comparison, and ``dagster dev`` serving the folder they live in; yields the base URL."""
    _need_browser()
    tmp = tmp_path_factory.mktemp("ui")
    folder = pt.write_experiments(tmp)
    home = tmp / "dagster_home"
    env = pt.subprocess_env(tmp, folder, dagster_home=home)
    env.pop("LM_PIPELINE_EXPERIMENT")  # the whole folder, as a deployment loads it
    env["LM_PIPELINE_EXPERIMENTS_DIR"] = str(folder)
    # no run launched in the UI's instance may compete with the test for the CPU: queue them
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\nrun_queue:\n  max_concurrent_runs: 0\n")
    script = ("import dagster as dg\n"
              "from assets.deployment import COMPARISON_KEY, Deployment\n"
              "from assets.experiment import load_experiments\n"
              "from assets.pipeline import build_assets, default_resources, lineage_selection\n"
              "from resources import TrainingLauncherResource\n"
              "dep = Deployment(load_experiments())\n"
              "assert sorted(dep.experiments) == ['gpt', 'llama'], sorted(dep.experiments)\n"
              "res = {**default_resources(dep),\n"
              "       'training': TrainingLauncherResource(mode='in_process', poll_seconds=0.2)}\n"
              "r = dg.materialize(build_assets(dep), selection=[*lineage_selection(dep), COMPARISON_KEY],\n"
              "                   resources=res, instance=dg.DagsterInstance.get())\n"
              "raise SystemExit(0 if r.success else 1)\n")
    done = subprocess.run([pt.python(), "-c", script], env=env, cwd=pt.REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The deployment's sensors and schedules start RUNNING; the first ticks would queue evaluations
    # and a comparison (in progress, in the UI) and the pages would depend on when they ticked:
    # stop them in the instance before the daemon starts.
    dagster = str(Path(pt.python()).with_name("dagster"))
    for kind, name in AUTOMATION:
        done = subprocess.run([dagster, kind, "stop", name, "-m", "assets.definitions"], env=env, cwd=pt.REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "Stopped" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]

    port = _free_port()
    log = open(tmp / "dagster_dev.log", "w")
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
                "--disable-dev-shm-usage", "--window-size=1600,1200", f"--user-data-dir={profile}"):
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


# The drawn graph, read from the explorer's SVG (layout coordinates): the expanded groups' boxes,
# the asset nodes (name, box, status) and each edge's end points.
_GRAPH_JS = """
const svg = document.querySelector("svg[class*='AssetGraphExplorer']");
if (!svg) return null;
const box = (fo) => ({x: +fo.getAttribute('x'), y: +fo.getAttribute('y'),
                      w: +fo.getAttribute('width'), h: +fo.getAttribute('height')});
const groups = [], nodes = [], edges = [];
for (const fo of svg.querySelectorAll('foreignObject')) {
  const name = fo.querySelector("[class*='AssetNode_assetName']");
  const title = fo.querySelector('[data-tooltip]');
  if (name && fo.querySelector("[class*='assetNodeContainer']")) {
    const mini = fo.querySelector("[class*='minimalAssetNodeBox']");
    nodes.push({name: name.textContent.trim(), text: fo.textContent,
                style: mini ? (mini.getAttribute('style') || '') : '', ...box(fo)});
  } else if (title && fo.querySelector("[aria-label^='unfold']")) {
    groups.push({name: title.getAttribute('data-tooltip'), ...box(fo)});
  }
}
for (const p of svg.querySelectorAll('path[marker-end]')) {
  const n = (p.getAttribute('d').match(/-?[0-9.]+/g) || []).map(Number);
  edges.push([n[0], n[1], n[n.length - 2], n[n.length - 1]]);
}
return {groups, nodes, edges};
"""


def _drawn_graph(driver) -> tuple[dict[str, dict], list[tuple[str, str]]]:
    """The drawn asset nodes as ``"<group>/<name>" -> box`` (the group whose box holds the node),
    and the edges as (upstream, downstream) node ids: an edge leaves the middle of its upstream
    node's right side and ends (its arrow) just left of the middle of the downstream node's left."""
    g = driver.execute_script(_GRAPH_JS)
    nodes: dict[str, dict] = {}
    for n in g["nodes"]:
        holders = [gr["name"] for gr in g["groups"] if gr["x"] <= n["x"] and n["x"] + n["w"] <= gr["x"] + gr["w"]
                   and gr["y"] <= n["y"] and n["y"] + n["h"] <= gr["y"] + gr["h"]]
        assert len(holders) == 1, f"node {n['name']} is drawn in groups {holders}"
        node_id = f"{holders[0]}/{n['name']}"
        assert node_id not in nodes, f"{node_id} is drawn twice"
        nodes[node_id] = n

    def at(x: float, y: float, side: str) -> str:
        def dist(n):
            edge_x = n["x"] + n["w"] if side == "right" else n["x"]
            return abs(edge_x - x), abs(n["y"] + n["h"] / 2 - y)
        hits = [k for k, n in nodes.items() if dist(n)[0] <= 15 and dist(n)[1] <= 5]
        assert len(hits) == 1, f"an edge end at ({x}, {y}) touches the {side} side of {hits or 'no node'}"
        return hits[0]

    edges = [(at(x1, y1, "right"), at(x2, y2, "left")) for x1, y1, x2, y2 in g["edges"]]
    return nodes, edges


def test_global_asset_graph_shows_both_experiments_and_the_comparison(server, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    _welcomed(browser, server)
    browser.get(f"{server}/asset-groups")  # the UI's "Lineage": the global asset graph, every group

    # it opens with each group collapsed to one box: one per experiment, and experiments
    def collapsed(d):
        g = d.execute_script(_GRAPH_JS)
        return g if g and set(GROUPS) <= {gr["name"] for gr in g["groups"]} else False

    g = _wait(browser, collapsed, what="the collapsed groups")
    assert sorted(gr["name"] for gr in g["groups"]) == sorted(GROUPS) and not g["nodes"], g
    # "Expand all groups", from the graph's settings menu (the gear by the zoom controls)
    _dismiss_dialogs(browser)
    gear = [b for b in browser.find_elements(By.XPATH, "//button[.//*[@aria-label='settings']]")
            if b.is_displayed() and not b.text.strip()]
    assert gear, "no settings button on the graph"
    gear[-1].click()
    _wait(browser, lambda d: [e for e in d.find_elements(By.XPATH, "//*[normalize-space(text())='Expand all groups']")
                              if e.is_displayed()] or False, what="the graph's settings menu")[0].click()

    expected = sorted(f"{g}/{n}" for g, names in GROUPS.items() for n in names)

    def drawn(d):
        g = d.execute_script(_GRAPH_JS)
        if not g or len(g["nodes"]) < len(expected) or len(g["edges"]) < len(EDGES):
            return False
        return _drawn_graph(d)

    nodes, edges = _wait(browser, drawn, what="the expanded graph's nodes and edges")
    ActionChains(browser).send_keys(Keys.ESCAPE).perform()  # close the menu
    _wait(browser, lambda d: not [e for e in d.find_elements(By.XPATH, "//*[normalize-space(text())='Collapse all groups']")
                                  if e.is_displayed()], what="the menu to close")
    # every asset once, in its group: a tokenizer, a train_ckpt, ... per experiment
    assert sorted(nodes) == expected, f"drawn {sorted(nodes)}"
    # the lineage, edge by edge (each drawn once), all flowing left to right
    assert len(edges) == len(set(edges)), f"edges drawn twice: {sorted(e for e in edges if edges.count(e) > 1)}"
    assert set(edges) == EDGES, (f"missing {sorted(EDGES - set(edges))}, unexpected {sorted(set(edges) - EDGES)}")
    for up, down in edges:
        assert nodes[up]["x"] + nodes[up]["w"] <= nodes[down]["x"], f"{up} -> {down} does not flow left to right"
    # each experiment's lineage flows into the comparison
    for e in ("gpt", "llama"):
        assert nodes[f"{e}/token_cache"]["x"] < nodes[f"{e}/train_ckpt"]["x"] < nodes["experiments/comparison"]["x"]

    # once the live data has loaded, each built asset shows as materialized (a full node says so;
    # a small one, as the whole graph is drawn, is green)
    built = [k for k in expected if k.rsplit("/", 1)[1] not in ("data_sources", "checkpoint_eval")]

    def materialized(d):
        cur, _ = _drawn_graph(d)
        return all("Materialized" in cur[k]["text"] or "background-green" in cur[k]["style"] for k in built) \
            and not d.find_elements(By.XPATH, "//*[normalize-space()='Loading...']")

    _wait(browser, materialized, what="the nodes' status")
    time.sleep(1)
    _shot(browser, "asset_graph.png")


def test_train_ckpt_page_shows_loss_curve_and_final_metrics(server, browser):
    from selenium.webdriver.common.by import By

    _welcomed(browser, server)
    browser.get(f"{server}/assets/gpt/train_ckpt")
    _wait(browser, lambda d: d.find_elements(
        By.XPATH, "//td[.//span[normalize-space()='final_metrics']]") or False, what="train_ckpt's metadata")
    page = browser.page_source
    for key in ("final_metrics", "train/loss", "eval/loss", "final_step", "loss_curve"):
        assert key in page, f"{key} is not shown on gpt/train_ckpt's page"
    # it is gpt's own asset: its group and its experiment tag
    assert browser.find_elements(By.XPATH, "//a[contains(@href, '/asset-groups') and normalize-space()='gpt']"), \
        "no link to its group gpt"
    assert "experiment/gpt" in page
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


def test_a_shared_artifact_says_whom_it_shares_with(server, browser):
    """gpt/tokenizer is llama's tokenizer too (one artifact in the store): its page says so, in its
    definition's metadata and tags and in its materialization, which is a build for one of the
    two experiments and a cache hit for the other."""
    from selenium.webdriver.common.by import By

    _welcomed(browser, server)
    hits = {}
    for e, other in (("gpt", "llama"), ("llama", "gpt")):
        browser.get(f"{server}/assets/{e}/tokenizer")
        _wait(browser, lambda d: d.find_elements(By.XPATH, "//td[.//span[normalize-space()='shared_with']]") or False,
              what=f"{e}/tokenizer's metadata")
        rows = [r.text for r in browser.find_elements(By.XPATH, "//tr[td[1]//span[normalize-space()='shared_with']]")]
        assert rows and all(f"{other}/tokenizer" in r for r in rows), rows
        assert f"shared_with/{other}" in browser.page_source
        hits[e] = _metadata_row(browser, "cache_hit").text.split()[-1].lower()
        if e == "gpt":
            _shot(browser, "shared_tokenizer.png")
    assert sorted(hits.values()) == ["false", "true"], hits


# The ancestors that clip an element on the right (cut off, or behind a sideways scroll bar),
# each scrolled back to its left edge first, and where the element ends and they do.
_CLIPPED_JS = """
const out = [];
for (let e = arguments[0].parentElement; e && e !== document.body; e = e.parentElement) {
  if (getComputedStyle(e).overflowX === 'visible') continue;
  e.scrollLeft = 0;
  const right = arguments[0].getBoundingClientRect().right, edge = e.getBoundingClientRect().right;
  if (right > edge + 1) out.push(e.tagName + ' ' + e.className + ': ends at ' + right + ' > ' + edge);
}
return out;
"""


def _metadata_row(driver, key: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.XPATH, f"//tr[td[1]//span[normalize-space()='{key}']]")


def test_comparison_page_shows_both_experiments_side_by_side(server, browser):
    from selenium.webdriver.common.by import By

    _welcomed(browser, server)
    browser.get(f"{server}/assets/experiments/comparison")
    table_xpath = "//tr[td[1]//span[normalize-space()='comparison']]//table"
    _wait(browser, lambda d: d.find_elements(By.XPATH, f"{table_xpath}//tbody/tr") or False,
          what="the comparison table")
    table = browser.find_element(By.XPATH, table_xpath)
    header = [th.text.strip() for th in table.find_elements(By.XPATH, ".//thead//th")]
    rows = [[td.text.strip() for td in tr.find_elements(By.XPATH, "./td")]
            for tr in table.find_elements(By.XPATH, ".//tbody/tr")]
    assert header[:2] == ["experiment", "model"] and "bpb" in header, header
    # one row per experiment, each trained and evaluated
    assert [r[0] for r in rows] == ["gpt", "llama"], rows
    assert [r[1] for r in rows] == ["gpt2", "llama"], rows
    for r in rows:
        for col in ("params", "step", "bpb", "unigram_bpb", "bpb_vs_unigram"):
            assert float(r[header.index(col)]) > 0, f"{r[0]}'s {col} is {r[header.index(col)]!r}"
    assert _metadata_row(browser, "experiments").text.split()[-1] == "2"
    assert _metadata_row(browser, "evaluated").text.split()[-1] == "2"
    # the markdown table says the same, with every value (training tokens and time, eval loss, ...)
    md = _metadata_row(browser, "comparison_md").find_element(By.XPATH, ".//table")
    md_rows = md.find_elements(By.XPATH, ".//tbody/tr")
    assert [tr.find_element(By.XPATH, "./td[1]").text.strip() for tr in md_rows] == ["gpt", "llama"]
    assert {"train_tokens", "train_seconds", "eval_loss"} <= {th.text.strip() for th in md.find_elements(By.XPATH, ".//thead//th")}
    # built from both experiments' evaluations
    for e in ("gpt", "llama"):
        assert browser.find_elements(By.XPATH, f"//a[@href='/assets/{e}/eval_report']"), f"{e}/eval_report not upstream"
    # readable as shown: nothing around the table scrolls sideways (the other values are in the markdown table)
    clipped = browser.execute_script(_CLIPPED_JS, table)
    assert not clipped, f"the table is cut off: {clipped}"
    key = _metadata_row(browser, "comparison").find_element(By.XPATH, "./td[1]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center', inline: 'start'})", key)
    time.sleep(0.5)
    _shot(browser, "comparison_table.png")

    show = _metadata_row(browser, "plot").find_element(By.XPATH, ".//a[contains(., 'Show Markdown')]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", show)
    show.click()
    img = _wait(browser, lambda d: [i for i in d.find_elements(By.CSS_SELECTOR, "img[src^='data:image/png']")
                                    if i.is_displayed() and i.get_property("naturalWidth") > 100] or False,
                what="the comparison plot")[0]
    assert img.get_property("naturalHeight") > 100
    time.sleep(0.5)
    _shot(browser, "comparison_plot.png")


def test_the_checks_tab_shows_each_artifacts_check_and_its_result(server, browser):
    """The asset page's Checks tab: the check of gpt's token cache (blocking) and of its export
    (it loads in transformers with the checkpoint's logits), each passed in the run that
    materialized the asset."""
    from selenium.webdriver.common.by import By

    _welcomed(browser, server)
    for stage, check in (("token_cache", "token_ids_and_counts"), ("hf_export", "loads_in_transformers")):
        browser.get(f"{server}/assets/gpt/{stage}?view=checks")
        _wait(browser, lambda d, check=check: d.find_elements(By.XPATH, f"//*[normalize-space(text())='{check}']") or False,
              what=f"gpt/{stage}'s Checks tab")
        _wait(browser, lambda d: "Passed" in d.find_element(By.TAG_NAME, "body").text, what=f"{check}'s result")
        body = browser.find_element(By.TAG_NAME, "body").text
        assert check in body and "Passed" in body, body[:2000]
        time.sleep(0.5)
        _shot(browser, f"{stage}_checks.png")


_RUNS_QUERY = "{ runsOrError { ... on Runs { results { runId status assetSelection { path } } } } }"


def _runs(server: str) -> list[dict]:
    import json

    req = urllib.request.Request(f"{server}/graphql", data=json.dumps({"query": _RUNS_QUERY}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["data"]["runsOrError"]["results"]


def test_materialize_all_on_an_experiments_group_launches_its_lineage_not_a_backfill(server, browser):
    """gpt's group holds its lineage only (its partitioned checkpoint evaluations have a group of their
    own), so its **Materialize all** launches one run of the lineage at once, with no partition dialog.
    Runs stay queued here (the instance runs none), so nothing is rebuilt. Last in this file."""
    from selenium.webdriver.common.by import By

    _welcomed(browser, server)
    before = {r["runId"] for r in _runs(server)}
    browser.get(f"{server}/asset-groups~group%3A%22gpt%22")  # the group's graph, as its link opens it, nothing selected
    button = _wait(browser, lambda d: [b for b in d.find_elements(By.XPATH, "//button[contains(., 'Materialize all')]")
                                       if b.is_displayed() and b.is_enabled()] or False, what="gpt's Materialize all")[0]
    _dismiss_dialogs(browser)
    button.click()
    new = _wait(browser, lambda d: [r for r in _runs(server) if r["runId"] not in before] or False,
                what="the run Materialize all launches")
    assert not [d for d in browser.find_elements(By.XPATH, "//*[@role='dialog']") if d.is_displayed()
                and "artition" in d.text], "Materialize all opened a partition dialog"
    assert len(new) == 1, new
    selected = {"/".join(k["path"]) for k in new[0]["assetSelection"] or []}
    assert selected - {"gpt/data_sources"} == {f"gpt/{s}" for s in _STAGES if s != "data_sources"}, selected
    time.sleep(1)
    _shot(browser, "materialize_all_gpt.png")
