"""Two (or more) "hosts" on one machine: Linux network namespaces on a veth link.

Used by tests/e2e/test_multinode.py to run trainers that rendezvous over a real
network (their own addresses, their own loopback, no route to the machine's
interfaces). Only the network is isolated: the namespaces share the
filesystem, the process table and the CPU with this machine; a test gives
each host a private folder where it must not see another's files.

Everything made here carries a name unique to this process (``grpo<pid>n<k>h<i>``
for namespaces, ``gv<pid>n<k>h<i>`` for veth ends, k counting this process's ``Hosts``) so parallel test runs never
collide, and :meth:`Hosts.close` removes it even when the test failed.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field

IP = shutil.which("ip") or "/usr/sbin/ip"
_INSTANCES = itertools.count()
SUBNET = "10.213"  # addresses exist only on this module's veth pairs, inside its namespaces


class NamespacesRefused(RuntimeError):
    """The kernel or the user may not create network namespaces here (the test is skipped with this)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=30, check=check)


def namespaces_refused() -> str | None:
    """Why namespaces cannot be made here, or None: probes by making (and removing) one."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if not os.path.exists(IP):
        return f"iproute2's {IP} is not installed"
    probe = f"grpo{os.getpid()}probe"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:  # pragma: no cover - depends on the machine
        return f"ip netns add failed: {exc}"
    if made.returncode != 0:
        return f"the kernel refuses network namespaces: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


def _in_namespaces(inodes: set[int]) -> list[int]:
    """Live processes whose network namespace is one of ``inodes`` (found through /proc,
    independently of how close() ends them; a namespace outlives its name while one runs)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                with open(f"/proc/{entry}/stat") as handle:
                    if handle.read().split(") ")[-1][:1] != "Z":
                        found.append(int(entry))
        except OSError:
            continue
    return found


@dataclass
class Hosts:
    """``count`` namespaces; host i has address ``10.213.<subnet>.<i+1>``, known by the
    name ``host<i>`` inside every namespace (its /etc/hosts). Host 0 is
    linked to every other host by its own veth pair (two hosts: one pair)."""

    count: int = 2
    subnet: int = field(default_factory=lambda: os.getpid() % 250)
    names: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    inodes: set[int] = field(default_factory=set)  # the namespaces' identities, to find their processes later

    def __post_init__(self) -> None:
        tag = f"{os.getpid()}n{next(_INSTANCES)}"  # several Hosts may be open at once in one process
        self.names = [f"grpo{tag}h{i}" for i in range(self.count)]
        self.ifnames = [f"gv{tag}h{i}"[:15] for i in range(self.count)]

    def address(self, i: int) -> str:
        return f"{SUBNET}.{self.subnet}.{i + 1}"

    def open(self) -> Hosts:
        """Create the namespaces, a veth pair from host 0 to each other host, the
        addresses and loopback; undo all of it on failure."""
        try:
            names = "127.0.0.1 localhost\n" + "".join(f"{self.address(i)} host{i}\n" for i in range(self.count))
            for i, name in enumerate(self.names):
                # The namespaces share the machine's hostname (one UTS namespace): inside host i it
                # resolves to host i's address, as a machine's own name does (torch's rendezvous asks).
                hosts = names + f"{self.address(i)} {socket.gethostname()}\n"
                _ip("netns", "add", name)
                self.inodes.add(os.stat(f"/run/netns/{name}").st_ino)
                # `ip netns exec` bind-mounts /etc/netns/NAME/hosts over /etc/hosts: "host0", "host1" resolve inside.
                os.makedirs(f"/etc/netns/{name}", exist_ok=True)
                with open(f"/etc/netns/{name}/hosts", "w") as handle:
                    handle.write(hosts)
                self.exec_checked(i, [IP, "link", "set", "lo", "up"])
            for i in range(1, self.count):
                near = self.ifnames[0] if i == 1 else f"{self.ifnames[0]}x{i}"[:15]
                far = self.ifnames[i]
                _ip(
                    "link",
                    "add",
                    near,
                    "netns",
                    self.names[0],
                    "type",
                    "veth",
                    "peer",
                    "name",
                    far,
                    "netns",
                    self.names[i],
                )
                self.links.append(near)
                if i == 1:
                    self.exec_checked(0, [IP, "addr", "add", f"{self.address(0)}/24", "dev", near])
                else:  # host 0 already has its address: route host i through this pair
                    self.exec_checked(0, [IP, "route", "add", f"{self.address(i)}/32", "dev", near])
                self.exec_checked(i, [IP, "addr", "add", f"{self.address(i)}/24", "dev", far])
                self.exec_checked(0, [IP, "link", "set", near, "up"])
                self.exec_checked(i, [IP, "link", "set", far, "up"])
        except BaseException:
            self.close()
            raise
        return self

    def interface(self, i: int) -> str:
        """The veth end that carries host i's address (what GLOO_SOCKET_IFNAME names)."""
        return self.ifnames[i]

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host i's namespace."""
        return [IP, "netns", "exec", self.names[i], *argv]

    def exec_checked(self, i: int, argv: list[str]) -> None:
        done = subprocess.run(self.command(i, argv), capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} in {self.names[i]}: {done.stderr.strip()}")

    def start(self, i: int, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` in host i (close() ends it and everything it started there)."""
        proc = subprocess.Popen(self.command(i, argv), **popen)
        self.procs.append(proc)
        return proc

    def pids(self, i: int) -> list[int]:
        """Every process living in host i's namespace (however deep below the ones started here)."""
        done = _ip("netns", "pids", self.names[i], check=False)
        return [int(p) for p in done.stdout.split()]

    def close(self) -> None:
        """End every process in the namespaces (a launcher's workers may sit in their own
        sessions, so by namespace, not by process group), then delete the namespaces."""
        for i in range(self.count):
            for pid in self.pids(i):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process the kernel cannot end
                pass
        for name in self.names:
            # Deleting a namespace deletes the veth ends inside it (and so each pair).
            _ip("netns", "delete", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Namespaces, links or live processes of this object still present (empty after close())."""
        present = set(_ip("netns", "list", check=False).stdout.split())
        left = [n for n in self.names if n in present]
        left += [f"/etc/netns/{n}" for n in self.names if os.path.exists(f"/etc/netns/{n}")]
        links = _ip("-o", "link", "show", check=False).stdout
        left += [
            f"link {name}" for name in [*self.ifnames, *self.links] if f" {name}@" in links or f" {name}:" in links
        ]
        left += [f"process {p.pid}" for p in self.procs if p.poll() is None]
        left += [f"process {pid}" for pid in _in_namespaces(self.inodes)]
        return left

    def __enter__(self) -> Hosts:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def torchrun_line(rank: int, run: str, port: int = 29500) -> list[str]:
    """Host ``rank``'s launcher line for two hosts of one process each, as on
    a cluster node: c10d rendezvous at ``host0:port`` (free in a fresh
    namespace), this host's own address for the group."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node_rank",
        str(rank),
        "--nproc_per_node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"host0:{port}",
        "--rdzv-id",
        run,
        "--local-addr",
        f"host{rank}",
    ]


def opened_hosts(count: int = 2):
    """A module-scoped fixture's body: ``count`` hosts, skipped with the reason
    where the kernel refuses namespaces, checked to leave nothing behind."""
    import pytest

    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    with Hosts(count=count) as made:
        yield made
    assert made.leftovers() == [], "namespaces, /etc/netns entries or processes left behind"
