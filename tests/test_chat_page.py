"""The chat page at GET / (runtime/server/webui/): served without the API key and off with --no-webui; and, in a real
headless browser (Debian's chromium driven by selenium) against a real `oval-edge serve` of the bundled model, it
shows the model and the pool, streams an answer, keeps a multi-turn history, sends the key as a Bearer token, and
its Stop button makes the server cancel the request and free its pages.

Set CHAT_PAGE_SCREENSHOT=docs/images/chat-page.png to write the screenshot that docs/chat-page.md shows (the test
always takes one, into its tmp folder).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import threading

import pytest
from fastapi.testclient import TestClient

from oval_edge.runtime.server.app import ServerSettings, create_app
from oval_edge.runtime.server.serve import add_arguments

KEY = "chat-page-test-key"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _app(**settings):
    never = threading.Event()  # the engine never loads: the page is static and needs none
    return create_app(ServerSettings(model_name="smol-test", **settings), lambda: never.wait(600))


def test_the_page_is_served_at_root_without_the_key_and_the_api_still_needs_it():
    client = TestClient(_app(api_key=KEY))  # no `with`: no lifespan, nothing loads
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script>" in page.text and "v1/chat/completions" in page.text
    policy = page.headers["content-security-policy"]
    assert "connect-src 'self'" in policy and re.search(r"script-src 'sha256-[A-Za-z0-9+/=]{44}'", policy)
    assert "http://" not in page.text and "https://" not in page.text  # nothing loaded from elsewhere (offline)
    assert client.head("/").status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.parametrize("api_key, status", [(None, 404), (KEY, 401)])
def test_no_webui_leaves_root_unserved(api_key, status):
    client = TestClient(_app(api_key=api_key, webui=False))
    assert client.get("/").status_code == status  # with a key, / is an ordinary guarded path again
    with pytest.raises(ValueError, match="webui='no' must be true or false"):
        ServerSettings(model_name="m", webui="no")


def test_serve_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).webui is True and parser.parse_args(["--no-webui"]).webui is False


# ---- the real browser against the real server


def _browser_or_skip():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install -y chromium "
                    "chromium-driver; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is in the test extras: pip install -e '.[test]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=900,640"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(driver))


@pytest.fixture(scope="module")
def served():
    """`oval-edge serve` of the bundled model, with an API key, on a free loopback port."""
    from oval_edge.tools.load.server import AutoServer

    server = AutoServer("--max-batch 2 --max-context 2048 --shutdown-grace 5", api_key=KEY).start()
    try:
        server.wait_ready(600, {"Authorization": f"Bearer {KEY}"})
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(served):
    driver = _browser_or_skip()
    try:
        yield driver
    finally:
        driver.quit()


# Records, inside the page, each body the page POSTs and each text the streaming answer shows (a MutationObserver on
# the messages), so the test sees the stream arrive in pieces rather than reading only the end state. WebDriver's
# scripts are not subject to the page's CSP.
RECORDER = """
window.__bodies = [];
window.__shown = [];
const fetchOriginal = window.fetch;
window.fetch = (url, init) => {
  if (init && init.body) window.__bodies.push(JSON.parse(init.body));
  return fetchOriginal(url, init);
};
new MutationObserver(() => {
  const live = document.querySelector('.msg.assistant.streaming span');
  if (live && live.textContent && window.__shown[window.__shown.length - 1] !== live.textContent)
    window.__shown.push(live.textContent);
}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
"""


def _metrics(served) -> dict[str, float]:
    from oval_edge.tools.load.report import parse_metrics

    from test_server_support import get

    response = get(served.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    return parse_metrics(response.text)


def _model_id(served) -> str:
    from test_server_support import get

    response = get(served.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    return response.json()["data"][0]["id"]


def _ask(browser, wait, text: str) -> tuple[str, str]:
    """Type `text`, press Enter, wait for the answer's closing line; returns the answer's text and that line."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    answers = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    browser.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")) > answers)
    answer = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    return answer.find_element(By.TAG_NAME, "span").text, answer.find_element(By.CLASS_NAME, "meta").text


@pytest.mark.slow
def test_chat_page_in_a_headless_browser(served, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 120, poll_frequency=0.05)
    browser.get(served.url + "/")
    wait.until(lambda d: d.find_element(By.ID, "model").text == "API key needed (Settings)")
    model_id = _model_id(served)

    # The key, typed into the page, is what /v1/models and /metrics then get as a Bearer token.
    browser.find_element(By.ID, "api-key").send_keys(KEY, "\t")
    wait.until(lambda d: d.find_element(By.ID, "model").text == model_id)
    total = int(_metrics(served)["oval_edge_kv_pages_total"])
    wait.until(lambda d: re.fullmatch(rf"\d+ / {total} pages used", d.find_element(By.ID, "pool").text))

    browser.execute_script(RECORDER)
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("48")
    first, meta = _ask(browser, wait, "Name three colours of the rainbow.")
    assert first and re.search(r"\d+ tokens", meta) and "finish:" in meta, (first, meta)
    shown = browser.execute_script("return window.__shown")
    assert len(shown) >= 3 and shown[-1] == first, shown  # it arrived in pieces, each a prefix of the next
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:])), shown
    shot = tmp_path / "chat-page.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes().startswith(PNG_MAGIC)
    if os.environ.get("CHAT_PAGE_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["CHAT_PAGE_SCREENSHOT"])

    # The second turn carries the first: the whole history, the answer as it was shown.
    second, _ = _ask(browser, wait, "Which of them is warmest?")
    bodies = browser.execute_script("return window.__bodies")
    assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]
    assert bodies[1]["messages"][1]["content"] == first and bodies[1]["stream"] is True and second

    # Stop mid-stream: the fetch is aborted, the server cancels the request and every page comes back.
    cancelled = _metrics(served).get("oval_edge_requests_cancelled_total", 0.0)
    max_tokens.clear()
    max_tokens.send_keys("1500")
    browser.find_element(By.ID, "prompt").send_keys("Write a very long story about a lighthouse keeper.\n")
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant.streaming span").text)
    browser.find_element(By.ID, "stop").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")[-1].text == "stopped")
    assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
    WebDriverWait(browser, 30, poll_frequency=0.2).until(
        lambda _: _metrics(served).get("oval_edge_requests_cancelled_total", 0.0) == cancelled + 1
        and _metrics(served)["oval_edge_kv_pages_used"] == 0 and _metrics(served)["oval_edge_requests_running"] == 0)

    # Nothing went wrong inside the page: no script error, no CSP refusal; the only failed loads are the 401s from
    # before the key was typed.
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe and all(e["source"] == "network" and " 401 " in e["message"] for e in severe), severe
