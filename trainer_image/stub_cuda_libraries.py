"""Replace the CUDA libraries of PyPI's torch with stubs, for the CPU image.

    python3 stub_cuda_libraries.py /opt/venv/lib/python3.11/site-packages/nvidia

PyPI serves torch only with CUDA: its libraries (`libtorch_cuda.so`) name cuBLAS, cuDNN,
NCCL, cuFFT, … as needed, so the dynamic loader must find each of them for `import torch`
to work, even on a machine without a GPU, where none of them is ever called. Together
they are about 2.8 GB of the CPU image, which every node that runs it must unpack.

Each library under the folder is replaced, in place and under the same name, by a stub:
the same SONAME, the same exported symbols with the same symbol versions, and no code
but a call that aborts naming the function (nothing on CPU calls one). The CUDA runtime
(`libcudart`) stays real: `torch.cuda.is_available()` asks it, and it answers "no device"
without a driver. Only the CPU image runs this (trainer_image/Dockerfile, STACK=cpu); the
GPU image keeps the real libraries. Needs binutils' `nm` and `readelf` and a C compiler.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

KEEP = ("libcudart.so",)  # asked on CPU too: is there a GPU?
FUNCTION_TYPES = set("TtWiI")  # nm's letters for code
# The linker's own: every shared library has them.
LINKER_SYMBOLS = {"_init", "_fini", "_edata", "_end", "__bss_start"}
# Some of the libraries also export the C and C++ runtimes' symbols they were linked
# with (libcufile: operator delete). Loaded ahead of libstdc++, a stub's would replace
# the real ones: a stub leaves out whatever these define.
RUNTIMES = ("libstdc++.so.6", "libgcc_s.so.1", "libc.so.6", "libm.so.6")


@dataclass(frozen=True)
class Symbol:
    name: str
    is_function: bool
    size: int  # bytes, for objects
    version: str | None  # the version node it is defined in (None: unversioned)


def exported_symbols(library: Path) -> list[Symbol]:
    """The library's defined dynamic symbols, less the version nodes themselves."""
    out = subprocess.run(
        ["nm", "-D", "--defined-only", "--with-symbol-versions", "-S", str(library)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    symbols = []
    for line in out.splitlines():
        fields = line.split()
        kind, versioned = fields[-2], fields[-1]
        size = int(fields[1], 16) if len(fields) == 4 else 0
        name, _, version = versioned.partition("@")
        if kind == "A" or name in LINKER_SYMBOLS:  # a version node's own symbol, or ld's
            continue
        version = version.lstrip("@")
        # A version script cannot spell a node named with a `-` (nvrtc's builtins, which
        # nothing links against: nvrtc opens them when it compiles): left unversioned.
        versioned_as = version if re.fullmatch(r"[\w.]+", version) else None
        symbols.append(Symbol(name, kind in FUNCTION_TYPES, size, versioned_as))
    return symbols


def runtime_symbols(compiler: str) -> set[str]:
    """The names the C and C++ runtimes define (found where `compiler` links them from)."""
    names: set[str] = set()
    for runtime in RUNTIMES:
        path = subprocess.run(
            [compiler, f"-print-file-name={runtime}"], check=True, capture_output=True, text=True
        ).stdout.strip()
        names.update(symbol.name for symbol in exported_symbols(Path(path)))
    return names


def soname(library: Path) -> str:
    out = subprocess.run(
        ["readelf", "-d", str(library)], check=True, capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        if "(SONAME)" in line:
            return line.split("[", 1)[1].rstrip("]")
    return library.name


def stub_source(library: str, symbols: list[Symbol]) -> tuple[str, str]:
    """C source defining `symbols`, and the version script that versions them as the
    real library does."""
    lines = [
        "#include <stdio.h>",
        "#include <stdlib.h>",
        "static void stub_called(const char *name) {",
        f'    fprintf(stderr, "%s: {library} is a stub in this CPU image (no GPU here)\\n", name);',
        "    abort();",
        "}",
    ]
    for symbol in symbols:
        if symbol.is_function:
            lines.append(f'void {symbol.name}(void) {{ stub_called("{symbol.name}"); }}')
        else:
            lines.append(f"char {symbol.name}[{max(symbol.size, 1)}] __attribute__((aligned(16)));")
    nodes: dict[str | None, list[str]] = {}
    for symbol in symbols:
        nodes.setdefault(symbol.version, []).append(symbol.name)
    script = [
        f"{node or ''} {{ global: {' '.join(f'{n};' for n in names)} local: *; }};"
        for node, names in nodes.items()
    ]
    return "\n".join(lines) + "\n", "\n".join(script) + "\n"


def stub(library: Path, runtime: set[str], compiler: str) -> int:
    """Replace `library` with its stub (less the `runtime` symbols); returns the bytes saved."""
    symbols = [s for s in exported_symbols(library) if s.name not in runtime]
    source, versions = stub_source(library.name, symbols)
    with tempfile.TemporaryDirectory() as scratch:
        c_file, script, built = (Path(scratch) / n for n in ("stub.c", "stub.map", "stub.so"))
        c_file.write_text(source)
        script.write_text(versions)
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-O0", "-w", f"-Wl,-soname,{soname(library)}",
             f"-Wl,--version-script={script}", "-o", str(built), str(c_file)],
            check=True,
        )  # fmt: skip
        saved = library.stat().st_size - built.stat().st_size
        os.replace(built, library)  # a new inode: a hard link to the real one stays real
    return saved


def libraries(folder: Path) -> list[Path]:
    """The shared libraries under `folder`, less those kept, each once (not its links)."""
    return sorted(
        path
        for path in folder.rglob("*.so*")
        if path.is_file() and not path.is_symlink() and not path.name.startswith(KEEP)
    )


def main(folder: str, compiler: str = "cc") -> None:
    runtime = runtime_symbols(compiler)
    saved = sum(stub(library, runtime, compiler) for library in libraries(Path(folder)))
    print(f"stubbed the CUDA libraries under {folder}: {saved / 2**30:.2f} GiB saved")


if __name__ == "__main__":
    main(*sys.argv[1:])
