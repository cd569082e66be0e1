"""The fs tier's block reads and writes in a process of its own (``io_process: true``).

Every system call of a block's write (create, write, close, rename: seven for a 2 MiB block)
lets go of the interpreter's lock and takes it back. Made from the tier's I/O threads inside the
engine's process, each of those takes the lock from the engine's thread (on a 2-core VM running
vLLM's CPU build, the engine's thread blocked hundreds of times a second with the fs tier
writing, once or twice with its pool alone, 21 times with the tier writing no files; docs/vllm.md,
*I/O in helper processes*). Here the tier's
threads hand each block to one of these processes and wait on a socket: two hand-overs a block.

The process is given the tier's directory descriptor and a socket, attaches the host pool by its
handle, and answers requests one at a time until the socket closes. It reads and writes pool
slots in place, the same ``BlockFiles`` calls as the tier's threads make, and never writes to
stdout (stderr is the engine's, for a traceback).

Requests and answers are bytes (``multiprocessing.connection`` framing), no pickles:
``REQUEST`` (operation, slot, key) followed by the header for a write; ``ANSWER`` (status, errno)
followed by the header read (a read found the block) or the error's text (a write failed).
"""

from __future__ import annotations

import argparse
import os
import struct
from multiprocessing.connection import Connection

from kvtier.keys import KEY_BYTES, BlockKey
from kvtier.pool import HostPool, PoolHandle
from kvtier.tiers.fs.files import BlockFiles, Read
from kvtier.tiers.payload import HEADER_BYTES

WRITE = b"W"
READ = b"R"
REQUEST = struct.Struct(f"<cI{KEY_BYTES}s")
ANSWER = struct.Struct("<Bi")
WRITTEN = 0
WRITE_FAILED = 1
REFUSED = 255
"""A request this helper cannot take (malformed, a slot outside the pool): a failure either way,
never a read status (``Read`` values) such as ``MISSING``."""
READY = b"ready"


def write_request(slot: int, key: BlockKey, header: bytes) -> bytes:
    return REQUEST.pack(WRITE, slot, key) + header


def read_request(slot: int, key: BlockKey) -> bytes:
    return REQUEST.pack(READ, slot, key)


def answer(status: int, error: int = 0, data: bytes = b"") -> bytes:
    return ANSWER.pack(status, error) + data


def handle(message: bytes, files: BlockFiles, pool: HostPool, file_bytes: int) -> bytes:
    """One request's answer (``REFUSED`` for one it cannot take)."""
    if len(message) < REQUEST.size:
        return answer(REFUSED, 0, b"malformed request")
    op, slot, key = REQUEST.unpack_from(message)
    if not 0 <= slot < pool.num_slots:
        return answer(REFUSED, 0, b"a slot outside the pool")
    payload = pool.view(slot)
    if op == WRITE:
        header = message[REQUEST.size :]
        if len(header) != HEADER_BYTES:
            return answer(REFUSED, 0, b"malformed header")
        try:
            files.write(key, [memoryview(header), payload])
        except OSError as exc:
            return answer(WRITE_FAILED, exc.errno or 0, str(exc).encode(errors="replace"))
        return answer(WRITTEN)
    if op == READ:
        header_buffer = bytearray(HEADER_BYTES)
        read = files.read(key, [memoryview(header_buffer), payload], file_bytes)
        return answer(read.value, 0, bytes(header_buffer) if read is Read.FOUND else b"")
    return answer(REFUSED, 0, b"unknown operation")


def serve(conn: Connection, files: BlockFiles, pool: HostPool, file_bytes: int) -> None:
    """Answer requests until the other end closes the socket."""
    conn.send_bytes(READY)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        conn.send_bytes(handle(message, files, pool, file_bytes))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--root-fd", type=int, required=True)
    p.add_argument("--socket-fd", type=int, required=True)
    p.add_argument("--pool", required=True, help="the host pool's path")
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--slot-bytes", type=int, required=True)
    p.add_argument("--slot-stride", type=int, required=True)
    p.add_argument("--file-mode", type=int, required=True)
    p.add_argument("--dir-mode", type=int, required=True)
    p.add_argument("--fsync", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    conn = Connection(args.socket_fd)
    pool = HostPool.attach(PoolHandle(args.pool, args.slots, args.slot_bytes, args.slot_stride))
    try:
        files = BlockFiles(args.root_fd, args.file_mode, args.dir_mode, args.fsync)
        serve(conn, files, pool, HEADER_BYTES + args.slot_bytes)
    finally:
        pool.close()
        os.close(args.root_fd)
    return 0
