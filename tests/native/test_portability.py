"""Built native code stays within the x86-64 baseline (tests/helpers/isa_check.py): the llama.cpp libraries the engine tests load, the project's core, SuffixDecoding."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.isa_check import beyond_baseline, is_dispatched_variant

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the baseline checked here is x86-64's")

ROOT = Path(__file__).resolve().parents[2]

SOURCES = {
    "avx512": ("-mavx512f", "#include <immintrin.h>\n__m512 f(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }\n"),
    "amx": ("-mamx-tile", "#include <immintrin.h>\n"
            "void f(const void *c, const void *p) { _tile_loadconfig(c); _tile_loadd(1, p, 64); _tile_release(); }\n"),
    "avxvnni": ("-mavxvnni", "#include <immintrin.h>\n"
                "__m256i f(__m256i s, __m256i a, __m256i b) { return _mm256_dpbusd_avx_epi32(s, a, b); }\n"),
    "baseline": ("-mavx2 -mfma -mf16c -mbmi2", "#include <immintrin.h>\n"
                 "__m256 f(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }\n"),
}


def compile_library(tmp_path: Path, name: str) -> Path:
    flags, source = SOURCES[name]
    src, lib = tmp_path / f"{name}.c", tmp_path / f"lib{name}.so"
    src.write_text(source)
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", *flags.split(), str(src), "-o", str(lib)], check=True)
    return lib


@pytest.mark.parametrize("name, kind", [("avx512", "AVX-512"), ("amx", "AMX"), ("avxvnni", "AVX-VNNI")])
def test_check_finds_instructions_beyond_the_baseline(tmp_path, name, kind):
    hits = beyond_baseline(compile_library(tmp_path, name))
    assert any(what.startswith(kind) for what in hits), hits


def test_check_passes_baseline_code(tmp_path):
    assert beyond_baseline(compile_library(tmp_path, "baseline")) == {}


def test_dispatched_variants_are_recognised_by_name():
    assert is_dispatched_variant(Path("libggml-cpu-sapphirerapids.so"))
    assert not is_dispatched_variant(Path("libggml-cpu.so"))
    assert not is_dispatched_variant(Path("libllama.so"))


def llama_cpp_libraries() -> list[Path]:
    spec = importlib.util.find_spec("llama_cpp")  # finds the package without loading its libraries
    assert spec is not None and spec.origin, (
        "llama-cpp-python is not installed: the test command builds it (tests/bench/engines/build_llama_cpp.py --install)")
    libs = sorted(p for p in (Path(spec.origin).parent / "lib").glob("*.so*") if p.is_file() and not p.is_symlink())
    assert libs, f"no shared libraries in {Path(spec.origin).parent / 'lib'}"
    return libs


def test_llama_cpp_libraries_stay_within_the_baseline():
    libs = llama_cpp_libraries()
    assert any(p.name.startswith("libggml-cpu") for p in libs), [p.name for p in libs]
    found = {p.name: hits for p in libs if not is_dispatched_variant(p) and (hits := beyond_baseline(p))}
    assert not found, (
        f"llama.cpp libraries loaded on every CPU use instructions beyond x86-64-v3: {found}; "
        "rebuild with tests/bench/engines/build_llama_cpp.py's portable flags")


def test_project_core_stays_within_the_baseline():
    import ngramcache.client._core as core

    assert beyond_baseline(Path(core.__file__)) == {}


def test_suffix_decoding_peer_stays_within_the_baseline():
    from bench.engines.build_suffix_decoding import DEFAULT_DEST, module_path

    module = module_path(DEFAULT_DEST)
    assert module.exists(), f"{module} is not built: the test command builds it (tests/bench/engines/build_suffix_decoding.py)"
    assert beyond_baseline(module) == {}


def test_llama_server_recipe_is_portable():
    # Always checked: the flags the benchmark builds llama-server with (the build itself takes
    # minutes and is not part of the test command; the binary is checked below where it exists).
    from bench.engines.build_llama_server import SERVER_CMAKE_ARGS

    flags = SERVER_CMAKE_ARGS.split()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512=OFF" in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert not any("march=native" in f or f in ("-DGGML_NATIVE=ON", "-DGGML_AVX512=ON") for f in flags), flags


def test_llama_server_stays_within_the_baseline():
    from bench.engines.build_llama_server import DEFAULT_CACHE, SERVER_CMAKE_ARGS, TARGET, server_dir

    binary = server_dir(DEFAULT_CACHE, SERVER_CMAKE_ARGS) / TARGET
    if not binary.exists():
        pytest.skip(f"{binary} is not built (tests/bench/engines/build_llama_server.py, minutes: not part of the test command)")
    assert beyond_baseline(binary) == {}
