"""ready_jax.runtime: XLA's CPU flags set before the backend starts, JAX's persistent compilation cache, the
scripts' runtime options (ready_jax.cli), and the line ``generate`` prints before each compile.

What needs a jax that has not started its backend runs in a fresh interpreter; what runs in this process
restores every jax setting it changes. No test touches the user's own cache directory."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

import ready_jax as rj
from pallas_kernels import backend
from ready_jax import cli, generation, runtime

REPO = Path(__file__).resolve().parent.parent
CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes")
YNN = runtime.CPU_XLA_FLAGS[0].split("=")[0]  # --xla_cpu_experimental_ynn_fusion_type


@pytest.fixture
def jax_cache_options(monkeypatch, tmp_path):
    """Restores jax's cache options after the test; a cache-enabling environment pointing under tmp_path."""
    saved = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
    for name in (runtime.CACHE_ENV, runtime.CACHE_DIR_ENV, "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("XLA_FLAGS", " ".join(runtime.CPU_XLA_FLAGS))  # nothing to add, so no warning here
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def _fresh_python(code: str, tmp_path: Path, *argv: str, **env: str) -> dict:
    """Run ``code`` in a new interpreter (jax not yet started) with a clean runtime environment, the default
    cache dir under tmp_path: the JSON it prints."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("XLA_FLAGS", runtime.CACHE_ENV, runtime.CACHE_DIR_ENV, "JAX_COMPILATION_CACHE_DIR",
                         backend.INTERPRET_ENV)}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**base, "XDG_CACHE_HOME": str(tmp_path / "xdg"), **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


# ---- XLA flags ---------------------------------------------------------------------------------------------
CONFIGURE_FLAGS = """
    import json, os
    from ready_jax import runtime
    info = runtime.configure(compile_cache=False)
    import jax.numpy as jnp
    assert float(jnp.ones(3).sum()) == 3.0  # XLA accepted every flag (it aborts on an unknown one)
    print(json.dumps(info))
"""


@pytest.mark.parametrize("user_flags, expected, added", [
    ("", runtime.CPU_XLA_FLAGS[0], [runtime.CPU_XLA_FLAGS[0]]),
    ("--xla_backend_optimization_level=0", f"--xla_backend_optimization_level=0 {runtime.CPU_XLA_FLAGS[0]}",
     [runtime.CPU_XLA_FLAGS[0]]),
    (f"{YNN}=dot", f"{YNN}=dot", []),  # the user's own value of the same flag wins
], ids=["none", "other", "same-flag"])
def test_configure_appends_the_cpu_flags_and_keeps_the_users_own(tmp_path, user_flags, expected, added):
    info = _fresh_python(CONFIGURE_FLAGS, tmp_path, XLA_FLAGS=user_flags)
    assert info == {"xla_flags": expected, "added_xla_flags": added, "compile_cache_dir": None,
                    "pallas_interpret": "gpu"}


def test_configure_after_the_backend_started_warns_naming_the_flags(monkeypatch):
    jax.devices()  # the backend has started (as it has in any test process by now)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    with pytest.warns(RuntimeWarning, match=f"already started.*{YNN}= cannot take effect"):
        info = runtime.configure(compile_cache=False)
    assert info["added_xla_flags"] == [] and os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0"


# ---- the persistent compilation cache ----------------------------------------------------------------------
def test_configure_creates_the_cache_dir_and_sets_it_in_jax(jax_cache_options, tmp_path):
    directory = tmp_path / "a" / "b"
    info = runtime.configure(cache_dir=directory)
    assert directory.is_dir() and info["compile_cache_dir"] == str(directory)
    assert jax.config.jax_compilation_cache_dir == str(directory)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == runtime.MIN_COMPILE_SECONDS
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1


def test_the_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    for name in (runtime.CACHE_DIR_ENV, "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert runtime.default_cache_dir() == tmp_path / "xdg" / "ready-jax" / "jax-compile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert runtime.default_cache_dir() == Path.home() / ".cache" / "ready-jax" / "jax-compile"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert runtime.default_cache_dir() == tmp_path / "jax"
    monkeypatch.setenv(runtime.CACHE_DIR_ENV, str(tmp_path / "ours"))
    assert runtime.default_cache_dir() == tmp_path / "ours"


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_the_environment_turns_the_cache_off(jax_cache_options, monkeypatch, tmp_path, value):
    monkeypatch.setenv(runtime.CACHE_ENV, value)
    assert runtime.configure(cache_dir=tmp_path / "cache")["compile_cache_dir"] is None
    assert jax.config.jax_compilation_cache_dir is None and not (tmp_path / "cache").exists()


def test_a_cache_dir_that_cannot_be_created_warns_and_runs_without(jax_cache_options, tmp_path):
    (tmp_path / "file").touch()
    with pytest.warns(RuntimeWarning, match="cannot be created.*without JAX's persistent compilation cache"):
        info = runtime.configure(cache_dir=tmp_path / "file" / "cache")
    assert info["compile_cache_dir"] is None and jax.config.jax_compilation_cache_dir is None


CACHED_COMPILE = """
    import json, sys
    from ready_jax import runtime
    info = runtime.configure(cache_dir=sys.argv[1])
    import jax, jax.numpy as jnp
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # this function compiles in milliseconds
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kwargs: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
    assert float(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((4, 4))).sum()) > 0
    print(json.dumps({"hits": len(hits), **info}))
"""


def test_a_second_process_loads_the_compiled_program_from_the_cache(tmp_path):
    directory = tmp_path / "cache"
    first = _fresh_python(CACHED_COMPILE, tmp_path, str(directory))
    assert first["hits"] == 0 and first["compile_cache_dir"] == str(directory)
    written = sorted(directory.iterdir())
    assert written, "the first process wrote nothing to the cache"
    assert _fresh_python(CACHED_COMPILE, tmp_path, str(directory))["hits"] >= 1
    assert sorted(directory.iterdir()) == written  # nothing compiled anew


def _entry(executable: bytes) -> bytes:
    """A cache entry as jax writes it."""
    from jax._src import compilation_cache
    return compilation_cache.compress_executable(compilation_cache.combine_executable_and_time(executable, 3))


def test_configure_removes_cache_entries_cut_short_and_reads_each_entry_once(jax_cache_options, tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir()
    whole = _entry(b"an executable" * 1000)
    (directory / "jit_f-1-cache").write_bytes(whole)
    (directory / "jit_g-2-cache").write_bytes(whole[: len(whole) // 2])  # the disk filled mid-write
    (directory / "jit_h-3-cache").write_bytes(b"")
    (directory / "jit_h-3-atime").write_bytes(b"12345678")
    runtime.configure(cache_dir=directory)
    assert sorted(p.name for p in directory.iterdir()) == [runtime.CACHE_CHECKED_FILE, "jit_f-1-cache"]

    # Checked before the previous start: not read again. Written since: checked.
    old, new = directory / "jit_old-4-cache", directory / "jit_new-5-cache"
    old.write_bytes(b"cut")
    checked = (directory / runtime.CACHE_CHECKED_FILE).stat().st_mtime_ns
    os.utime(old, ns=(checked - 10 * 10**9,) * 2)
    new.write_bytes(b"cut")
    assert runtime.remove_damaged_cache_entries(directory) == [new]
    assert old.exists() and (directory / "jit_f-1-cache").read_bytes() == whole


CACHED_COMPILE_WARNINGS = """
    import json, sys, warnings
    from ready_jax import runtime
    runtime.configure(cache_dir=sys.argv[1])
    import jax, jax.numpy as jnp
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # this function compiles in milliseconds
    events = []
    jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert float(jax.jit(lambda x: jnp.cos(x) @ x.T)(jnp.ones((4, 4))).sum()) > 0
    print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                      "warnings": [str(w.message) for w in caught]}))
"""


@pytest.mark.slow
def test_a_cache_entry_cut_short_is_compiled_once_more_and_then_loaded(tmp_path):
    directory = tmp_path / "cache"
    assert _fresh_python(CACHED_COMPILE_WARNINGS, tmp_path, str(directory)) == {"hits": 0, "warnings": []}
    entries = len(list(directory.glob("*-cache")))
    (entry,) = directory.glob("jit__lambda-*-cache")
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])  # what a full disk leaves
    assert _fresh_python(CACHED_COMPILE_WARNINGS, tmp_path, str(directory)) == {"hits": entries - 1, "warnings": []}
    assert len(entry.read_bytes()) == len(whole)  # written whole again
    assert _fresh_python(CACHED_COMPILE_WARNINGS, tmp_path, str(directory)) == {"hits": entries, "warnings": []}


# ---- the scripts' options ----------------------------------------------------------------------------------
def test_a_script_parser_takes_the_runtime_options_and_applies_them(jax_cache_options, tmp_path):
    parser = cli.parser("experiments.demo", "A script.")
    parser.add_argument("--steps", type=int, default=1)
    assert "--no-compile-cache" in parser.format_help() and "--compile-cache-dir DIR" in parser.format_help()

    args = parser.parse_args(["--steps", "2", "--compile-cache-dir", str(tmp_path / "cache")])
    assert args.steps == 2 and args.runtime["compile_cache_dir"] == str(tmp_path / "cache")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()

    jax.config.update("jax_compilation_cache_dir", None)
    args, rest = parser.parse_known_args(["--no-compile-cache", "--other"])
    assert rest == ["--other"] and args.runtime["compile_cache_dir"] is None
    assert jax.config.jax_compilation_cache_dir is None


def test_a_script_parser_defaults_to_the_default_cache_dir(jax_cache_options, tmp_path):
    args = cli.parser("experiments.demo", "A script.").parse_args([])
    assert args.runtime["compile_cache_dir"] == str(tmp_path / "xdg" / "ready-jax" / "jax-compile")


def test_no_script_defines_the_runtime_options_itself():
    for path in sorted([*REPO.glob("experiments/**/*.py"), *REPO.glob("convert/*.py")]):
        text = path.read_text()
        assert "--no-compile-cache" not in text and "--compile-cache-dir" not in text, path


# ---- the compile line --------------------------------------------------------------------------------------
def test_generate_says_what_it_compiles_once(tiny_target, capsys):
    prompts = np.array([[1, 2, 3]], np.int32)
    capsys.readouterr()
    # capacity 29: a program no other test compiles, so this first call compiles
    first = rj.generate(tiny_target, prompts, 4, capacity=29)
    err = capsys.readouterr().err
    assert err.count("compiling generate:") == 1 and first.compile_seconds > 0
    assert "compiling generate: autoregressive (batch 1, prompt 3, up to 4 new tokens) ...\n" in err
    assert "compiled generate in " in err.split("compiling generate:")[1]
    again = rj.generate(tiny_target, prompts, 4, capacity=29)
    assert "compil" not in capsys.readouterr().err and again.compile_seconds == 0.0


def test_the_compile_line_names_the_drafter_and_its_block(tiny_target):
    scripted = rj.ScriptedDrafter(np.zeros((2, 8), np.int32), block_size=3)
    program = generation.prepare(tiny_target, np.ones((2, 5), np.int32), 6, scripted, impl="pallas")
    assert generation._describe(program) == ("scripted drafter (batch 2, prompt 5, up to 6 new tokens, block 3, "
                                             "impl pallas)")
