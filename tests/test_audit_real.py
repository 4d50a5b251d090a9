"""Many people, one GPU, on the real llama-server (`mtpwrap up --profile cpu-demo`, demo model):
named keys, the audit trail, usage, budgets and priority, with the official `openai` client.

- each audit line's token counts equal the usage llama-server itself gave the client;
- a canary prompt, the answers and the keys appear nowhere: audit file, budgets file, the
  service's log, /metrics;
- a budget gives 429 at the N+1th request, naming the budget and when it resets;
- one interactive request sent after five batch ones is admitted before all of them;
- `mtpwrap usage` totals equal the sum of the lines; a restart keeps the day's counts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from mtpwrap.errors import EXIT_CONFIG
from mtpwrap.proc import free_loopback_port
from tests.helpers import Instance, cli_env, require_tool, run_cli, wait_for

pytestmark = pytest.mark.integration

KEYS = {
    "contracts-app": "app-key-CANARY-0a1b2c3d4e",
    "nightly": "nightly-key-CANARY-5f6a7b8c",
    "limited": "limited-key-CANARY-8c9d0e1f",
    "daily": "daily-key-CANARY-1e2f3a4b",
    "ops": "ops-key-CANARY-3a4b5c6d",
}
KEY_FILE = f"""# one line per key: the name, never the key, is what the records show
{KEYS['contracts-app']} name=contracts-app scopes=inference
{KEYS['nightly']} name=nightly class=batch scopes=inference
{KEYS['limited']} name=limited rpm=3
{KEYS['daily']} name=daily tokens_per_day=40
{KEYS['ops']} name=ops scopes=metrics
"""
CANARY = "CANARY-PROMPT-9d7e61"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": f"Repeat after me: {CANARY}. Then say hello."}]


class Up:
    def __init__(self, home: Path, binary: Path, model: Path) -> None:
        self.home, self.binary, self.model = home, binary, model
        home.mkdir(parents=True, exist_ok=True)
        self.keys = home / "keys"
        self.keys.write_text(KEY_FILE)
        self.keys.chmod(0o600)
        self.log = home / "up.log"
        self.port = free_loopback_port()
        self.start()

    def start(self) -> None:
        self.inst = Instance(self.home, self.port, self.binary, self.model, log=self.log,
                             MTPWRAP_API_KEY_FILE=str(self.keys))
        self.inst.wait_ready(180)
        self.base = self.inst.base

    def stop(self) -> None:
        self.inst.proc.send_signal(signal.SIGTERM)
        self.inst.proc.wait(60)

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=KEYS[name], max_retries=0,
                             timeout=120)

    def http(self, name: str) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=120,
                            headers={"authorization": f"Bearer {KEYS[name]}"})

    @property
    def audit_files(self) -> list[Path]:
        return sorted((self.home / "audit").glob("audit-*.jsonl"))

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for f in self.audit_files
                for line in f.read_text().splitlines() if line.strip()]

    def wait_lines(self, n: int) -> list[dict[str, Any]]:
        wait_for(f"{n} audit lines", lambda: len(self.lines()) >= n, 30)
        return self.lines()

    def metrics(self) -> str:
        with self.http("ops") as c:
            r = c.get("/metrics")
        assert r.status_code == 200
        return r.text

    def gauge(self, name: str) -> float:
        m = re.search(rf"^{name} (\S+)$", self.metrics(), re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
       demo_model: Path) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("audit") / "home", llama_server_bin, demo_model)
    try:
        yield u
    finally:
        u.inst.close()


def test_audit_lines_carry_llama_servers_own_counts_and_no_text(up: Up) -> None:
    before = len(up.lines())
    app = up.client("contracts-app")
    plain = app.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12,
                                        temperature=0)
    chunks = list(app.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed_usage = next(c.usage for c in chunks if c.usage is not None)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    legacy = app.completions.create(model="demo", prompt=f"{CANARY} once upon a time",
                                    max_tokens=10, temperature=0)
    with up.http("contracts-app") as c:
        r = c.post("/v1/messages", json={"model": "demo", "max_tokens": 10,
                                         "messages": MESSAGES})
    assert r.status_code == 200, r.text
    anthropic = r.json()
    lines = up.wait_lines(before + 4)[before:]
    assert [(x["route"], x["stream"], x["key"], x["by"], x["status"]) for x in lines] == [
        ("/v1/chat/completions", False, "contracts-app", "llama-server", 200),
        ("/v1/chat/completions", True, "contracts-app", "llama-server", 200),
        ("/v1/completions", False, "contracts-app", "llama-server", 200),
        ("/v1/messages", False, "contracts-app", "llama-server", 200)]
    got = [(x["prompt_tokens"], x["completion_tokens"]) for x in lines]
    assert plain.usage is not None and legacy.usage is not None
    assert got == [
        (plain.usage.prompt_tokens, plain.usage.completion_tokens),
        (streamed_usage.prompt_tokens, streamed_usage.completion_tokens),
        (legacy.usage.prompt_tokens, legacy.usage.completion_tokens),
        # Anthropic's prompt: the tokens read and those found in llama-server's cache
        (anthropic["usage"]["input_tokens"] + anthropic["usage"].get("cache_read_input_tokens", 0),
         anthropic["usage"]["output_tokens"])]
    assert lines[0]["finish"] == plain.choices[0].finish_reason
    assert lines[1]["ttft_s"] is not None and 0 < lines[1]["ttft_s"] <= lines[1]["total_s"]
    assert all(x["class"] == "interactive" and x["client"] == "127.0.0.1" for x in lines)
    assert all(x["bytes_in"] > 0 and x["bytes_out"] > 0 for x in lines)

    # the canaries: the prompt, the answers and every key appear nowhere
    answers = [plain.choices[0].message.content or "", streamed, legacy.choices[0].text,
               anthropic["content"][0]["text"]]
    canaries = [CANARY, *KEYS.values(), *(a.strip() for a in answers if len(a.strip()) >= 12)]
    assert len(canaries) >= len(KEYS) + 2, answers
    places = {"audit": "".join(f.read_text() for f in up.audit_files),
              "log": up.log.read_text(errors="replace"), "metrics": up.metrics()}
    budgets = up.home / "audit" / "budgets.json"
    if budgets.exists():
        places["budgets"] = budgets.read_text()
    for where, text in places.items():
        for canary in canaries:
            assert canary not in text, f"{canary[:20]!r} is in the {where}"
    # the usage counters by key name
    text = places["metrics"]
    assert re.search(r'^mtpwrap_key_requests_total\{key="contracts-app",status="2xx"\} '
                     r'([0-9.]+)$', text, re.M)
    prompt = sum(x["prompt_tokens"] for x in up.lines() if x["key"] == "contracts-app")
    m = re.search(r'^mtpwrap_key_tokens_total\{key="contracts-app",kind="prompt"\} ([0-9.e+]+)$',
                  text, re.M)
    assert m and float(m.group(1)) == prompt


def test_a_budget_refuses_the_next_request_and_says_which_and_when(up: Up) -> None:
    before = len(up.lines())
    with up.http("limited") as c:
        assert [c.get("/v1/models").status_code for _ in range(3)] == [200] * 3
        r = c.get("/v1/models")
    assert r.status_code == 429
    assert r.headers["x-mtpwrap-answered-by"] == "front"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    message = r.json()["error"]["message"]
    assert "'limited' has used its budget of 3 requests per minute" in message
    assert re.search(r"resets at \d\d:\d\d:\d\d UTC", message)
    # lines are written once their answers have gone: wait for the refusal's own
    def refusals() -> list[dict[str, Any]]:
        return [x for x in up.lines()[before:] if x["key"] == "limited" and x["status"] == 429]

    wait_for("the refusal's audit line", lambda: len(refusals()) == 1, 30)
    last = refusals()[0]
    assert (last["key"], last["status"], last["by"], last["reason"]) == (
        "limited", 429, "front", "budget_rpm")
    assert re.search(r'^mtpwrap_key_refused_total\{key="limited",reason="budget_rpm"\} 1\.0$',
                     up.metrics(), re.M)


def test_an_interactive_request_is_admitted_before_queued_batch_work(up: Up) -> None:
    """cpu-demo has two slots: two streams hold them, five batch requests queue, then one
    interactive request; when the first stream lets its slot go, the interactive request takes
    it (admitted, by arrival and queue wait, before all five)."""
    results: list[Exception] = []
    release = [threading.Event(), threading.Event()]

    def hold(i: int) -> None:
        try:
            with up.http("contracts-app") as c, c.stream(
                    "POST", "/completion", json={"prompt": "Count: 1, 2, 3,", "stream": True,
                                                 "n_predict": 100000, "ignore_eos": True}) as r:
                assert r.status_code == 200
                for _chunk in r.iter_bytes():
                    if release[i].is_set():
                        break  # the client goes: the front cancels, the slot is free
        except Exception as err:  # reported by the main thread
            results.append(err)

    def short(name: str) -> None:
        try:
            up.client(name).chat.completions.create(model="demo", messages=MESSAGES,
                                                    max_tokens=4, temperature=0)
        except Exception as err:
            results.append(err)

    before = len(up.lines())
    holders = [threading.Thread(target=hold, args=(i,)) for i in (0, 1)]
    for t in holders:
        t.start()
    wait_for("both slots busy", lambda: up.gauge("mtpwrap_forwarding") == 2, 60, every=0.05)
    asks = [threading.Thread(target=short, args=("nightly",)) for _ in range(5)]
    for t in asks:
        t.start()
    wait_for("five batch requests queued", lambda: up.gauge("mtpwrap_queue_batch") == 5, 60,
             every=0.05)
    asks.append(threading.Thread(target=short, args=("contracts-app",)))
    asks[-1].start()
    wait_for("the interactive request queued",
             lambda: up.gauge("mtpwrap_queue_interactive") == 1, 60, every=0.05)
    release[0].set()
    # Which went first is read from the audit trail below (admission = time + queue wait): a
    # scrape of the queue gauges races the short requests, which end within a fraction of a
    # second and pass their slot on (on a loaded machine two batch requests had gone before a
    # scrape saw the interactive queue empty).
    wait_for("the interactive request admitted",
             lambda: up.gauge("mtpwrap_queue_interactive") == 0, 60, every=0.05)
    release[1].set()
    for t in [*holders, *asks]:
        t.join(300)
    assert not results, results

    def admitted(x: dict[str, Any]) -> float:
        from datetime import datetime

        return datetime.fromisoformat(x["time"]).timestamp() + x["queued_s"]

    def ours() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        # A line is written once its answer has gone, so a client can have its answer first;
        # and the gauges' own /metrics requests are lines too: wait for these six by key.
        lines = up.lines()[before:]
        return ([x for x in lines if x["key"] == "contracts-app"
                 and x["route"] == "/v1/chat/completions"],
                [x for x in lines if x["key"] == "nightly"])

    wait_for("the six requests' audit lines", lambda: [len(x) for x in ours()] == [1, 5], 30)
    person, batch = ours()
    assert all(x["class"] == "batch" for x in batch)
    assert person[0]["queued_s"] > 0  # it did wait
    assert all(admitted(person[0]) < admitted(b) for b in batch), (person, batch)


def test_usage_totals_equal_the_lines(up: Up) -> None:
    def totals(lines: list[dict[str, Any]]) -> dict[str, tuple[int, int, int]]:
        keys = {x["key"] for x in lines}
        return {k: (sum(x["key"] == k for x in lines),
                    sum(x["prompt_tokens"] or 0 for x in lines if x["key"] == k),
                    sum(x["completion_tokens"] or 0 for x in lines if x["key"] == k))
                for k in keys}

    def summed() -> dict[str, tuple[int, int, int]]:
        r = run_cli("usage", "--by", "key", "--json", env=cli_env(MTPWRAP_HOME=str(up.home)))
        assert r.returncode == 0, r.stderr
        return {row["key"]: (row["requests"], row["prompt_tokens"], row["completion_tokens"])
                for row in json.loads(r.stdout)["rows"]}

    # The lines of answers that ended just before (a cancelled stream's, the gauges' /metrics)
    # may still be being written: compare a reading taken while the trail did not change.
    seen: list[Any] = []

    def agree() -> bool:
        lines = up.lines()
        got = summed()
        seen[:] = [got, totals(lines)]
        return lines == up.lines() and got == totals(lines)

    try:
        wait_for("usage's totals equal the lines' sums", agree, 60, every=0.5)
    except TimeoutError:
        pytest.fail(f"mtpwrap usage said {seen[0]}, the lines sum to {seen[1]}")
    r = run_cli("usage", "--since", "yesterday", env=cli_env(MTPWRAP_HOME=str(up.home)))
    assert r.returncode == EXIT_CONFIG and "Traceback" not in r.stderr
    assert "Invalid value for --since: expected a day as YYYY-MM-DD" in r.stderr


def test_the_status_page_in_a_real_browser(up: Up, tmp_path: Path) -> None:
    """Debian's Chromium, driven by its chromedriver: the page asks for the key, then shows the
    state, the usage per key today and the last refusals, refreshing itself; no script error,
    nothing the page's Content-Security-Policy refused."""
    import base64

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    chromium = require_tool("chromium", "chromium")
    driver_bin = require_tool("chromedriver", "chromium-driver")
    # one request and one refusal (the ops key has no inference scope) for the page to show
    up.client("contracts-app").chat.completions.create(model="demo", messages=MESSAGES,
                                                       max_tokens=4)
    with up.http("ops") as c:
        assert c.get("/v1/models").status_code == 403
        bare = httpx.get(up.base + "/status")
    assert bare.status_code == 401 and bare.headers["www-authenticate"].startswith("Basic ")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1100,1000",
                f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(driver_bin), options=opts)
    try:
        basic = base64.b64encode(f"ops:{KEYS['ops']}".encode()).decode()
        browser.execute_cdp_cmd("Network.enable", {})
        browser.execute_cdp_cmd("Network.setExtraHTTPHeaders",
                                {"headers": {"Authorization": f"Basic {basic}"}})
        browser.get(up.base + "/status")
        wait = WebDriverWait(browser, 30)
        wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-loaded"))
        assert browser.find_element(By.ID, "state").text == "ready"
        assert browser.find_element(By.ID, "slots").text.endswith("of 2")
        assert browser.find_element(By.ID, "store").text == "off"  # it serves one slot
        wait.until(lambda b: "contracts-app" in b.find_element(By.ID, "usage").text)
        refusals = browser.find_element(By.ID, "refusals").text
        assert "ops" in refusals and "scope" in refusals and "403" in refusals
        first = browser.find_element(By.ID, "when").text
        wait.until(lambda b: b.find_element(By.ID, "when").text != first)  # it refreshes
        shot = Path(os.environ.get("MTPWRAP_SCREENSHOT_DIR") or tmp_path) / "status-page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 5000
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        browser.quit()


def test_a_restart_keeps_the_days_counts(up: Up) -> None:
    daily = up.client("daily")
    first = daily.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12,
                                          temperature=0)
    assert first.usage is not None and first.usage.total_tokens > 40  # the day's 40 are spent
    with pytest.raises(openai.RateLimitError, match="40 tokens per day"):
        daily.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4)
    def refused() -> int:
        return sum(x["key"] == "daily" and x["reason"] == "budget_tokens_per_day"
                   for x in up.lines())

    wait_for("the refusal's audit line", lambda: refused() == 1, 30)
    up.stop()
    up.start()
    with pytest.raises(openai.RateLimitError, match="40 tokens per day"):
        up.client("daily").chat.completions.create(model="demo", messages=MESSAGES,
                                                   max_tokens=4)
    # the trail goes on in the same file
    wait_for("the refusal's line after the restart", lambda: refused() == 2, 30)
