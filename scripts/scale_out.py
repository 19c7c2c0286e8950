"""Scale-out on one machine: one PostgreSQL, one trainer and N serving replicas (see docs/proofs.md,
"Scaling out"). The replicas load the trainer's versions from a shared data directory, or, with
--adapter-store / --moto, fetch them from an object store into data directories of their own.

    python3 scripts/scale_out.py [--pg-url postgres://...] [--replicas 2] [--learn brief]
        [--adapter-store file:///dir | s3://bucket/prefix | --moto]
        # starts the roles (and a throwaway PostgreSQL when no URL is given; with --moto a
        # throwaway S3-compatible server, PyPI's moto[server]), prints their addresses, and
        # waits for Ctrl-C
    python3 scripts/scale_out.py --bench [--rounds 20] [--rewards 400] [...]
        # measures, then stops everything: version propagation (the trainer's commit -> each
        # replica serving the version: p50/p99 from the replicas' own histogram and from
        # polling), rewards per second through the replicas into PostgreSQL, and the tokens per
        # second of 16 concurrent streams through one replica vs round-robin over all of them
        # (alternating, medians of 3)

Without --pg-url it needs PostgreSQL's binaries (Debian's postgresql package; run as root it
starts the server as the postgres user). An s3:// store takes its settings from AWS_* in the
environment. Everything binds 127.0.0.1."""

import argparse
import concurrent.futures as cf
import glob
import json
import os
import pathlib
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = ROOT / "target" / "release" / "flywheel"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
KEY = "scale-out-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, timeout=120):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {KEY}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class Postgres:
    """A throwaway server: initdb in a temporary folder, trust auth, loopback only."""

    def __init__(self):
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
        if not bins:
            sys.exit("no PostgreSQL binaries: install postgresql or give --pg-url")
        self.bin = pathlib.Path(bins[-1])
        self.dir = tempfile.mkdtemp(prefix="flywheel-pg-")
        self.user = "postgres" if os.geteuid() == 0 else None
        if self.user:
            shutil.chown(self.dir, self.user, self.user)
        data = os.path.join(self.dir, "data")
        subprocess.run([str(self.bin / "initdb"), "-D", data, "-U", "flywheel", "--auth=trust",
                        "-E", "UTF8", "--no-sync"], check=True, user=self.user,
                       stdout=subprocess.DEVNULL)
        self.port = free_port()
        self.proc = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", data, "-p", str(self.port), "-k", self.dir,
             "-c", "listen_addresses=127.0.0.1"],
            user=self.user, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while time.time() < deadline:
            if subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p",
                               str(self.port)], stdout=subprocess.DEVNULL).returncode == 0:
                break
            time.sleep(0.1)
        self.url = f"postgres://flywheel@127.0.0.1:{self.port}/postgres"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


class Moto:
    """A throwaway S3-compatible server (moto's server mode) with one bucket; its settings go
    into this process's environment, which the roles inherit."""

    def __init__(self):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1",
             "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 30
        while True:
            try:
                req = urllib.request.Request(endpoint + "/flywheel", method="PUT")
                if urllib.request.urlopen(req, timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or self.proc.poll() is not None:
                sys.exit("moto did not start: pip install 'moto[server]'")
            time.sleep(0.1)
        os.environ.update(AWS_ENDPOINT=endpoint, AWS_ALLOW_HTTP="true", AWS_REGION="us-east-1",
                          AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
        self.url = "s3://flywheel/team"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def start_role(role, url, data, learn, config, store=None):
    port = free_port()
    if store:
        # Its own data directory: versions come through the adapter store.
        data = os.path.join(data, f"{role}-{port}")
        os.makedirs(data)
    log = open(os.path.join(data, f"{role}-{port}.log"), "w")
    proc = subprocess.Popen(
        [str(BIN), "serve", "--model", str(MODEL), "--host", "127.0.0.1", "--port", str(port),
         "--api-key", KEY, "--learn", learn, "--rollout-store", url, "--data-dir", data,
         "--role", role, "--config", config] + (["--adapter-store", store] if store else []),
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if http("GET", base + "/health", timeout=5)[0] == 200:
                return proc, base
        except OSError:
            pass
        if proc.poll() is not None:
            sys.exit(f"the {role} process exited: see {log.name}")
        time.sleep(0.1)
    sys.exit(f"the {role} process did not become ready: see {log.name}")


def version(base, learn):
    return http("GET", base + "/v1/train/status")[1]["adapters"][learn]["version"]


def histogram(base, name, labels=""):
    """(bucket upper bounds, cumulative counts) of a Prometheus histogram in /metrics
    (`labels`: its other labels as exposed, e.g. 'op="fetch",')."""
    req = urllib.request.Request(base + "/metrics")
    text = urllib.request.urlopen(req, timeout=30).read().decode()
    pairs = [(float(m.group(1).replace("+Inf", "inf")), float(m.group(2)))
             for m in re.finditer(name + r'_bucket\{' + labels + r'le="([^"]+)"\} (\S+)', text)]
    return pairs


def quantile(pairs, q):
    total = pairs[-1][1]
    for le, c in pairs:
        if c >= q * total:
            return le
    return float("inf")


def bench(trainer, replicas, learn, rounds, n_rewards):
    prop = []
    for r in range(rounds):
        a, b = replicas[r % len(replicas)], replicas[(r + 1) % len(replicas)]
        v0 = version(trainer, learn)
        st, out = http("POST", a + "/v1/chat/completions", {
            "model": learn, "messages": [{"role": "user", "content": f"Say a word ({r})."}],
            "n": 4, "max_tokens": 8, "temperature": 1.0})
        assert st == 200, out
        items = [{"id": out["id"], "choice": i, "reward": float(i % 2)} for i in range(4)]
        st, body = http("POST", b + "/v1/feedback", items)
        assert st == 202, body
        deadline = time.time() + 120
        while version(trainer, learn) == v0:
            assert time.time() < deadline, "the trainer did not publish"
            time.sleep(0.005)
        t0 = time.time()
        for rep in replicas:
            while version(rep, learn) == v0:
                assert time.time() < deadline, "a replica did not follow"
                time.sleep(0.001)
            prop.append(time.time() - t0)
    print(f"propagation over {rounds} versions x {len(replicas)} replicas, seen by polling "
          f"(trainer's status -> replica's status): p50 {statistics.median(prop) * 1e3:.1f} ms, "
          f"max {max(prop) * 1e3:.1f} ms")
    for rep in replicas:
        h = histogram(rep, "flywheel_replica_propagation_seconds")
        print(f"  {rep}: commit -> served (its histogram, bucket bounds): "
              f"p50 <= {quantile(h, 0.5) * 1e3:.0f} ms, p99 <= {quantile(h, 0.99) * 1e3:.0f} ms "
              f"({int(h[-1][1])} versions)")
        f = histogram(rep, "flywheel_adapter_store_seconds", 'op="fetch",')
        if f and f[-1][1] > 0:
            print(f"    of which fetching from the adapter store: p50 <= "
                  f"{quantile(f, 0.5) * 1e3:.0f} ms, p99 <= {quantile(f, 0.99) * 1e3:.0f} ms")
    u = histogram(trainer, "flywheel_adapter_store_seconds", 'op="upload",')
    if u and u[-1][1] > 0:
        print(f"  trainer: uploading a version (before its commit): p50 <= "
              f"{quantile(u, 0.5) * 1e3:.0f} ms, p99 <= {quantile(u, 0.99) * 1e3:.0f} ms")
    # Rewards per second: completions first (the base model, one token each, not logged...
    # so through the learning adapter), then single rewards posted concurrently across replicas.
    ids = []
    while len(ids) < n_rewards:
        st, out = http("POST", replicas[len(ids) % len(replicas)] + "/v1/completions", {
            "model": learn, "prompt": "x", "n": 8, "max_tokens": 1, "temperature": 1.0})
        assert st == 200, out
        ids += [(out["id"], i) for i in range(8)]
    ids = ids[:n_rewards]
    random.shuffle(ids)
    t0 = time.time()
    with cf.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(
            lambda k: http("POST", replicas[k % len(replicas)] + "/v1/feedback",
                           {"id": ids[k][0], "choice": ids[k][1], "reward": 0.5})[0],
            range(len(ids))))
    dt = time.time() - t0
    assert all(c == 202 for c in codes), set(codes)
    print(f"rewards: {len(ids)} single-reward posts, 16 clients across {len(replicas)} replicas: "
          f"{len(ids) / dt:.0f} per second (each committed in PostgreSQL before its 202)")


def throughput(replicas, learn, streams=16, tokens=64, runs=3):
    def one(bases):
        t0 = time.time()
        with cf.ThreadPoolExecutor(streams) as pool:
            outs = list(pool.map(lambda k: http("POST", bases[k % len(bases)] +
                                                "/v1/chat/completions", {
                "model": learn, "messages": [{"role": "user", "content": f"Tell a story {k}."}],
                "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0}), range(streams)))
        assert all(st == 200 for st, _ in outs), [o for o in outs if o[0] != 200][:1]
        n = sum(o["usage"]["completion_tokens"] for _, o in outs)
        return n / (time.time() - t0)
    single, spread = [], []
    for _ in range(runs):
        single.append(one(replicas[:1]))
        spread.append(one(replicas))
    a, b = statistics.median(single), statistics.median(spread)
    print(f"throughput, {streams} streams x {tokens} tokens through '{learn}': one replica "
          f"{a:.1f} tok/s, round-robin over {len(replicas)} {b:.1f} tok/s (ratio {b / a:.2f}; "
          f"medians of {runs}, alternating; all processes share this machine's "
          f"{os.cpu_count()} cores)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pg-url")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--learn", default="brief")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--rewards", type=int, default=400)
    ap.add_argument("--adapter-store", help="file:///dir or s3://bucket/prefix")
    ap.add_argument("--moto", action="store_true",
                    help="an adapter store on a throwaway moto server (s3://)")
    a = ap.parse_args()
    pg = None if a.pg_url else Postgres()
    url = a.pg_url or pg.url
    moto = Moto() if a.moto else None
    store = moto.url if moto else a.adapter_store
    data = tempfile.mkdtemp(prefix="flywheel-shared-")
    config = os.path.join(data, "serve.toml")
    with open(config, "w") as f:
        # Small steps (one group each) so that versions publish often.
        f.write("[online]\nreward_min = 0.0\nreward_max = 1.0\ngroup_timeout_secs = 1.0\n"
                f"[[learn]]\nname = \"{a.learn}\"\nlr = 0.0001\n")
    procs = []
    try:
        p, trainer = start_role("train", url, data, a.learn, config, store)
        procs.append(p)
        replicas = []
        for _ in range(a.replicas):
            p, base = start_role("serve", url, data, a.learn, config, store)
            procs.append(p)
            replicas.append(base)
        print(f"PostgreSQL {url}\nadapter store {store or '(the shared data directory)'}\n"
              f"data {data}\ntrainer {trainer}\nreplicas " + " ".join(replicas), flush=True)
        if a.bench:
            bench(trainer, replicas, a.learn, a.rounds, a.rewards)
            throughput(replicas, a.learn)
        else:
            print("Ctrl-C stops them all.")
            while all(p.poll() is None for p in procs):
                time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
        if pg:
            pg.stop()
        if moto:
            moto.stop()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
