"""Runs the server tests (every tests/server/test_*.py, or the files named) against a built
binary: `python3 tests/server/run.py build/moeserve [test_x.py ...]`. Each file starts and stops
its own servers. Exit status: 0 all passed, 1 a failure, 77 everything skipped (CTest's skip
code). CTest registers each file separately (CMakeLists.txt, "server tests" block)."""
import glob
import os
import subprocess
import sys
import time


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: run.py MOESERVE_BINARY [test_file.py ...]")
    here = os.path.dirname(os.path.abspath(__file__))
    binary = os.path.abspath(sys.argv[1])
    files = sys.argv[2:] or sorted(glob.glob(os.path.join(here, "test_*.py")))
    codes = {}
    for f in files:
        path = f if os.path.exists(f) else os.path.join(here, f)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, path, binary, os.path.dirname(here)], cwd=here)
        codes[os.path.basename(path)] = rc
        print("== %s: %s (%.1fs)" % (os.path.basename(path),
                                     {0: "ok", 77: "skipped"}.get(rc, "FAILED rc=%d" % rc),
                                     time.monotonic() - t0), flush=True)
    if any(rc not in (0, 77) for rc in codes.values()):
        sys.exit(1)
    sys.exit(77 if codes and all(rc == 77 for rc in codes.values()) else 0)


if __name__ == "__main__":
    main()
