"""Exit 0 when the DNS server at argv[1] answers an A query for argv[2] (default: the API
server's Service name) with at least one record. Used by start.sh; standard library only."""

import socket
import struct
import sys


def main() -> int:
    server = sys.argv[1]
    name = sys.argv[2] if len(sys.argv) > 2 else "kubernetes.default.svc.cluster.local"
    query = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    query += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    query += struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(2)
        s.sendto(query, (server, 53))
        answer = s.recv(512)
    _, flags, _, ancount = struct.unpack(">HHHH", answer[:8])
    return 0 if flags & 0x000F == 0 and ancount > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
