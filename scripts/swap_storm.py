"""Swap storm against a running server: N streaming chat workers on one adapter, first alone for
a while, then while a publisher posts `--versions` new versions of it (alternating two PEFT
folders). Prints inter-token latency p50/p99 of the streams before and during the storm, the
publish rate, and checks that no request failed and that every stream reported one version.

    flywheel serve --port 8080 &
    python3 scripts/swap_storm.py --url http://127.0.0.1:8080 --a DIR_A --b DIR_B [--streams 16]

Loopback only; every loop is bounded by a count and a deadline.
"""

import argparse
import json
import threading
import time
import urllib.request


def post(url, body, timeout=60):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def stream(url, model, seed, max_tokens):
    """(versions seen, [(arrival, gap)]) of one streamed chat completion."""
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me a story number {seed}."}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    versions, gaps, last = set(), [], None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            c = json.loads(line[6:])
            if "error" in c:
                raise RuntimeError(c)
            versions.add(c["adapter_version"])
            if c["choices"] and c["choices"][0]["delta"].get("content"):
                now = time.monotonic()
                if last is not None:
                    gaps.append((now, now - last))
                last = now
    return versions, gaps


def itl_buckets(url):
    """The server's own inter-token histogram: {upper bound: cumulative count}."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("flywheel_inter_token_latency_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.split()[-1])
    return out


def bucket_quantile(before, after, q):
    """Upper bound of the bucket holding quantile q of the observations between two scrapes."""
    bounds = sorted(after)
    total = after[bounds[-1]] - before.get(bounds[-1], 0)
    for b in bounds:
        if after[b] - before.get(b, 0) >= q * total:
            return b, int(total)
    return float("inf"), int(total)


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * p))] if v else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--a", required=True, help="PEFT folder for odd versions")
    ap.add_argument("--b", required=True, help="PEFT folder for even versions")
    ap.add_argument("--name", default="storm")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--versions", type=int, default=1000)
    ap.add_argument("--quiet-secs", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--deadline", type=float, default=600)
    ap.add_argument("--interval", type=float, default=0.0, help="seconds between publishes (0: back to back)")
    a = ap.parse_args()
    post(a.url + "/v1/adapters", {"name": a.name, "path": a.a})
    stop = threading.Event()
    results, errors = [], []
    deadline = time.monotonic() + a.deadline

    def worker(w):
        k = 0
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                results.append(stream(a.url, a.name, 1000 * w + k, a.max_tokens))
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(repr(e))
            k += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(a.streams)]
    for t in threads:
        t.start()
    time.sleep(2)
    m0 = itl_buckets(a.url)
    time.sleep(a.quiet_secs)
    m1 = itl_buckets(a.url)
    t0 = time.monotonic()
    publish = []
    for v in range(a.versions):
        s = time.monotonic()
        status, _ = post(a.url + "/v1/adapters", {"name": a.name, "path": a.a if v % 2 else a.b})
        publish.append(time.monotonic() - s)
        assert status == 200, status
        if a.interval:
            time.sleep(max(0.0, a.interval - (time.monotonic() - s)))
    t1 = time.monotonic()
    m2 = itl_buckets(a.url)
    stop.set()
    for t in threads:
        t.join()
    gaps = [g for _, gs in results for g in gs]
    quiet = [d for t, d in gaps if t < t0]
    storm = [d for t, d in gaps if t0 <= t <= t1]
    mixed = sum(1 for vs, _ in results if len(vs) != 1)
    print(f"{len(results)} streams, {len(errors)} failed, {mixed} with more than one version")
    print(f"storm: {a.versions} versions in {t1 - t0:.1f} s ({a.versions / (t1 - t0):.0f}/s; "
          f"HTTP publish p50 {pct(publish, 0.5) * 1e3:.1f} ms, p99 {pct(publish, 0.99) * 1e3:.1f} ms)")
    print(f"client-side inter-token latency before the storm: p50 {pct(quiet, 0.5) * 1e3:.1f} ms, p99 {pct(quiet, 0.99) * 1e3:.1f} ms ({len(quiet)} gaps)")
    print(f"client-side inter-token latency during the storm: p50 {pct(storm, 0.5) * 1e3:.1f} ms, p99 {pct(storm, 0.99) * 1e3:.1f} ms ({len(storm)} gaps)")
    for label, x, y in [("before", m0, m1), ("during", m1, m2)]:
        (p50, n), (p99, _) = bucket_quantile(x, y, 0.5), bucket_quantile(x, y, 0.99)
        print(f"server-side inter-token latency {label} the storm: p50 <= {p50 * 1e3:.0f} ms, "
              f"p99 <= {p99 * 1e3:.0f} ms (histogram buckets, {n} gaps)")
    if errors:
        print("first error:", errors[0])
    return 1 if errors or mixed else 0


if __name__ == "__main__":
    raise SystemExit(main())
