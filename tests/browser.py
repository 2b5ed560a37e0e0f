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


def check_page(path) -> dict:
    """``{"errors": [console messages of level SEVERE], "images": n, "broken": [alt of images not loaded],
    "title": ...}`` of a local HTML file."""
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
        drv.get(Path(path).resolve().as_uri())
        images = drv.execute_script(
            "return Array.from(document.images).map(i => [i.alt, i.complete && i.naturalWidth > 0]);")
        logs = drv.get_log("browser")
        return {"errors": [e["message"] for e in logs if e.get("level") == "SEVERE"], "images": len(images),
                "broken": [alt for alt, ok in images if not ok], "title": drv.title}
    finally:
        drv.quit()
