"""The store a torchrun worker group meets in: torchrun's own, under a prefix of this group.

torchrun (``--max-restarts``) keeps its store across restarts, so a restarted group that met
under fixed keys would read the dead group's connection keys (gloo: "connectFullMesh failed
... Connection refused"; NCCL would read a stale unique id). The keys therefore need a scope
that every worker of one group agrees on and no other group shares.

torchrun gives its workers nothing that names the group: ``TORCHELASTIC_RESTART_COUNT`` is each
agent's own count (an agent whose workers failed counts a restart, an agent that restarts its
healthy workers because another node rejoined does not), and the rendezvous round is not
exported. Counting the workers' joins in the store is not enough either: a worker that dies
before it joins (its own crash, or its agent stopping it during a restart) leaves the count
short, and the nodes then disagree on the group forever after.

So nothing is counted. Rank 0 draws a random token for its group, serves it on a port of its
own for as long as it lives, and publishes ``host port token`` in torchrun's store; the other
ranks use the published token only once rank 0 answers with it. A record left by a dead group
is never used: its rank 0 is gone (torchrun stops every worker of a group before it starts the
next), so its port refuses, stays silent or answers with another token. The ranks then wait
for each other under the token's prefix, in Python, so that a group that cannot meet ends on
torchrun's SIGTERM at once.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megatron_psrl.errors import CollectiveTimeoutError

_RECORD_KEY = "/megatron_psrl/group/{init}"
"""Where rank 0 publishes ``host port token``; ``init``: how many times this process has
initialized before (every rank of a group initializes as many times, in the same order)."""

_PROBE_SECONDS = 2.0
"""How long a rank waits for a published port to answer before reading the record again."""

_STATE = {"inits": 0, "server": None}


class _TokenServer:
    """Answers every connection on an ephemeral port with the group's token (a daemon thread)."""

    def __init__(self, token: str):
        self.token = token.encode()
        if socket.has_dualstack_ipv6():
            self.sock = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self.sock = socket.create_server(("", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, name="psrl-group-token", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    conn.sendall(self.token)
                except OSError:  # the peer gave up first: it will ask again
                    pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        self.sock.close()


def _answers(host: str, port: int, token: str) -> bool:
    """Whether ``host:port`` answers with ``token`` (a plain socket: quiet, and bounded even when
    something else now listens on a dead rank 0's port)."""
    try:
        with socket.create_connection((host, port), timeout=_PROBE_SECONDS) as conn:
            received = b""
            while len(received) < len(token):
                chunk = conn.recv(64)
                if not chunk:
                    break
                received += chunk
            return received.decode(errors="replace") == token
    except OSError:  # refused, unreachable or silent: not this group's rank 0
        return False


def _confirmed_token(store: dist.Store, key: str, timeout: timedelta) -> str:
    """The token published under ``key`` once its rank 0 answers with it; a dead group's
    record is read again until this group's rank 0 has replaced it."""
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if store.check([key]):
            host, port, token = store.get(key).decode().split()
            if _answers(host, int(port), token):
                return token
        time.sleep(0.2)
    raise CollectiveTimeoutError(
        f"rank 0 of this worker group did not come up within --distributed-timeout-minutes "
        f"({timeout.total_seconds():.0f} s): torchrun's store at {os.environ['MASTER_ADDR']}:"
        f"{os.environ['MASTER_PORT']} holds no token that a live rank 0 confirms")


def worker_group_store(timeout: timedelta) -> dist.Store:
    """torchrun's store (from ``MASTER_ADDR`` / ``MASTER_PORT``), its keys scoped to this
    worker group by rank 0's token (see the module's docstring).

    Rank 0 runs on the node that ``MASTER_ADDR`` names: the node whose agent hosts torchrun's
    store (rendezvous rank 0), or, with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, rank 0 hosts
    that store itself. Its token port is ephemeral, as torchrun's store and gloo's are."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host = os.environ["MASTER_ADDR"]
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), world, is_master=not agent_hosts_store and rank == 0,
                          timeout=timeout, multi_tenant=True)
    key = _RECORD_KEY.format(init=_STATE["inits"])
    _STATE["inits"] += 1
    if rank == 0:
        close_worker_group_store()
        token = secrets.token_hex(16)
        server = _TokenServer(token)
        _STATE["server"] = server
        store.set(key, f"{host} {server.port} {token}")
    else:
        token = _confirmed_token(store, key, timeout)
    group_store = dist.PrefixStore(f"/megatron_psrl/group_{token}", store)
    _wait_for_every_rank(group_store, world, timeout)
    return group_store


def _wait_for_every_rank(store: dist.Store, world: int, timeout: timedelta) -> None:
    """Until every rank of the group has its token. The wait is in Python, so that SIGTERM
    (torchrun stopping a group in which a worker died or never came) ends this worker at once;
    blocked inside ``init_process_group`` it would not, and torchrun would wait 30 s before its
    SIGKILL. (A count is safe here: the keys are this group's alone.)"""
    store.add("arrived", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    delay = 0.01
    while (arrived := store.add("arrived", 0)) < world:
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"only {arrived} of the {world} ranks of this worker group came up within "
                f"--distributed-timeout-minutes ({timeout.total_seconds():.0f} s)")
        time.sleep(delay)
        delay = min(2 * delay, 0.5)  # (every rank polls one counter: bounded load on the store)


def close_worker_group_store() -> None:
    """Stop answering with this process's token (rank 0; after its process group is destroyed)."""
    server: Optional[_TokenServer] = _STATE["server"]
    _STATE["server"] = None
    if server is not None:
        server.close()
