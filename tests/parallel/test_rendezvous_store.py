"""The rendezvous store rank 0 hosts listens on loopback for a single-machine run (item 10 of the
reliability issue): nothing off the machine may reach the unauthenticated store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from modelrunner_executor_mp.group import loopback_listener

HOST_THE_STORE = textwrap.dedent('''
    import json, os, psutil, torch
    from modelrunner.api import LaunchInfo
    from modelrunner_executor_mp.group import free_port, init_distributed

    port = free_port()
    init_distributed(LaunchInfo(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=port),
                     1, 1, torch.device("cpu"))
    listening = [c.laddr.ip for c in psutil.Process().net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    print(json.dumps(listening), flush=True)
    os._exit(0)  # gloo's threads can abort a normal teardown
''')


def test_the_store_rank_0_hosts_for_its_own_workers_listens_on_loopback_only():
    result = subprocess.run([sys.executable, "-c", HOST_THE_STORE], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ["127.0.0.1"], result.stdout


def test_only_loopback_addresses_get_a_loopback_listener():
    for host in ("127.0.0.1", "localhost"):
        sock = loopback_listener(host, 0)
        assert sock is not None and sock.getsockname()[0] in ("127.0.0.1", "::1")
        sock.close()
    for host in ("0.0.0.0", "::"):  # every interface: a rendezvous across machines
        assert loopback_listener(host, 0) is None
