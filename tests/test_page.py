"""`llamatrace diagram -o run.html`: the page's data and CLI (tiny model), size bounds and the page
in a real browser (default model).

The browser tests drive Debian's ``chromium`` through ``/usr/bin/chromedriver`` with selenium
(``bash scripts/setup.sh --test`` installs both); they skip, saying so, only when no browser is
installed. The numbers the page shows are checked against ``llamatrace trace --stats`` and against
the probabilities' own definition (attention rows sum to 1).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import error_line

from llamatrace.cli import main
from llamatrace.model.generate import generate

PROMPT = "The capital of France is"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
CHROMIUM = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()), None)
CHROMEDRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists()
                                                 else None)


def page_data(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    m = re.search(r'<script id="run-data" type="application/json">(.*?)</script>', text, flags=re.S)
    assert m, "no run data in the page"
    return json.loads(m.group(1))


# --- the page's content (tiny model) --------------------------------------------------------------
@needs_dot
def test_page_is_self_contained_with_stats_for_every_layer_and_values_for_chosen(tiny_model, tiny_model_path,
                                                                                   tmp_path):
    out = tmp_path / "run.html"
    assert main(["diagram", "--model", str(tiny_model_path), "--raw", PROMPT, "--layer", "-1", "--tokens", "2",
                 "-o", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    # nothing fetched: no external script, style, image or link
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', text)
    assert text.count("<svg") >= 6                      # model + block view for steps 0, 1, 2
    data = page_data(out)
    n_layers = tiny_model.config.n_layers
    assert data["steps"] == 3 and data["value_layers"] == [n_layers - 1]
    layers = {e["layer"] for e in data["events"]}
    assert layers == {None, *range(n_layers)}           # statistics for every layer
    for e in data["events"]:
        assert e["stats"]["rms"] and (e["hist"] is None or sum(e["hist"]["counts"]) > 0)
        assert ("values" in e) == (e["layer"] in (None, n_layers - 1) and e["stage"] != "freqs_cis")
    # the values are the traced tensor's, as float16 (an independent trace of the same run)
    ids = tiny_model.tokenizer.encode(PROMPT)
    with tiny_model.trace(layers=[n_layers - 1], stages=["Qcur"], keep_arrays=True) as rec:
        list(generate(tiny_model, ids, max_tokens=1))
    want = rec.events[0].array.ravel().astype(np.float16)
    ev = next(e for e in data["events"] if e["step"] == 0 and e["layer"] == n_layers - 1 and e["stage"] == "Qcur")
    got = np.frombuffer(base64.b64decode(ev["values"]), dtype="<f2")
    np.testing.assert_array_equal(got, want[:ev["n"]])
    # the top next tokens of each step are the softmax of the logits, the greedy token first
    assert [t["id"] for t in data["generated"]] == [data["top"][str(s)][0]["id"] for s in range(3)]


@pytest.mark.parametrize("target", ["-", "dir"])
def test_stdout_and_directory_outputs_are_clear_errors(tmp_path, capsys, target):
    where = "-" if target == "-" else str(tmp_path)
    code = main(["diagram", "--model", str(tmp_path / "missing.gguf"), "-o", where])
    assert code == 2
    line = error_line(capsys)
    assert ("standard output" in line) if target == "-" else ("is a directory" in line and "flow.svg" in line)
    assert "extension" not in line and "missing.gguf" not in line


@pytest.mark.parametrize("spec, ok", [("-1", True), ("0-1", False), ("all", False), ("x", False)])
def test_layer_takes_traces_syntax(tiny_model_path, tmp_path, capsys, spec, ok):
    code = main(["diagram", "--model", str(tiny_model_path), "--raw", PROMPT, "--layer", spec,
                 "-o", str(tmp_path / "f.dot")])
    assert code == (0 if ok else 2)
    if ok:
        assert "tiny-q8_0.gguf" in (tmp_path / "f.dot").read_text() and "layer 1" in (tmp_path / "f.dot").read_text()
    else:
        assert "--layer" in error_line(capsys)


def test_tokens_is_for_html_and_step_view_choose_where_the_page_opens(tiny_model_path, tmp_path, capsys):
    assert main(["diagram", "--model", str(tiny_model_path), "--tokens", "2", "-o", str(tmp_path / "f.svg")]) == 2
    assert "--step" in error_line(capsys)
    out = tmp_path / "run.html"
    assert main(["diagram", "--model", str(tiny_model_path), "--raw", PROMPT, "--step", "2", "--view", "block",
                 "-o", str(out)]) == 0
    data = page_data(out)
    assert (data["steps"], data["start_step"], data["start_view"]) == (3, 2, "block")


def test_help_shows_the_default_output_and_html():
    from typer.testing import CliRunner
    from llamatrace.cli import app
    out = CliRunner().invoke(app, ["diagram", "--help"], terminal_width=200).output
    assert "./flow.svg" in out and ".html" in out


def test_html_without_dot_gives_the_svg_error(tiny_model_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert main(["diagram", "--model", str(tiny_model_path), "-o", str(tmp_path / "run.html")]) == 2
    assert "apt-get install graphviz" in error_line(capsys)
    assert list(tmp_path.iterdir()) == []


# --- the default model: size bounds -----------------------------------------------------------------
@needs_dot
@pytest.mark.parametrize("args, limit_mb", [(["--raw", PROMPT], 5), ([], 15)])
def test_page_size_of_the_default_model(smollm2_path, tmp_path, args, limit_mb):
    out = tmp_path / "run.html"
    assert main(["diagram", "--model", str(smollm2_path), *args, "-o", str(out)]) == 0
    assert out.stat().st_size <= limit_mb * 1_000_000


# --- the page in a real browser ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no browser installed: the page tests need Debian's chromium and chromium-driver "
                    "(bash scripts/setup.sh --test installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[test])")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1600,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)   # never selenium's driver download
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(smollm2_path, tmp_path_factory, browser):
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed")
    out = tmp_path_factory.mktemp("page") / "run.html"
    assert main(["diagram", "--model", str(smollm2_path), "--raw", PROMPT, "--tokens", "2", "-o", str(out)]) == 0
    browser.get(out.as_uri())
    return browser


def click_node(driver, stage_id: str) -> None:
    from selenium.webdriver.common.by import By
    for g in driver.find_elements(By.CSS_SELECTOR, "#diagram g.node"):
        if g.find_element(By.TAG_NAME, "title").get_attribute("textContent") == stage_id:
            driver.execute_script("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", g)
            return
    raise AssertionError(f"no node {stage_id} in the diagram")


def select(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select
    from selenium.webdriver.common.by import By
    Select(driver.find_element(By.ID, element_id)).select_by_value(value)


def test_page_loads_without_console_errors(page):
    from selenium.webdriver.common.by import By
    errors = [e for e in page.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []
    assert "SmolLM2" in page.find_element(By.ID, "model").text
    assert len(page.find_elements(By.CSS_SELECTOR, "#diagram g.node")) > 20


def test_clicking_qcur_shows_the_rms_trace_prints(page, smollm2_path, capsys):
    from selenium.webdriver.common.by import By
    select(page, "step", "0")
    select(page, "layer", "0")
    click_node(page, "Qcur")
    shown = page.find_element(By.ID, "p-rms").text
    capsys.readouterr()
    assert main(["trace", "--model", str(smollm2_path), "--raw", PROMPT, "--stats", "--layer", "0",
                 "--stage", "Qcur", "--tokens", "1"]) == 0
    printed = re.search(r"Qcur float32.*?\n\s+sum .*? rms (\S+)", capsys.readouterr().out, flags=re.S)
    assert printed, "trace --stats printed no rms for Qcur"
    assert shown == printed.group(1)


def test_switching_the_step_changes_the_kv_cache_range(page):
    from selenium.webdriver.common.by import By
    select(page, "step", "0")
    prefill = page.find_element(By.ID, "kv-range").text
    select(page, "step", "1")
    decode = page.find_element(By.ID, "kv-range").text
    n = len(PROMPT.split())                          # 5 tokens: "The", " capital", " of", " France", " is"
    assert f"writes [0:{n}]" in prefill and f"reads [0:{n}]" in prefill
    assert f"writes [{n}:{n + 1}]" in decode and f"reads [0:{n + 1}]" in decode
    node = next(g for g in page.find_elements(By.CSS_SELECTOR, "#diagram g.node")
                if g.find_element(By.TAG_NAME, "title").get_attribute("textContent") == "kv_cache")
    assert f"reads [0:{n + 1}]" in node.get_attribute("textContent")


def test_attention_rows_sum_to_one(page):
    from selenium.webdriver.common.by import By
    for step in ("0", "1"):
        select(page, "step", step)
        click_node(page, "kq_soft_max")
        select(page, "head", "4")
        rows = page.find_elements(By.CSS_SELECTOR, "#attn tr")
        assert len(rows) == (5 if step == "0" else 1)
        for row in rows:
            ps = [float(td.get_attribute("data-p")) for td in row.find_elements(By.CSS_SELECTOR, "td[data-p]")]
            assert len(ps) == (5 if step == "0" else 6)
            assert sum(ps) == pytest.approx(1.0, abs=5e-3)      # float16 values
            assert min(ps) >= 0


def test_layer_selector_relabels_the_view_and_weight_nodes_open_their_stage(page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    select(page, "step", "0")
    select(page, "view", "block")
    select(page, "layer", "7")
    text = page.find_element(By.ID, "diagram").text
    assert "blk.7.attn_k.weight" in text and "CacheK[7]" in text and "blk.0." not in text
    click_node(page, "w_Kcur_attn_wk")
    panel = page.find_element(By.ID, "panel").text
    assert page.find_element(By.ID, "p-id").text.startswith("Kcur") and "blk.7.attn_k.weight" in panel
    assert "layer 7" in panel and "values are kept for layer 0" in panel
    page.find_element(By.TAG_NAME, "body").send_keys(Keys.ARROW_DOWN)       # keyboard: the next stage
    assert page.find_element(By.ID, "p-id").text.startswith("Vcur")
    select(page, "layer", "0")
    select(page, "view", "model")


def test_save_button_writes_a_npy_file_numpy_reads(page, tmp_path):
    import io
    from selenium.webdriver.common.by import By
    select(page, "step", "0")
    select(page, "layer", "0")
    click_node(page, "Qcur")
    # capture the Blob the button hands to the browser instead of downloading it
    page.execute_script("""
        window._saved = null;
        const make = URL.createObjectURL;
        URL.createObjectURL = (blob) => { window._saved = blob; return make(blob); };
        HTMLAnchorElement.prototype.click = function () { window._name = this.download; };""")
    page.find_element(By.ID, "save").click()
    b64 = page.execute_async_script("""
        const done = arguments[0], r = new FileReader();
        r.onload = () => done(r.result.split(",")[1]);
        r.readAsDataURL(window._saved);""")
    array = np.load(io.BytesIO(base64.b64decode(b64)))
    assert page.execute_script("return window._name") == "step0.layer0.Qcur.npy"
    assert array.dtype == np.float16 and array.shape == (5, 576)
    data = page.execute_script("return window.llamatrace.data.events.find("
                               "e => e.step === 0 && e.layer === 0 && e.stage === 'Qcur')")
    rms = float(data["stats"]["rms"])
    assert np.sqrt(np.mean(array.astype(np.float64) ** 2)) == pytest.approx(rms, rel=1e-3)


@needs_dot
def test_user_text_cannot_inject_html_or_script(tmp_path, tiny_model_path):
    # the prompt lands in the title, the token strip and the inline JSON: all must stay text
    from html.parser import HTMLParser
    evil = '</script><script>alert(1)</script><b>x</b> & \' "'
    page = tmp_path / "run.html"
    assert main(["diagram", "--model", str(tiny_model_path), "--raw", "-o", str(page), evil]) == 0
    text = page.read_text(encoding="utf-8")

    class Tags(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags, self.scripts, self.title, self._in = [], [], "", None

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)
            self._in = tag
            if tag == "script":
                self.scripts.append("")

        def handle_endtag(self, tag):
            self._in = None

        def handle_data(self, data):
            if self._in == "script":
                self.scripts[-1] += data
            elif self._in == "title":
                self.title += data

    parsed = Tags()
    parsed.feed(text)
    assert len(parsed.scripts) == 2 and "b" not in parsed.tags          # no element made of the prompt
    assert "alert(1)" not in parsed.scripts[1]                           # our JS only
    data = json.loads(parsed.scripts[0])                                 # the run's data, whole
    assert data["prompt"] == evil
    assert parsed.title.startswith(f"llamatrace — {data['model']}: {evil}") and "&lt;/script&gt;" in text.split("<body>")[0]   # escaped, shown as text


@needs_dot
def test_a_hybrids_page_shows_each_layers_own_drawing(browser, tmp_path):
    """Qwen3.5: layer 2 is an attention layer, the others gated DeltaNet ones. Choosing layer 2 used to
    show the DeltaNet drawing of layer 0 relabelled, and its attention stages said 'not run'."""
    from selenium.webdriver.common.by import By
    from qwen35_files import write_qwen35_file
    out = tmp_path / "run.html"
    path = write_qwen35_file(tmp_path / "qwen35.gguf")
    assert main(["diagram", "-m", str(path), "--raw", "the cat", "--tokens", "1", "-o", str(out)]) == 0
    browser.get(out.as_uri())
    nodes = lambda: {g.find_element(By.TAG_NAME, "title").get_attribute("textContent")   # noqa: E731
                     for g in browser.find_elements(By.CSS_SELECTOR, "#diagram g.node")}
    select(browser, "view", "block")
    for step in ("0", "1"):
        select(browser, "step", step)
        select(browser, "layer", "2")
        assert {"Qcur", "kq_soft_max", "attn_gated"} <= nodes() and "new_state" not in nodes()
        click_node(browser, "kq_soft_max")
        assert browser.find_element(By.ID, "p-id").text.startswith("kq_soft_max")     # its event, not "not run"
        select(browser, "layer", "3")                   # another DeltaNet layer than the one drawn (0)
        assert "new_state" in nodes() and "kq_soft_max" not in nodes()
        assert "blk.3." in browser.find_element(By.ID, "diagram").text
        click_node(browser, "new_state")
        assert browser.find_element(By.ID, "p-id").text.startswith("new_state")
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []


@needs_dot
def test_attention_of_a_long_prompt_offers_the_heads_the_page_keeps(browser, smollm2_path, tmp_path):
    """100 tokens: a head's map is 10,000 values, the page keeps 65,536 of the 90,000: heads 0-5 are
    shown and the rest named; the heatmap used to vanish without a word."""
    from selenium.webdriver.common.by import By
    out = tmp_path / "long.html"
    prompt = " ".join(["word"] * 100)
    assert main(["diagram", "--model", str(smollm2_path), "--raw", prompt, "--tokens", "0", "-o", str(out)]) == 0
    browser.get(out.as_uri())
    n = len(page_data(out)["tokens"])
    heads = 65536 // (n * n)
    assert 1 <= heads < 9
    click_node(browser, "kq_soft_max")
    options = browser.find_elements(By.CSS_SELECTOR, "#head option")
    assert [o.get_attribute("value") for o in options] == [str(h) for h in range(heads)]
    assert f"heads 0–{heads - 1} of 9: the page keeps the first 65536 values" in browser.find_element(By.ID, "panel").text
    rows = browser.find_elements(By.CSS_SELECTOR, "#attn tr")
    assert len(rows) == n


@pytest.mark.parametrize("flag, needle", [("--timings", "does not show times"), ("--stats", "always has them")])
def test_image_only_flags_are_refused_for_the_page(flag, needle, tmp_path, capsys):
    """--stats did nothing to the page (it always has the statistics) and exited 0 without a word."""
    code = main(["diagram", "--model", str(tmp_path / "missing.gguf"), flag, "-o", str(tmp_path / "run.html")])
    assert code == 2
    line = error_line(capsys)
    assert flag in line and needle in line and not (tmp_path / "run.html").exists()
