"""cProfile every thread of one gpufleet command (cProfile alone sees only the main thread,
and gpufleet works in a thread per host): prints the merged top functions at exit.

    python3 bench/profile_threads.py -i fleet.yaml status --all --json > /dev/null

Times are per-thread wall inside each function, so with many threads they include waiting for
the GIL; use them to find where the Python work is, and `time`/cgroups for CPU totals.
"""
import atexit
import cProfile
import pstats
import sys
import threading

from gpufleet.cli import main

profs = []
_orig = threading.Thread.run


def run(self):
    p = cProfile.Profile()
    profs.append(p)
    p.enable()
    try:
        _orig(self)
    finally:
        p.disable()


threading.Thread.run = run
main_p = cProfile.Profile()
profs.append(main_p)


def report():
    st = None
    for p in profs:
        try:
            st = pstats.Stats(p) if st is None else (st.add(p) or st)
        except TypeError:
            pass
    st.stream = sys.stderr  # the command's own output stays on stdout
    st.sort_stats("tottime").print_stats(35)


atexit.register(report)
sys.argv = ["gpufleet"] + sys.argv[1:]
main_p.enable()
try:
    main(sys.argv[1:])  # in-process: SystemExit at the end, so atexit reports (the program's
finally:  # own exit skips the interpreter's teardown, atexit included)
    main_p.disable()
