"""The live dashboard (`GET /dashboard`) in a real browser: headless Chromium (Debian's
`chromium` package, which scripts/test installs; skipped with a message without it) loads the
page of a server that is learning on the default model, after a few training steps driven here
over HTTP, and the numbers it shows are `/v1/train/status`'s: the version, the optimizer steps,
the last step's reward; its reward chart has one point per step of `/v1/train/{name}/history`.
A screenshot is saved (to `$FLYWHEEL_DASHBOARD_SHOT` when set: the README's picture is one)."""

import html.parser
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import KEY, http, running  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(*args):
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--hide-scrollbars", "--virtual-time-budget=8000", *args],
        capture_output=True, text=True, timeout=120)


class Cards(html.parser.HTMLParser):
    """What the page shows per adapter card: its data attributes, its stats by label, and the
    reward chart's number of points."""

    def __init__(self):
        super().__init__()
        self.cards, self.card, self.stat, self.text = {}, None, None, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and "adapter" in (a.get("class") or ""):
            self.card = {"attrs": a, "stats": {}, "points": [], "chips": {}}
            self.cards[a["data-adapter"]] = self.card
        elif self.card is not None and tag == "span" and "chip" in (a.get("class") or ""):
            self.card["chips"][a["data-version"]] = a["data-status"]
        elif self.card is not None and tag == "div" and "stat" in (a.get("class") or "").split():
            self.stat, self.text = [], []
        elif self.card is not None and tag == "svg" and "data-points" in a:
            self.card["points"].append(int(a["data-points"]))

    def handle_data(self, data):
        if self.stat is not None:
            self.text.append(data)

    def handle_endtag(self, tag):
        if tag == "b" and self.stat is not None:
            self.stat.append("".join(self.text))
            self.text = []
        elif tag == "span" and self.stat is not None and len(self.stat) == 1:
            self.card["stats"]["".join(self.text)] = self.stat[0]
            self.stat = None


def test_the_dashboard_shows_the_live_numbers_in_a_browser(tmp_path):
    if CHROMIUM is None:
        pytest.skip("no chromium: scripts/test installs Debian's package (apt-get install chromium)")
    args = ["--api-key", KEY, "--learn", "brief", "--data-dir", str(tmp_path / "data")]
    with running(args) as base:
        # An evaluation set: each version's answer to one prompt, scored by its length.
        st, _, body = http("POST", base + "/v1/adapters/brief/train", {
            "eval": [{"messages": [{"role": "user", "content": "Describe the sea."}],
                      "scorer": "length", "max_tokens": 6}],
            "eval_max_tokens": 8})
        assert st == 200, body
        steps = 3

        def brief():
            return json.loads(http("GET", base + "/v1/train/status")[2])["adapters"]["brief"]

        # A group whose four answers are equally long carries no signal and is dropped
        # (`no_variance`): another is sampled then, up to 10 groups in all.
        for _ in range(10):
            before = brief()
            if before["steps"] >= steps:
                break
            st, _, body = http("POST", base + "/v1/chat/completions", {
                "model": "brief", "n": 4, "max_tokens": 12, "temperature": 1.0,
                "messages": [{"role": "user", "content": "Describe the sea."}]})
            assert st == 200, body
            r = json.loads(body)
            # Shorter is better (the brevity task), so the rewards differ.
            items = [{"id": r["id"], "choice": c["index"],
                      "reward": 1.0 / (1 + len(c["message"]["content"]))} for c in r["choices"]]
            st, _, body = http("POST", base + "/v1/feedback", items)
            assert st == 202, body
            flat = len({i["reward"] for i in items}) == 1
            deadline = time.time() + 120
            while True:
                status = brief()
                if status["steps"] > before["steps"]:
                    break
                no_signal = status["dropped"].get("no_variance", 0)
                if flat and no_signal > before["dropped"].get("no_variance", 0):
                    break
                assert time.time() < deadline, status
                time.sleep(0.2)
        assert brief()["steps"] >= steps, brief()
        st, _, page = http("GET", base + "/dashboard", key=None)
        assert st == 200 and b"<svg" not in page[:200], page[:200]
        url = f"{base}/dashboard?key={KEY}"
        out = chromium("--dump-dom", url)
        assert out.returncode == 0, out.stderr[-2000:]
        status = json.loads(http("GET", base + "/v1/train/status")[2])["adapters"]["brief"]
        history = json.loads(http("GET", base + "/v1/train/brief/history")[2])
        versions = json.loads(http("GET", base + "/v1/adapters/brief/versions")[2])
        shot = tmp_path / "dashboard.png"
        taken = chromium("--screenshot=" + str(shot), "--window-size=1280,1300", url)
        assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
        if os.environ.get("FLYWHEEL_DASHBOARD_SHOT"):
            shutil.copy(shot, os.environ["FLYWHEEL_DASHBOARD_SHOT"])
    p = Cards()
    p.feed(out.stdout)
    assert "brief" in p.cards, out.stdout[-3000:]
    card = p.cards["brief"]
    print("dashboard shows:", json.dumps(card))
    assert card["attrs"]["data-version"] == str(status["version"])
    assert card["stats"]["version"] == str(status["version"])
    assert card["stats"]["optimizer steps"] == str(status["steps"]) == str(steps)
    # The page's number format: three significant digits, as JavaScript prints them.
    assert float(card["stats"]["last reward"]) == float(f"{status['last']['reward_mean']:.3g}")
    assert len(history["steps"]) == steps
    # Six line charts (eval score, reward, KL, entropy, clip fraction, step time), one point per
    # step.
    assert card["points"] == [steps] * 6, card
    assert all(s["eval"]["version"] == s["version"] for s in history["steps"]), history
    # The version timeline: every version the versions route lists, the serving one marked.
    assert card["chips"] == {str(v["version"]): v["status"] for v in versions["data"]}, card
    assert card["chips"][str(status["version"])] == "serving", card
