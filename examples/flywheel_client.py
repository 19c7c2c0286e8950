"""What the examples share: Flywheel's feedback and training-status routes (plain HTTP, the
official `openai` package does not know them), waiting for the trainer, and saving a run."""

import csv
import os
import json
import time
import urllib.request


def post(url, path, body, key):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, json.loads(r.read())


def status(url, model, key):
    """The adapter's entry of GET /v1/train/status."""
    req = urllib.request.Request(url + "/v1/train/status")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["adapters"][model]


def wait_trained(url, model, key, before, timeout=300):
    """Wait until a step after `before` (a status) trained (a new version) or dropped a group."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = status(url, model, key)
        if (st["steps"] > before["steps"]
                or sum(st["dropped"].values()) > sum(before["dropped"].values())):
            return
        time.sleep(0.05)


def save_csv(rows, out):
    """Write the run's rows and print the mean reward of its first and last thirds."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    k = max(1, len(rows) // 3)
    first = sum(r["mean_reward"] for r in rows[:k]) / k
    last = sum(r["mean_reward"] for r in rows[-k:]) / k
    print(f"mean reward: first {k} steps {first:.2f}, last {k} steps {last:.2f}; "
          f"{rows[-1]['seconds']:.0f} s, {rows[-1]['seconds'] / len(rows):.1f} s per step")


def pyplot():
    """matplotlib's pyplot without a display, or None when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None
