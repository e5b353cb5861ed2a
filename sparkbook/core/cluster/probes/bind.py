"""Can this host bind HOST:PORT as uvicorn does (SO_REUSEADDR)? The error if it cannot.

usage: python3 -c SOURCE HOST PORT   (SOURCE = probes.source("bind")) -> {"bound": bool, "error": str}
"""
import socket
import sys


def main():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((sys.argv[1], int(sys.argv[2])))
        return {"bound": True, "error": ""}
    except OSError as exc:
        return {"bound": False, "error": f"OSError: {exc}"}
    finally:
        s.close()
