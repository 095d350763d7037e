"""Presets: our GGUF conversion makes the very folder transformers' own GGUF loading makes, and bad files are refused."""

import filecmp

import pytest
import torch
from safetensors.torch import load_file

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resolve import PRESETS, _convert_gguf, _package_file, read_gguf


@pytest.fixture(scope="module")
def smollm2_gguf():
    preset = PRESETS["smollm2-135m"]
    ((module, rel),) = preset.packages
    return _package_file(module, rel, preset)


def test_conversion_equals_transformers_gguf_loading(smollm2_gguf, tmp_path):
    """Same config, generation config, tokenizer files and float32 tensors, bit for bit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, ref = tmp_path / "ours", tmp_path / "ref"
    _convert_gguf(smollm2_gguf, ours)
    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized already; save_pretrained refuses a GGUF quantizer
    del model.config.quantization_config
    model.save_pretrained(ref)
    tok.save_pretrained(ref)

    names = sorted(p.name for p in ref.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    for name in names:
        if name != "model.safetensors":
            assert filecmp.cmp(ours / name, ref / name, shallow=False), name
    a, b = load_file(ours / "model.safetensors"), load_file(ref / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == torch.float32 and torch.equal(a[k], b[k]) for k in a)


def test_reader_reads_what_the_gguf_package_reads(smollm2_gguf):
    """Scalars and tensor layout against `gguf.GGUFReader` (the vocabulary's length stands for its 49k strings)."""
    from gguf import GGUFReader

    meta, tensors = read_gguf(smollm2_gguf)
    ref = GGUFReader(smollm2_gguf)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == ref.fields["llama.block_count"].contents()
    assert len(meta["tokenizer.ggml.tokens"]) == len(ref.fields["tokenizer.ggml.tokens"].data)
    assert meta["tokenizer.ggml.tokens"][:50] == ref.fields["tokenizer.ggml.tokens"].contents()[:50]
    by_name = {t.name: t for t in ref.tensors}
    assert sorted(tensors) == sorted(by_name)
    for name, (kind, shape, raw) in tensors.items():
        t = by_name[name]
        assert kind == t.tensor_type and shape == tuple(reversed(t.shape.tolist())), name
        assert raw.nbytes == t.n_bytes and bytes(raw[:64]) == bytes(t.data.view("uint8").reshape(-1)[:64]), name


def test_bad_files_get_one_sentence(tmp_path):
    from gguf import GGUFWriter

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(DFlashError, match="is not a GGUF file"):
        read_gguf(junk)

    other = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(other, "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(DFlashError, match="holds a 'gpt2' model; presets convert llama, qwen2 only"):
        _convert_gguf(other, tmp_path / "out")
    assert not (tmp_path / "out").exists()
