"""GGUF files read in place: every block type against transformers reading the same file, every
common format kept as stored and equal to the file dequantized by the ``gguf`` package, one INFO line
saying what stayed as stored, and damaged files refused with the file, tensor and type named —
nothing half-written left in the cache."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from modelrunner import LLM
from modelrunner.errors import ModelSourceError
from modelrunner.loading.source import convert_gguf, resolve_source

from .gguf_files import tiny_llama, write_llama_gguf

IDS = [504, 3575, 282, 4649, 314, 12, 99, 1000, 49000]
KW = dict(kv_cache_memory=2**22, block_size=4)


def _transformers_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("layout, kept", [
    ({}, {"int8 from Q8_0/g32 symmetric": 10}),  # embedding, LM head, 2 × (qkv, o, gate/up, down)
    ({"attn": T.Q4_0, "ffn": T.Q4_1}, {"int8 from Q8_0/g32 symmetric": 2, "int4 from Q4_0/g32": 4,
                                      "int4 from Q4_1/g32": 4}),
    # q/k/v in two formats share one storage in their common form; gate/up with a float member: float.
    ({"ffn_up": T.F16, "attn_v": T.Q4_0}, {"int8 from Q8_0/g32 symmetric": 6, "int8 from Q4_0+Q8_0/g32": 2}),
])
def test_blocks_run_as_stored_and_match_transformers_reading_the_same_file(tmp_path, layout, kept):
    path = write_llama_gguf(tiny_llama(tie=False), tmp_path / "tiny.gguf", types=layout)
    want = _transformers_logits(path, IDS)
    stored = LLM(str(path), quantization_options={"activations": "float"}, **KW)  # exact kernels
    assert stored.runner.stats()["quantization"]["formats"] == kept
    dense = LLM(str(path), quantization="none", **KW)
    for llm in (stored, dense):
        diff = (llm.runner.forward(IDS) - want).abs().max().item()
        assert diff < 1e-4, diff


def test_metadata_and_tokenizer_fields_read_as_transformers_reads_them():
    # modelrunner reads the metadata itself (a cold start's vocabulary in a tenth of the time); the
    # values, and the fields handed to transformers' tokenizer converter, must be transformers' own.
    from transformers.integrations.gguf import get_gguf_tokenizer
    from transformers.integrations.gguf.reader import read_gguf_metadata

    from modelrunner.loading.gguf_file import GGUFCheckpoint
    from modelrunner.loading.gguf_metadata import read_metadata
    from modelrunner.loading.source import _alias_file

    path = str(_alias_file("smollm2"))
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    assert read_metadata(path, arrays) == read_gguf_metadata(path, arrays)[0]
    assert read_metadata(path) == read_gguf_metadata(path, ())[0]
    architecture, *fields = get_gguf_tokenizer(path)
    checkpoint = GGUFCheckpoint(path)
    assert (checkpoint.architecture, *checkpoint.tokenizer_fields()) == (architecture, *fields)


@pytest.mark.parametrize("values", [{}, {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                         "head_dim": 32, "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 5e5}}, None])
def test_a_llama_files_config_equals_transformers_llama_config(values):
    # Built without importing transformers (half a second of a load): every field must be LlamaConfig's.
    from transformers import LlamaConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from modelrunner.loading.gguf_config import GGUF_CONFIG_KEYS, GGUFLlamaConfig
    from modelrunner.loading.gguf_file import GGUFCheckpoint
    from modelrunner.loading.source import _alias_file

    for arch, keys in GGUF_CONFIG_KEYS.items():
        assert keys == {k: v for k, v in GGUF_CONFIG_MAPPING[arch].items() if v is not None}, arch
    if values is None:
        values = GGUFCheckpoint(_alias_file("smollm2")).config_values()
    config = GGUFLlamaConfig(**values)
    theirs = LlamaConfig(**values)
    ours = config.to_dict()
    assert ours.pop("model_type") == theirs.model_type
    assert {name: getattr(theirs, name) for name in ours} == ours
    assert ours.keys() >= set(theirs.to_dict()) - set(type(theirs).__mro__[1]().to_dict()), "a field is missing"
    converted = config.to_transformers()
    assert type(converted) is LlamaConfig and converted.to_dict() == theirs.to_dict()
    assert pickle.loads(pickle.dumps(config)) == config  # worker processes get it so
    assert config.get_text_config() is config


# Every format the kernel keeps, in three files (K-quants need rows of 256): each tensor class in another
# format, so q/k/v and gate/up mix formats (one storage in their common form) as llama.cpp's mixes do.
FORMAT_FILES = [
    {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q5_K, "ffn_gate": T.Q2_K,
     "ffn_up": T.Q3_K, "ffn_down": T.Q6_K, "token_embd": T.IQ4_NL, "output": T.IQ4_XS},
    {"attn_q": T.Q5_0, "attn_k": T.Q5_1, "attn_v": T.Q5_0, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
     "ffn_up": T.Q4_1, "ffn_down": T.Q5_1, "token_embd": T.Q6_K, "output": T.Q4_K},
    {"attn": T.Q4_K, "ffn": T.Q4_K, "token_embd": T.Q6_K},  # Q4_K_M's two formats, tied embeddings
]


@pytest.mark.parametrize("types", FORMAT_FILES, ids=["k-quants", "legacy", "q4_k_m"])
def test_every_format_runs_as_stored_and_equals_the_file_dequantized(tmp_path, types, caplog):
    from modelrunner.quantization.blocks import ggml_type_name

    tie = "output" not in types
    path = write_llama_gguf(tiny_llama(hidden=256, intermediate=512, tie=tie), tmp_path / "f.gguf", types=types)
    with caplog.at_level(logging.INFO, logger="modelrunner"):
        stored = LLM(str(path), quantization_options={"activations": "float"}, **KW)
    tensors = stored.runner.stats()["quantization"]["tensors"]
    expected: dict[str, int] = {}
    for kind in types.values():  # per layer, the tensors of each class (2 layers; embedding, head once)
        expected[ggml_type_name(kind)] = 0
    assert set(tensors["as_stored"]) == set(expected) and tensors["dequantized"] == {}
    assert sum(tensors["as_stored"].values()) == 2 * 7 + 1 + (not tie)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("gguf: ")] == [
        "gguf: " + ", ".join(f"{n} {k}" for k, n in sorted(tensors["as_stored"].items())) + " as stored"]
    dense = LLM(str(path), quantization="none", **KW)  # the gguf package's dequantization, float32
    want = dense.runner.forward(IDS)
    got = stored.runner.forward(IDS)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    from modelrunner import SamplingParams

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in stored.generate(["Hello", "The sky"], greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in dense.generate(["Hello", "The sky"], greedy, use_tqdm=False)]


def test_blocks_kept_as_the_file_stores_them_run_through_a_kernel_that_reads_them(tmp_path):
    # The reference kernel reads every format's blocks: pinned, each layer keeps the file's bytes
    # (GGMLScheme), and the mixed q/k/v of a Q4_K_M-like file keeps each member's (MixedGGMLScheme).
    path = write_llama_gguf(tiny_llama(hidden=256, intermediate=512), tmp_path / "k.gguf",
                            types={"attn_v": T.Q6_K, "attn": T.Q4_K, "ffn_down": T.Q6_K, "ffn": T.Q4_K,
                                   "token_embd": T.Q6_K})
    stored = LLM(str(path), quantization_options={"kernel": "reference"}, **KW)
    formats = stored.runner.stats()["quantization"]["formats"]
    # The tied LM head counts with the embedding it shares.
    assert formats == {"Q4_K as stored": 4, "Q6_K as stored": 4, "Q4_K+Q4_K+Q6_K as stored": 2}, formats
    dense = LLM(str(path), quantization="none", **KW)
    want = dense.runner.forward(IDS)
    assert (stored.runner.forward(IDS) - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def _mapped_from(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of ``path``."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == str(path.resolve()):
                start, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_blocks_kept_whole_are_the_files_mapped_pages_and_writes_never_reach_the_file(tmp_path):
    path = write_llama_gguf(tiny_llama(hidden=256, intermediate=512), tmp_path / "m.gguf",
                            types={"attn_v": T.Q6_K, "attn": T.Q4_K, "ffn_down": T.Q6_K, "ffn": T.Q4_K,
                                   "token_embd": T.Q6_K})
    before = path.read_bytes()
    stored = LLM(str(path), quantization_options={"kernel": "reference"}, **KW)
    ranges = _mapped_from(path)
    model = stored.runner.loaded.model

    def mapped(t: torch.Tensor) -> bool:
        return any(start <= t.data_ptr() and t.data_ptr() + t.numel() <= end for start, end in ranges)

    layer = model.model.layers[0]
    # Whole tensors as the file stores them: the mapping's pages (o, down, the embedding and each member
    # of the mixed q/k/v but q and k, whose rows are put back in Hugging Face's order).
    assert mapped(layer.self_attn.o_proj.weight) and mapped(layer.mlp.down_proj.weight)
    assert mapped(model.model.embed_tokens.weight)
    members = layer.self_attn.qkv_proj.ggml_members
    assert [mapped(m.weight) for m in members] == [False, False, True]
    assert not mapped(layer.mlp.gate_up_proj.weight)  # gate and up stored side by side: a copy
    want = stored.runner.forward(IDS)
    with torch.no_grad():  # copy-on-write: the process's page changes, the file does not
        layer.self_attn.o_proj.weight.data[0].fill_(0)
    assert path.read_bytes() == before
    assert not torch.equal(stored.runner.forward(IDS), want)


def test_a_file_that_cannot_be_mapped_is_read(tmp_path, monkeypatch):
    import mmap
    import types

    from modelrunner.loading import gguf_file

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # what mmap says on a file system that cannot map

    path = write_llama_gguf(tiny_llama(hidden=256, intermediate=512), tmp_path / "r.gguf",
                            types={"attn": T.Q4_K, "ffn": T.Q4_K, "token_embd": T.Q6_K})
    mapped = LLM(str(path), quantization_options={"kernel": "reference"}, **KW).runner.forward(IDS)
    monkeypatch.setattr(gguf_file, "mmap", types.SimpleNamespace(mmap=refuse, ACCESS_COPY=mmap.ACCESS_COPY))
    read = LLM(str(path), quantization_options={"kernel": "reference"}, **KW)
    o_proj = read.runner.loaded.model.model.layers[0].self_attn.o_proj.weight
    assert not any(start <= o_proj.data_ptr() < end for start, end in _mapped_from(path))
    assert torch.equal(read.runner.forward(IDS), mapped)


def test_a_tensor_type_no_reader_supports_is_named(tmp_path):
    # Q8_K is llama.cpp's format of activations: no file stores weights in it, nothing reads it.
    path = write_llama_gguf(tiny_llama(intermediate=256), tmp_path / "q8k.gguf", types={"blk.1.ffn_down": T.Q8_K},
                            encode=lambda name, array, kind: np.zeros((array.shape[0], array.shape[1] // 256 * 292),
                                                                      dtype=np.uint8) if kind == T.Q8_K else None)
    with pytest.raises(ModelSourceError, match=rf"{path}: tensor 'blk.1.ffn_down.weight' has ggml type Q8_K \(15\), "
                                               r"which no installed reader supports \(supported: .*Q4_K.*\)"):
        LLM(str(path), **KW)


def test_truncated_and_corrupt_files_fail_naming_the_file_and_leave_no_cache_entry(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MODELRUNNER_CACHE_DIR", str(cache))
    path = write_llama_gguf(tiny_llama(), tmp_path / "cut.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    for quantization in ("gguf", "none"):
        with pytest.raises(ModelSourceError, match=rf"{path}: tensor '[\w.]+' \(Q8_0\) ends at byte [\d,]+ but the "
                                                   r"file has [\d,]+ bytes: the file is truncated"):
            LLM(str(path), quantization=quantization, **KW)
    path.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ModelSourceError, match=rf"{path}: not a readable GGUF file"):
        LLM(str(path), **KW)
    path.write_bytes(b"")
    with pytest.raises(ModelSourceError, match=rf"{path}: the file is empty"):
        LLM(str(path), **KW)
    assert not cache.exists() or not any(cache.rglob("*.safetensors"))


def test_conversion_is_atomic_and_follows_the_umask(tmp_path):
    path = write_llama_gguf(tiny_llama(), tmp_path / "conv.gguf")
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelSourceError, match=str(path)):
        convert_gguf(path, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == []  # no half-written entry
    path.write_bytes(good)
    previous = os.umask(0o002)
    try:
        target = convert_gguf(path, tmp_path / "cache")
    finally:
        os.umask(previous)
    assert target.stat().st_mode & 0o777 == 0o775
    assert {f.stat().st_mode & 0o777 for f in target.iterdir()} == {0o664}
    # The converted directory is what the generic transformers adapter (and quantization="none" users
    # with code that needs a directory) read; its weights are the file's, dequantized.
    assert resolve_source(str(path)).gguf is not None


def test_blocks_are_read_when_the_loader_asks_and_equal_the_file_after_the_reading_ended(tmp_path):
    import gguf

    from modelrunner.quantization import GGMLBlocks

    path = write_llama_gguf(tiny_llama(intermediate=256), tmp_path / "deferred.gguf", types={"ffn_down": T.Q4_K})
    stored = {t.name: torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(t.shape[::-1][0], -1)
              for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type not in (T.F32, T.F16)}
    source = resolve_source(str(path))
    blocks = {}
    for name, tensor in source.iter_weights():  # the file is closed once the iteration has ended
        if isinstance(tensor, GGMLBlocks) and "q_proj" not in name and "k_proj" not in name:
            blocks[tensor.name] = tensor
    assert len(blocks) == 11 and {b.type_name for b in blocks.values()} == {"Q8_0", "Q4_K"}
    for name, tensor in blocks.items():
        rows = tensor.shape[0]
        part = tensor.narrow(0, 1, rows - 2)  # rows of deferred blocks are read on their own
        target = torch.empty(rows - 2, tensor.row_bytes, dtype=torch.uint8)
        part.copy_to(target)
        assert torch.equal(target, stored[name][1:rows - 1]), name
        assert torch.equal(part.mapping(), stored[name][1:rows - 1]), name  # a rank's rows, mapped
        assert torch.equal(tensor.data, stored[name]), name


def test_a_vocabulary_that_makes_no_tokenizer_fails_the_load_naming_the_file(tmp_path):
    import gguf

    from modelrunner_kit.conformance.gguf import add_tokenizer, write_gguf

    from .gguf_files import _smollm2_tokenizer

    def broken(writer: gguf.GGUFWriter) -> None:
        fields = dict(_smollm2_tokenizer())
        fields["tokenizer.ggml.merges"] = ["not-a-merge-line"]
        add_tokenizer(writer, fields)

    model = tiny_llama()
    state = ((k, v.detach().float().numpy()) for k, v in model.state_dict().items())
    path = write_gguf(model.config, state, tmp_path / "vocab.gguf", {}, T.Q8_0, metadata=broken)
    # The tokenizer is built on a thread of its own while the weights load: its error still reaches the caller.
    with pytest.raises(ModelSourceError, match=rf"{path}: cannot build the tokenizer its metadata describes"):
        LLM(str(path), **KW)
    assert wait_for_no_tokenizer_threads()


def wait_for_no_tokenizer_threads() -> bool:
    import threading
    import time

    deadline = time.monotonic() + 5
    while any(t.name == "modelrunner-tokenizer" for t in threading.enumerate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_saved_tokenizer_reads_back_equal_to_the_one_built_and_a_damaged_copy_is_rebuilt(tmp_path):
    # A GGUF vocabulary is converted once (transformers) and saved under a digest of the file's metadata;
    # later loads read the saved copy with `tokenizers` alone. It must tokenize, decode and template exactly
    # as transformers' tokenizer built from the file.
    from transformers import AutoTokenizer

    from modelrunner.loading.gguf_file import GGUFCheckpoint
    from modelrunner.loading.gguf_tokenizer import GGUFTokenizer
    from modelrunner.loading.source import _alias_file

    checkpoint = GGUFCheckpoint(_alias_file("smollm2"))
    built = checkpoint.tokenizer().to_transformers()  # no cache: transformers' own, wrapped
    first = checkpoint.tokenizer(tmp_path)
    (saved,) = (tmp_path / "tokenizers").iterdir()
    assert (saved / "tokenizer.json").is_file() and not saved.name.startswith(".partial")
    again = checkpoint.tokenizer(tmp_path)
    assert type(first) is type(again) is GGUFTokenizer and again._transformers is None
    copied = tmp_path / "copy"
    first.save_pretrained(copied)
    texts = ["Hello world!", "  spaces\tand\nnewlines  ", "<|im_start|>user\nhé ünïcode 日本<|im_end|>", "",
             "don't stop , it 's fine ."]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    names = ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id",
             "unk_token_id", "all_special_ids", "all_special_tokens", "vocab_size", "chat_template")
    for tokenizer in (first, again, AutoTokenizer.from_pretrained(str(copied))):
        for text in texts:
            for special in (True, False):
                assert tokenizer.encode(text, add_special_tokens=special) == \
                    built.encode(text, add_special_tokens=special), text
            ids = built.encode(text)
            for skip in (True, False):
                assert tokenizer.decode(ids, skip_special_tokens=skip) == built.decode(ids, skip_special_tokens=skip)
                assert tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
                    built.convert_ids_to_tokens(ids, skip_special_tokens=skip)
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
            built.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert {n: getattr(tokenizer, n) for n in names} == {n: getattr(built, n) for n in names}
        assert (len(tokenizer), tokenizer.get_vocab()) == (len(built), built.get_vocab())
    assert pickle.loads(pickle.dumps(again)).encode(texts[2]) == built.encode(texts[2])
    assert again.model_max_length == built.model_max_length  # anything else: transformers' tokenizer answers
    (saved / "tokenizer.json").write_text("{not json")
    rebuilt = checkpoint.tokenizer(tmp_path)  # the damaged copy is replaced by a fresh one
    assert rebuilt.encode(texts[2]) == built.encode(texts[2])
    assert checkpoint.tokenizer(tmp_path).encode(texts[2]) == built.encode(texts[2])


def test_a_llama_file_loads_and_generates_without_importing_transformers(tmp_path):
    # Importing transformers is half a second of a 2-core load: a llama GGUF file needs none of it once its
    # tokenizer is saved (the first load converts it); chat and grammar backends import it when used.
    import subprocess
    import sys

    from modelrunner.loading.source import _alias_file

    script = (
        "import sys\n"
        "from modelrunner import LLM, SamplingParams\n"
        f"llm = LLM({str(_alias_file('smollm2'))!r}, max_model_len=256, kv_cache_memory=2**24)\n"
        "out = llm.generate(['The capital of France is'], SamplingParams(max_tokens=4, temperature=0))\n"
        "assert out[0].outputs[0].text, out\n"
        "print('transformers' in sys.modules)\n"
        "llm.chat([{'role': 'user', 'content': 'Hi'}], SamplingParams(max_tokens=2))\n"
        "print('transformers' in sys.modules)\n")
    env = {**os.environ, "MODELRUNNER_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert runs[0].stdout.split() == ["True", "True"]  # converting the vocabulary the first time needs it
    assert runs[1].stdout.split() == ["False", "True"]  # then only chat templates do
