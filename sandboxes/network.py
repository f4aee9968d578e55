"""Outbound network for sandboxes that ask for one: filtered, never the host (its loopback or its addresses).

A local sandbox always has a network namespace of its own. With ``network=True`` it
also gets a ``tap0`` device served by ``slirp4netns`` (from Debian): the sandbox's
packets become ordinary sockets of a host process, so they leave through the host's
routing, and ``--disable-host-loopback`` keeps them off the host's 127.0.0.1 (the
gateway's API, the databases). An nftables table inside the sandbox's namespace then
allows only what :class:`EgressPolicy` names (by default: DNS through slirp's resolver,
TCP 80 and 443 to public addresses, which is how package registries are reached; never
the host's own addresses, whatever the port). The sandbox cannot change that table: its
root has no ``CAP_NET_ADMIN``, and seccomp refuses new namespaces. A networked docker
sandbox gets the same table in its container's namespace, its DNS being the container's
resolvers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import select
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from sandboxes.errors import SandboxError

logger = logging.getLogger(__name__)

#: slirp4netns's fixed addresses inside the sandbox.
SLIRP_GATEWAY = "10.0.2.2"
SLIRP_DNS = "10.0.2.3"
SLIRP_NETWORK = "10.0.2.0/24"
READY_TIMEOUT_S = 10.0

#: Never reachable, whatever the operator allows: loopback, link-local (cloud metadata), "this" network.
ALWAYS_DENIED = ("127.0.0.0/8", "169.254.0.0/16", "0.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4")
#: Denied unless the operator allows them: private and carrier-grade NAT ranges (the host's own neighbours).
PRIVATE_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")


@dataclass(frozen=True)
class EgressPolicy:
    """What a networked local sandbox may reach."""

    tcp_ports: Sequence[int] = (80, 443)
    """Destination TCP ports allowed (to public addresses, plus ``allow_networks``)."""
    allow_networks: Sequence[str] = ()
    """Private networks (CIDR) to allow on those ports too, e.g. a registry mirror on the LAN."""
    dns: bool = True
    """Allow DNS to slirp4netns's resolver (10.0.2.3), which forwards to the host's."""
    extra_denied: Sequence[str] = field(default_factory=tuple)
    """More networks (CIDR) never to reach."""

    def __post_init__(self) -> None:
        for port in self.tcp_ports:
            if not 0 < int(port) < 65536:
                raise ValueError(f"egress port {port} is not a TCP port")
        for net in (*self.allow_networks, *self.extra_denied):
            ipaddress.ip_network(net, strict=False)  # raises ValueError naming it

    def ruleset(self, *, dns_servers: Sequence[str] = (SLIRP_DNS,), gateway: str | None = SLIRP_GATEWAY) -> str:
        """Return the nftables ruleset of the sandbox's namespace.

        Args:
            dns_servers: the resolvers the sandbox may ask (slirp's; a docker container's own).
            gateway: the host's side of the sandbox's link, never reachable (slirp's 10.0.2.2).
        """
        denied = [*ALWAYS_DENIED, *([gateway] if gateway else []), *host_addresses(), *self.extra_denied]
        private = list(PRIVATE_NETWORKS)
        allowed = [str(ipaddress.ip_network(n, strict=False)) for n in self.allow_networks]
        lines = [
            "table inet forkyard {",
            "  chain output {",
            "    type filter hook output priority 0; policy drop;",
            '    oif "lo" accept',
            "    ct state established,related accept",
        ]
        if self.dns and dns_servers:
            servers = ", ".join(str(ipaddress.ip_address(a)) for a in dns_servers)
            lines += [f"    ip daddr {{ {servers} }} udp dport 53 accept", f"    ip daddr {{ {servers} }} tcp dport 53 accept"]
        lines.append(f"    ip daddr {{ {', '.join(denied)} }} drop")
        ports = ", ".join(str(int(p)) for p in self.tcp_ports)
        if ports:
            if allowed:
                lines.append(f"    ip daddr {{ {', '.join(allowed)} }} tcp dport {{ {ports} }} accept")
            lines.append(f"    ip daddr {{ {', '.join(private)} }} drop")
            lines.append(f"    meta nfproto ipv4 tcp dport {{ {ports} }} accept")
        lines += ["  }", "}"]
        return "\n".join(lines) + "\n"


def host_addresses() -> list[str]:
    """Return this host's own IPv4 addresses (a sandbox must not reach a host service on any of them).

    A service bound to 0.0.0.0 answers on the host's public address too, which no
    private-range rule covers; the host's addresses are denied whatever the port.
    """
    proc = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10,
                          check=False)
    found = []
    for line in proc.stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            address = parts[parts.index("inet") + 1].split("/")[0]
            if not ipaddress.ip_address(address).is_loopback:
                found.append(address)
    return found


def apply_ruleset(pid: int, ruleset: str) -> None:
    """Install ``ruleset`` in process ``pid``'s network namespace (from the host; blocking)."""
    _apply_ruleset(pid, ruleset)


def network_problem() -> str | None:
    """Return one sentence saying why networked local sandboxes cannot run here, or None."""
    missing = [name for name in ("slirp4netns", "nft", "nsenter") if shutil.which(name) is None]
    if missing:
        packages = {"slirp4netns": "slirp4netns", "nft": "nftables", "nsenter": "util-linux"}
        return (
            f"local sandboxes with network need {' and '.join(missing)} "
            f"(apt-get install {' '.join(packages[m] for m in missing)})"
        )
    return None


class SandboxNetwork:
    """The slirp4netns process serving one sandbox's namespace; :meth:`stop` ends it."""

    def __init__(self, proc: subprocess.Popen, exit_fd: int) -> None:
        self._proc = proc
        self._exit_fd = exit_fd
        """Our end of slirp4netns's --exit-fd pipe: it exits when this closes, with us if we crash."""

    @property
    def pid(self) -> int:
        return self._proc.pid

    @classmethod
    def start(cls, pid: int, policy: EgressPolicy) -> SandboxNetwork:
        """Give the network namespace of process ``pid`` a filtered tap0 (blocking; run it in a thread).

        Raises:
            SandboxError: a tool is missing, slirp4netns did not come up, or the ruleset was refused.
        """
        problem = network_problem()
        if problem is not None:
            raise SandboxError(problem[0].upper() + problem[1:])
        # The ruleset goes in first: the sandbox never has an unfiltered moment.
        _apply_ruleset(pid, policy.ruleset())
        read_end, write_end = os.pipe()
        exit_read, exit_write = os.pipe()
        os.set_inheritable(exit_write, False)
        try:
            proc = subprocess.Popen(
                ["slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback", "--enable-sandbox",
                 "--enable-seccomp", f"--ready-fd={write_end}", f"--exit-fd={exit_read}", str(pid), "tap0"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(write_end, exit_read), start_new_session=True,
            )  # fmt: skip
        except BaseException:
            os.close(exit_write)
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
            os.close(exit_read)
        network = cls(proc, exit_write)
        try:
            with os.fdopen(read_end, "rb") as ready:
                got, _, _ = select.select([ready], [], [], READY_TIMEOUT_S)
                answer = ready.read(1) if got else b""
            if answer != b"1":
                err = b""
                with contextlib.suppress(Exception):
                    proc.kill()
                    _, err = proc.communicate(timeout=5)
                raise SandboxError(
                    f"slirp4netns did not bring the sandbox's network up: {err.decode(errors='replace').strip()[-300:]}"
                )
        except BaseException:
            network.stop()
            raise
        logger.debug("process %s: network up (slirp4netns %s)", pid, proc.pid)
        return network

    def stop(self) -> None:
        """Kill slirp4netns and reap it (idempotent)."""
        if self._exit_fd >= 0:
            os.close(self._exit_fd)
            self._exit_fd = -1
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.communicate(timeout=5)


def _apply_ruleset(pid: int, ruleset: str) -> None:
    proc = subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", "--", "nft", "-f", "-"],
        input=ruleset, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SandboxError(f"cannot install the sandbox's egress rules: {proc.stderr.strip()[-300:]}")


def list_ruleset(pid: int) -> str:
    """Return the nftables ruleset in force in process ``pid``'s network namespace."""
    proc = subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", "--", "nft", "list", "ruleset"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SandboxError(f"cannot read the sandbox's egress rules: {proc.stderr.strip()[-300:]}")
    return proc.stdout


async def start_network(pid: int, policy: EgressPolicy) -> SandboxNetwork:
    """Start the network of process ``pid``'s namespace from a worker thread."""
    return await asyncio.to_thread(SandboxNetwork.start, pid, policy)


__all__ = ["EgressPolicy", "SandboxNetwork", "apply_ruleset", "host_addresses", "list_ruleset", "network_problem",
           "start_network"]
