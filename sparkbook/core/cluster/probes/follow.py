"""Wraps a worker rank of `vllm serve`: once the head's API has answered, the rank ends (its whole process
group) when the API stops answering, so a head that dies leaves no orphan rank. No probe: it prints no
document, main() exits with the wrapped command's status.

usage: python3 -c SOURCE HOST PORT vllm serve ...   (SOURCE = probes.source("follow"))
"""
import os
import signal
import socket
import subprocess
import sys
import time


def main():
    host, port, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if argv[0] == "vllm":
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", *argv[1:]]
    child = subprocess.Popen(argv)
    seen = missed = 0
    while child.poll() is None:
        time.sleep(2)
        try:
            socket.create_connection((host, port), 2).close()
            seen, missed = 1, 0
        except OSError:
            missed += seen
        if missed >= 3:
            print(f"sparkbook: the head's API at {host}:{port} is gone: ending this rank", flush=True)
            child.terminate()
            try:
                child.wait(15)
            finally:
                os.killpg(0, signal.SIGKILL)
    sys.exit(child.wait())
