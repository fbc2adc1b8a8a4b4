"""The CPU image's CUDA stubs (trainer_image/stub_cuda_libraries.py), on a library built
here as the CUDA ones are: a SONAME, a version node, code and data, and a C++ runtime
symbol it re-exports. The stub must load where the library did, for a program linked
against the real one, and abort naming the function if one is called."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import needs

SCRIPT = Path(__file__).parents[2] / "trainer_image" / "stub_cuda_libraries.py"
_spec = importlib.util.spec_from_file_location("stub_cuda_libraries", SCRIPT)
assert _spec is not None and _spec.loader is not None
stubs = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = stubs  # its dataclass looks itself up there
_spec.loader.exec_module(stubs)

pytestmark = needs(None if shutil.which("cc") and shutil.which("nm") else "no C compiler or nm")

LIBRARY = """
#include <stddef.h>
int cublasCreate_v2(void **handle) { *handle = 0; return 7; }
int cublasVersion[4] = {13, 1, 1, 3};
void _ZdlPvm(void *p, size_t n) { (void)p; (void)n; }  /* operator delete, re-exported */
"""
VERSIONS = "libcublas.so.13 { global: cublasCreate_v2; cublasVersion; _ZdlPvm; local: *; };"
PROGRAM = """
#include <stdio.h>
extern int cublasCreate_v2(void **handle);
extern int cublasVersion[4];
int main(int argc, char **argv) {
    void *handle;
    printf("loaded %d\\n", cublasVersion[0] >= 0);
    fflush(stdout);
    if (argc > 1) printf("called %d\\n", cublasCreate_v2(&handle));
    return 0;
}
"""


def build(folder: Path) -> tuple[Path, Path]:
    """The library (libcublas.so.13) and a program linked against it."""
    (folder / "lib.c").write_text(LIBRARY)
    (folder / "lib.map").write_text(VERSIONS)
    (folder / "main.c").write_text(PROGRAM)
    library = folder / "libcublas.so.13"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcublas.so.13",
                    f"-Wl,--version-script={folder / 'lib.map'}", "-o", library,
                    folder / "lib.c"], check=True)  # fmt: skip
    (folder / "libcublas.so").symlink_to(library.name)
    program = folder / "main"
    subprocess.run(["cc", "-o", program, folder / "main.c", f"-L{folder}", "-lcublas",
                    f"-Wl,-rpath,{folder}"], check=True)  # fmt: skip
    return library, program


def test_a_stub_keeps_the_name_symbols_and_versions_and_aborts_when_called(
    tmp_path: Path,
) -> None:
    library, program = build(tmp_path)
    real = stubs.exported_symbols(library)
    assert subprocess.run([program, "call"], capture_output=True, text=True).stdout == (
        "loaded 1\ncalled 7\n"
    )

    stubs.main(str(tmp_path))

    assert stubs.soname(library) == "libcublas.so.13"
    kept = stubs.exported_symbols(library)
    assert {(s.name, s.version) for s in kept} == {
        ("cublasCreate_v2", "libcublas.so.13"),
        ("cublasVersion", "libcublas.so.13"),
    }  # the runtime's operator delete is left to libstdc++
    assert {s.name: s.size for s in kept}["cublasVersion"] == 16
    assert {s.name: s.size for s in real}["cublasVersion"] == 16
    # The program linked against the real library still loads (every symbol at its
    # version): what `import torch` needs. A call aborts, saying which function it was.
    loaded = subprocess.run([program], capture_output=True, text=True)
    assert (loaded.returncode, loaded.stdout) == (0, "loaded 1\n")
    called = subprocess.run([program, "call"], capture_output=True, text=True)
    assert called.returncode < 0  # SIGABRT
    assert "cublasCreate_v2: libcublas.so.13 is a stub in this CPU image" in called.stderr


def test_the_cuda_runtime_stays_real(tmp_path: Path) -> None:
    (tmp_path / "libcudart.so.13").write_bytes(b"\x7fELF real")
    (tmp_path / "libcufft.so.12").write_bytes(b"\x7fELF real")
    assert stubs.libraries(tmp_path) == [tmp_path / "libcufft.so.12"]
