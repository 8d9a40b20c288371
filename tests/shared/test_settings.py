"""One configuration path: ``STRATA_*`` variables are read only by ``shared/config.py``
(`ServiceConfig.load` for a service's settings, `RuntimeSettings` for the process-wide ones);
no other module in services/ or shared/ reads ``os.environ`` for them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shared.config import ConfigError, RuntimeSettings

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_MODULE = ROOT / "shared" / "config.py"


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr in ("environ", "environb", "getenv")
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _plain_key(node: ast.AST) -> bool:
    """A literal variable name that is not a ``STRATA_*`` one (``NO_COLOR``, ``CC``...)."""
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and not node.value.startswith("STRATA_")
    )


def env_reads(src: str) -> list[tuple[int, str]]:
    """Uses of the environment that may read a ``STRATA_*`` variable: ``os.environ.get(k)``,
    ``os.environ[k]`` or ``os.getenv(k)`` with ``k`` not a literal non-STRATA name, and any
    other use of ``os.environ`` (an alias such as ``env = os.environ``, ``from os import
    environ``) but handing the whole environment to a child (``dict(os.environ, ...)``,
    ``os.environ.copy()``) or replacing it in one (``os.environ.clear()``,
    ``os.environ.update(...)``: a forked process taking the environment it was given)."""
    tree = ast.parse(src)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bad: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "environb", "getenv") for a in node.names):
                bad.append((node.lineno, "from os import environ/getenv"))
        if not _is_environ(node):
            continue
        up = parents.get(node)
        if node.attr == "getenv":
            if not (isinstance(up, ast.Call) and up.args and _plain_key(up.args[0])):
                bad.append((node.lineno, "os.getenv of a STRATA_* or computed name"))
            continue
        if isinstance(up, ast.Subscript) and up.value is node:
            if not _plain_key(up.slice):
                bad.append((node.lineno, "os.environ[...] of a STRATA_* or computed name"))
            continue
        if isinstance(up, ast.Attribute) and up.value is node:
            call = parents.get(up)
            if up.attr in ("copy", "clear", "update"):
                continue  # the whole environment: copied for a child, or replaced in one
            if (
                up.attr == "get"
                and isinstance(call, ast.Call)
                and call.args
                and _plain_key(call.args[0])
            ):
                continue
            bad.append((node.lineno, f"os.environ.{up.attr} of a STRATA_* or computed name"))
            continue
        if (
            isinstance(up, ast.Call)
            and isinstance(up.func, ast.Name)
            and up.func.id == "dict"
            and up.args
            and up.args[0] is node
        ):
            continue  # dict(os.environ, KEY=...): the whole environment for a child process
        bad.append((node.lineno, "os.environ passed around (read it through shared.config)"))
    return bad


def test_no_module_reads_strata_variables_from_os_environ():
    files = [*(ROOT / "services").rglob("*.py"), *(ROOT / "shared").rglob("*.py")]
    assert any(p.match("services/launcher.py") for p in files)
    hits = []
    for p in files:
        if p == SETTINGS_MODULE:
            continue
        hits += [f"{p.relative_to(ROOT)}:{n}: {why}" for n, why in env_reads(p.read_text())]
    assert not hits, "read STRATA_* settings through shared.config:\n" + "\n".join(hits)


def test_the_check_catches_each_kind_of_read():
    assert env_reads('import os\nx = os.environ.get("STRATA_CACHE")\n')
    assert env_reads('import os\nx = os.environ["STRATA_CACHE"]\n')
    assert env_reads('import os\nx = os.getenv("STRATA_X", "1")\n')
    assert env_reads('import os\nK = "STRATA_X"\nx = os.environ.get(K)\n')
    assert env_reads("import os\nenv = os.environ\n")
    assert env_reads("from os import environ\n")
    assert env_reads('import os\nx = "STRATA_X" in os.environ\n')
    ok = (
        "import os\n"
        'a = os.environ.get("NO_COLOR")\n'
        'b = os.environ["PATH"]\n'
        'c = dict(os.environ, PYTHONUNBUFFERED="1")\n'
        "d = os.environ.copy()\n"
        "os.environ.clear()\n"
        "os.environ.update(d)\n"
        'e = os.getenv("CC", "cc")\n'
    )
    assert env_reads(ok) == []


def test_runtime_settings_defaults_and_values():
    s = RuntimeSettings.from_env({})
    assert (s.cpu_packed_gemm, s.cpu_kernels, s.cache, s.minio_bin) == (True, True, "", "")
    assert s.cpu_gemm == "auto"
    assert RuntimeSettings.from_env({"STRATA_CPU_GEMM": "onednn"}).cpu_gemm == "onednn"
    with pytest.raises(ConfigError, match="STRATA_CPU_GEMM"):
        RuntimeSettings.from_env({"STRATA_CPU_GEMM": "mkl"})
    assert s.cache_dir == str(ROOT / ".cache")
    env = {
        "STRATA_CACHE": "/c",
        "STRATA_CPU_KERNELS": "0",
        "STRATA_CPU_PACKED_GEMM": "false",
        "STRATA_MINIO_BIN": "/bin/minio",
        "STRATA_APP_PACKAGE": "fakeapps",
        "STRATA_NATS_USER": "decode",
        "STRATA_CPU_AFFINITY": "",  # empty = unset
        "STRATA_BLOCK_SIZE": "32",  # a service setting: not a runtime one
    }
    s = RuntimeSettings.from_env(env)
    assert (s.cache_dir, s.cpu_kernels, s.cpu_packed_gemm) == ("/c", False, False)
    assert (s.minio_bin, s.app_package, s.nats_user, s.cpu_affinity) == (
        "/bin/minio",
        "fakeapps",
        "decode",
        "",
    )


def test_runtime_settings_read_this_process_environment(monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", "/first")
    assert RuntimeSettings.from_env().cache_dir == "/first"
    monkeypatch.setenv("STRATA_CACHE", "/second")
    assert RuntimeSettings.from_env().cache_dir == "/second"


def test_bad_runtime_setting_names_the_variable():
    with pytest.raises(ConfigError) as err:
        RuntimeSettings.from_env({"STRATA_CPU_KERNELS": "sometimes"})
    msg = str(err.value)
    assert msg.startswith("invalid setting STRATA_CPU_KERNELS: ") and "(got 'sometimes')" in msg
