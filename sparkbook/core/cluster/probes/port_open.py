"""Does HOST:PORT accept a TCP connection (within 2 s)?

usage: python3 -c SOURCE HOST PORT   (SOURCE = probes.source("port_open")) -> {"open": bool, "error": str}
"""
import socket
import sys


def main():
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), 2).close()
        return {"open": True, "error": ""}
    except OSError as exc:
        return {"open": False, "error": f"{type(exc).__name__}: {exc}"}
