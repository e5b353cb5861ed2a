"""The IPv4 address of a network device as this host (or a host-network container) sees it; no `ip` needed.

usage: python3 -c SOURCE NETDEV   (SOURCE = probes.source("netdev_ips")) -> {"addresses": [...]}, empty without one
"""
import fcntl
import socket
import struct
import sys

SIOCGIFADDR = 0x8915


def main():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", sys.argv[1].encode()[:15]))
        return {"addresses": [socket.inet_ntoa(raw[20:24])]}
    except OSError:
        return {"addresses": []}
