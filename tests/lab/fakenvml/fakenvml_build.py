"""Build the lab's fake libnvidia-ml.so.1 (fakenvml.c) with the system C compiler, once.

Why here and not at install time: the library is a test fixture; the suite compiles it on first
use and caches it by the hash of the source and the compile command, so an edit rebuilds it and a
second session reuses it. ``build()`` returns the path of the built library.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).resolve().parent / "fakenvml.c"
SONAME = "libnvidia-ml.so.1"
CFLAGS = ["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
          "-fvisibility=hidden", "-Wl,-soname," + SONAME]


class BuildError(RuntimeError):
    """No C compiler, or the source did not compile (the message says which)."""


def compiler() -> Optional[str]:
    """The system C compiler ($CC, else cc, gcc, clang), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(cache_dir: Optional[Path] = None) -> Path:
    """Path of the built library: <cache>/<hash>/libnvidia-ml.so.1, compiled when not there yet."""
    return build_c(SOURCE, SONAME, CFLAGS, cache_dir)


def build_c(source_path: Path, name: str, cflags: list[str],
            cache_dir: Optional[Path] = None) -> Path:
    """Path of ``source_path`` built with ``cflags``: <cache>/<hash>/<name>, compiled when not
    there yet (the lab's fake MPS binary is built the same way, tests/lab/fakemps/).

    The cache defaults to <tempdir>/gflab-fakenvml; a build goes to a private temporary name
    and is renamed into place, so concurrent sessions never load a half-written file."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (cc, gcc or clang; install gcc and libc6-dev)")
    source = source_path.read_bytes()
    key = hashlib.sha256(source + "\0".join([cc] + cflags).encode()).hexdigest()[:16]
    base = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "gflab-fakenvml"
    out_dir = base / key
    lib = out_dir / name
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o755)
    os.chmod(out_dir, 0o755)
    tmp = out_dir / (".%s.%d.tmp" % (name, os.getpid()))
    res = subprocess.run([cc, *cflags, "-o", str(tmp), str(source_path)], capture_output=True,
                         text=True, timeout=120)
    if res.returncode != 0:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise BuildError("%s failed on %s: %s" % (cc, source_path.name,
                                                 (res.stderr or res.stdout).strip()))
    os.chmod(tmp, 0o755)
    os.rename(tmp, lib)
    return lib


if __name__ == "__main__":
    print(build())
