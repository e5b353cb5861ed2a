"""Poll BASE/v1/models every 0.5 s until SIGTERM; print each change of answer and, last, the longest time without
a 200 between two 200s (a replacement's seconds without service as a client sees it) and the time without one at
the end, if any.

usage: python3 health_gap.py BASE_URL"""
import signal
import sys
import time

import httpx

stop = False


def _stop(*_):
    global stop
    stop = True


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    url, last_ok, worst, state = sys.argv[1].rstrip("/") + "/v1/models", None, 0.0, None
    while not stop:
        try:
            ok = httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            ok = False
        now = time.monotonic()
        if ok != state:
            print(f"{time.strftime('%H:%M:%S')} {'answers' if ok else 'no answer'}", flush=True)
            state = ok
        if ok:
            if last_ok is not None:
                worst = max(worst, now - last_ok)
            last_ok = now
        time.sleep(0.5)
    dark_end = "" if state else f", none since the last answer for {time.monotonic() - (last_ok or 0):.1f} s"
    print(f"longest time without an answer between two answers: {worst:.1f} s{dark_end}", flush=True)


main()
