"""Check /backup/data.tar.gz against the files of /srv/data (minus *.tmp and cache/)."""

import hashlib
import sys
import tarfile
from pathlib import Path

DATA = Path("/srv/data")
EXPECTED = {
    "data/README",
    "data/reports/2024-q1.csv",
    "data/reports/2024-q2.csv",
    "data/reports/tmp-summary.txt",
    "data/users/users.csv",
}


def main() -> int:
    archive = Path("/backup/data.tar.gz")
    if not archive.is_file():
        print("FAIL: /backup/data.tar.gz does not exist")
        return 1
    if archive.read_bytes()[:2] != b"\x1f\x8b":
        print("FAIL: the archive is not gzip-compressed")
        return 1
    for name in EXPECTED:
        if not (DATA / name.removeprefix("data/")).is_file():
            print(f"FAIL: /srv/data/{name.removeprefix('data/')} was removed")
            return 1
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = {m.name.rstrip("/"): m for m in tar.getmembers()}
            files = {name for name, m in members.items() if m.isfile()}
            if files != EXPECTED:
                print(f"FAIL: files in the archive: {sorted(files)}\nwant: {sorted(EXPECTED)}")
                return 1
            for name in EXPECTED:
                got = hashlib.sha256(tar.extractfile(members[name]).read()).hexdigest()
                want = hashlib.sha256((DATA / name.removeprefix("data/")).read_bytes()).hexdigest()
                if got != want:
                    print(f"FAIL: {name} differs from /srv/{name}")
                    return 1
            bad = [n for n in members if not (n == "data" or n.startswith("data/")) or "cache" in n.split("/")]
            if bad:
                print(f"FAIL: unexpected entries: {bad}")
                return 1
    except (tarfile.TarError, OSError, EOFError) as exc:
        print(f"FAIL: cannot read the archive: {exc}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
