"""Watch the servers behind the front while 05 replaces one (tests/gpu/front.sh second|third): every 0.25 s each
backend's /health (200, another status, or `refused`) and, every 1 s, the GPU's compute processes (pid, MiB); prints
each change with the wall-clock epoch, and at SIGTERM each backend's first and last answer. Read beside the load's
records (front_load.py prints its t0 epoch): the old server's drain is from its last 200 to its process leaving the
GPU; the new server's start from its process appearing to its first 200.

usage: python3 port_watch.py URL [URL ...]"""
import signal
import subprocess
import sys
import time

import httpx

stop = False


def _stop(*_):
    global stop
    stop = True


def gpu_apps() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi: {exc}"
    return " ".join(sorted(line.replace(" ", "") for line in out.splitlines() if line.strip())) or "none"


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    urls = [u.rstrip("/") for u in sys.argv[1:]]
    last: dict[str, str] = {}
    first_ok: dict[str, float] = {}
    last_ok: dict[str, float] = {}
    apps, apps_at = None, 0.0
    with httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0)) as client:
        while not stop:
            now = time.time()
            for u in urls:
                try:
                    state = str(client.get(f"{u}/health").status_code)
                except httpx.ConnectError:
                    state = "refused"
                except httpx.HTTPError as exc:
                    state = type(exc).__name__
                if state == "200":
                    first_ok.setdefault(u, now)
                    last_ok[u] = now
                if last.get(u) != state:
                    print(f"{now:.2f} {time.strftime('%H:%M:%S', time.gmtime(now))} {u} {state}", flush=True)
                    last[u] = state
            if now - apps_at >= 1.0:
                apps_at, a = now, gpu_apps()
                if a != apps:
                    print(f"{now:.2f} {time.strftime('%H:%M:%S', time.gmtime(now))} gpu {a}", flush=True)
                    apps = a
            time.sleep(0.25)
    for u in urls:
        print(f"{u}: first 200 {first_ok.get(u, 0):.2f}, last 200 {last_ok.get(u, 0):.2f}", flush=True)


main()
