"""The README's commands and examples, run from the README's own text: its first command starts
the cluster on the built-in default model, then its curl lines and its Python example run as
written against it. A README edit that breaks an example turns this red."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.infra.procs import port_open, repo_root
from tests.acceptance.conftest import Up
from tests.acceptance.doc_examples import blocks as doc_blocks
from tests.acceptance.doc_examples import commands

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

README = f"{repo_root()}/README.md"


def blocks(lang: str) -> list[str]:
    return doc_blocks(README, lang)


def test_readme_has_the_two_commands_and_the_examples():
    bash = [c for b in blocks("bash") for c in commands(b)]
    assert "bash scripts/up.sh" in bash and "bash scripts/test.sh" in bash
    assert any(c.startswith("curl") and "/v1/chat/completions" in c for c in bash)
    assert any("from openai import OpenAI" in b for b in blocks("python"))


@pytest.fixture(scope="module")
def cluster():
    if port_open("127.0.0.1", 8000):
        pytest.skip("port 8000 is taken on this machine: the README's examples target it")
    first = next(c for b in blocks("bash") for c in commands(b) if c.startswith("bash scripts/up"))
    up = Up(["bash", "-c", first])  # the README's first command, as written
    assert up.url == "http://127.0.0.1:8000", up.url
    yield up
    assert up.stop() == 0, up.output()[-3000:]


def test_readme_curl_examples_run_as_written(cluster):
    curls = [c for b in blocks("bash") for c in commands(b) if c.startswith("curl")]
    assert len(curls) >= 2
    for cmd in curls:
        r = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {cmd} --fail-with-body -sS"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
        if '"stream": true' in cmd:
            events = [x for x in r.stdout.splitlines() if x.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) > 2, r.stdout[-2000:]
            assert '"content"' in r.stdout
        elif cmd.rstrip().endswith("/v1/models"):
            assert '"object":"list"' in r.stdout.replace(" ", ""), r.stdout


def test_readme_python_example_runs_as_written(cluster):
    example = next(b for b in blocks("python") if "from openai import OpenAI" in b)
    r = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), "the example printed no text"
