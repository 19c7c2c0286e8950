"""Compare two brevity runs (CSV of examples/brevity.py or scripts/trl_brevity.py): the mean reward
of the first 3 and the last 10 steps, and the seconds until the trailing mean over WINDOW steps
first reaches THRESHOLD (the reward's rise); the ratio is the second run's time over the first's.

    python3 scripts/compare_brevity.py examples/results/brevity.csv examples/results/trl_brevity.csv
"""

import csv
import sys

WINDOW = 4
THRESHOLD = 0.6


def summary(path):
    rows = list(csv.DictReader(open(path)))
    r = [float(x["mean_reward"]) for x in rows]
    t = [float(x["seconds"]) for x in rows]
    reached = next((t[i] for i in range(WINDOW - 1, len(r))
                    if sum(r[i - WINDOW + 1:i + 1]) / WINDOW >= THRESHOLD), None)
    return {"steps": len(r), "first3": sum(r[:3]) / 3, "last10": sum(r[-10:]) / min(10, len(r)),
            "seconds": t[-1], "reached": reached}


def main():
    a, b = (summary(p) for p in sys.argv[1:3])
    for name, s in zip(sys.argv[1:3], (a, b)):
        reached = f"{s['reached']:.1f} s" if s["reached"] is not None else "never"
        print(f"{name}: {s['steps']} steps in {s['seconds']:.1f} s, reward {s['first3']:.2f} (first 3)"
              f" -> {s['last10']:.2f} (last 10), trailing mean of {WINDOW} >= {THRESHOLD} at {reached}")
    if a["reached"] and b["reached"]:
        print(f"time to the rise: {b['reached'] / a['reached']:.2f}x faster in the first run")


if __name__ == "__main__":
    main()
