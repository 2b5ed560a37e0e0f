"""Open an HTML file in headless Chromium (Debian's chromium + chromium-driver, installed by .ci/run) and report
console errors and images that did not load."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def chromium_paths() -> tuple[str, str]:
    chrome = shutil.which("chromium") or "/usr/bin/chromium"
    driver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if not (Path(chrome).exists() and Path(driver).exists()):
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
    return chrome, driver


_SECTION_JS = """
const h = Array.from(document.querySelectorAll('h1,h2,h3')).find(e => e.textContent.trim() === arguments[0]);
if (!h) return null;
let text = '', e = h.nextElementSibling;
const level = +h.tagName[1];  // up to the next heading of the same level or above
while (e && !(/^H[1-6]$/.test(e.tagName) && +e.tagName[1] <= level)) { text += e.innerText + '\\n'; e = e.nextElementSibling; }
return {text: text, top: h.getBoundingClientRect().top, height: window.innerHeight};
"""


def check_page(path, screenshot=None, section=None) -> dict:
    """``{"errors": [console messages of level SEVERE], "images": n, "broken": [alt of images not loaded],
    "title": ...}`` of a local HTML file; with ``screenshot`` a PNG of its first screen (1280 x 1600) is written there,
    and with ``section`` (a heading's text) ``"section"`` is that section's text as shown, where its heading starts
    and the window's height."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chrome, driver_path = chromium_paths()
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        drv.set_window_size(1280, 1600)
        drv.get(Path(path).resolve().as_uri())
        shown = drv.execute_script(_SECTION_JS, section) if section else None
        if screenshot:
            drv.save_screenshot(str(screenshot))
        images = drv.execute_script(
            "return Array.from(document.images).map(i => [i.alt, i.complete && i.naturalWidth > 0]);")
        logs = drv.get_log("browser")
        return {"errors": [e["message"] for e in logs if e.get("level") == "SEVERE"], "images": len(images),
                "broken": [alt for alt, ok in images if not ok], "title": drv.title, "section": shown}
    finally:
        drv.quit()
