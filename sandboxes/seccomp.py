"""The seccomp filter of every local sandbox: the system calls a hostile agent never needs.

A deny list over an allow-by-default action, written out so that a reader sees every
refusal: what Docker's default profile refuses to a container without
``CAP_SYS_ADMIN`` (keyrings, mounts, bpf, kernel modules, kexec, the clock, swap,
reboot, ``open_by_handle_at``...), plus io_uring (which bypasses the filter) and every
way to make a new namespace (``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*``
flag), so ``unshare -U`` cannot hand the agent a fresh set of capabilities. ``clone3``
answers ENOSYS, as under Docker: its flags sit in memory seccomp cannot read, and libc
then falls back to ``clone``. ``ptrace`` stays allowed (debuggers and strace work
inside): the pid namespace hides every process but the sandbox's own.
"""

from __future__ import annotations

import errno

#: Refused with EPERM.
DENIED_SYSCALLS = (
    # kernel keyrings
    "add_key", "keyctl", "request_key",
    # mounts and filesystems
    "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "open_by_handle_at", "name_to_handle_at", "quotactl", "quotactl_fd",
    # namespaces
    "unshare", "setns",
    # the kernel itself
    "bpf", "perf_event_open", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "create_module", "get_kernel_syms", "query_module", "iopl", "ioperm", "syslog", "lookup_dcookie",
    "userfaultfd", "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl", "vhangup", "acct", "reboot",
    "swapon", "swapoff", "settimeofday", "clock_settime", "clock_settime64", "clock_adjtime",
    "clock_adjtime64", "adjtimex", "stime",
    # io_uring runs system calls the filter never sees
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)  # fmt: skip

#: Refused with ENOSYS (callers fall back to an older call the filter can inspect).
ENOSYS_SYSCALLS = ("clone3",)

#: ``clone`` flags that make a new namespace.
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}


def seccomp_profile() -> dict:
    """Return the OCI ``linux.seccomp`` object of a local sandbox (x86-64 and arm64)."""
    rules: list[dict] = [
        {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
        {"names": list(ENOSYS_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
    ]
    # One rule per flag: rules on one call are or-ed, and (flags & bit) == bit is one comparison.
    for bit in CLONE_NAMESPACE_FLAGS.values():
        rules.append(
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": errno.EPERM,
                "args": [{"index": 0, "value": bit, "valueTwo": bit, "op": "SCMP_CMP_MASKED_EQ"}],
            }
        )
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
        "syscalls": rules,
    }


__all__ = ["CLONE_NAMESPACE_FLAGS", "DENIED_SYSCALLS", "ENOSYS_SYSCALLS", "seccomp_profile"]
