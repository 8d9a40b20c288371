"""The vision role follows the checkpoint: a text-only model gets no vision service (one log line
says why), and `strata serve vision` on one exits with one clear line, not a traceback."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from services.cluster_config import vision_replicas
from services.infra.procs import repo_root
from services.launcher import Cluster
from shared.model.validate import text_only_reason
from tests.infra.fake_apps import write_fake_apps, write_fake_checkpoint

LLAVA = "LlavaForConditionalGeneration"
TEXT = ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"]


@pytest.mark.parametrize("arch", TEXT)
def test_text_only_checkpoint_turns_vision_off(tmp_path, arch):
    model = write_fake_checkpoint(tmp_path / "m", arch)
    n, why = vision_replicas(model, 2)
    assert n == 0
    assert why == (
        f"vision role off: {model} is a text-only checkpoint ({arch}, no vision "
        "tower); requests with images get a 400"
    )
    assert vision_replicas(model, 0) == (0, "")  # --vision 0: nothing to say


def test_multimodal_or_unreadable_checkpoint_keeps_what_was_asked(tmp_path):
    llava = write_fake_checkpoint(tmp_path / "llava", LLAVA)
    assert vision_replicas(llava, 2) == (2, "") and text_only_reason(llava) is None
    assert vision_replicas(llava, 0) == (0, "")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert vision_replicas(str(broken), 1) == (1, "")  # checkpoint validation reports it


def test_serve_vision_on_a_text_model_exits_with_one_line(tmp_path):
    model = write_fake_checkpoint(tmp_path / "qwen2", "Qwen2ForCausalLM")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "vision",
            "--model",
            model,
            "--nats-url",
            "nats://127.0.0.1:1",
        ],
        cwd=repo_root(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"strata serve vision: {model} is a text-only checkpoint (Qwen2ForCausalLM, no vision "
        "tower); it needs no vision service"
    ]


def test_cluster_starts_vision_only_for_a_model_that_takes_images(tmp_path):
    root = write_fake_apps(tmp_path / "apps")
    env = {"STRATA_APP_PACKAGE": "fakeapps", "PYTHONPATH": os.pathsep.join([repo_root(), root])}
    for arch, want in (("Qwen2ForCausalLM", []), (LLAVA, ["vision-0"])):
        model = write_fake_checkpoint(tmp_path / arch, arch)
        log = io.StringIO()
        with Cluster(
            model, minio=False, kvstore=0, prefill=0, env=env, log_stream=log, color=False
        ) as c:
            assert c.names("vision") == want
            assert c.names("decode") == ["decode-0"]
        lines = [ln for ln in log.getvalue().splitlines() if "vision role off" in ln]
        assert lines == (
            [
                f"[strata] vision role off: {model} is a text-only checkpoint ({arch}, "
                "no vision tower); requests with images get a 400"
            ]
            if not want
            else []
        )
