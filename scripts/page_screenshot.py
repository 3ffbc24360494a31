"""Regenerate samples/page.png: the .html page of the README's example, block view, attention panel.

    python3 scripts/page_screenshot.py      # needs dot, chromium and chromium-driver (setup.sh --test)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "run.html"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-m", "llamatrace", "diagram", "--raw", "The capital of France is",
                        "--tokens", "2", "--highlight", "13", "-o", "run.html"], check=True, cwd=tmp, env=env)
        opts = webdriver.ChromeOptions()
        opts.binary_location = "/usr/bin/chromium"
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1500,950"):
            opts.add_argument(arg)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        try:
            driver.get(page.as_uri())
            driver.execute_script("""
                const v = document.getElementById('view'); v.value = 'block'; v.dispatchEvent(new Event('change'));
                window.llamatrace.select('kq_soft_max');
                const h = document.getElementById('head'); h.value = '4'; h.dispatchEvent(new Event('change'));
                document.getElementById('panel').scrollTop = 10000;""")
            driver.save_screenshot(str(ROOT / "samples" / "page.png"))
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
