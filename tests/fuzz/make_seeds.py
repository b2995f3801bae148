#!/usr/bin/env python3
"""Writes the committed seed corpora of the fuzz targets (tests/fuzz/corpus/TARGET/) from valid inputs:
configs/tiny.yaml, a small safetensors file and config.json written here by the formats' definitions,
a shard set made by `longtrain prepare` (pass its directory), and the committed Megatron and
tokenizer.json fixtures (tests/fixtures/megatron, tests/fixtures/hf_tokenizer). Run from the
repository root:

    tests/fuzz/make_seeds.py SHARD_DIR
"""
import json
import os
import struct
import sys

root = "tests/fuzz/corpus"


def put(target, name, data):
    os.makedirs(f"{root}/{target}", exist_ok=True)
    with open(f"{root}/{target}/{name}", "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# config: first line the --set overrides (';'-separated), then the YAML.
tiny = open("configs/tiny.yaml").read()
put("config", "tiny", "\n" + tiny)
put("config", "tiny_overrides", "train.steps=5;optim.lr=1e-3;model.n_kv_heads=2;parallel.sp_size=2\n" + tiny)
put("config", "small", "train.batch_size=2\nmodel:\n  dim: 32\n  n_layers: 2\n  n_heads: 4\ndata:\n  train: d\n")

# safetensors: 8-byte little-endian header length, the JSON header (data_offsets into the data
# buffer that follows), then the data.
def safetensors(tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


f32 = struct.pack("<6f", 0.5, -1.0, 2.0, 0.25, 3.0, -0.125)
bf16 = bytes([0x80, 0x3f, 0x00, 0x40, 0x40, 0x40, 0x80, 0xbf])  # 1, 2, 3, -1
f16 = struct.pack("<4e", 1.0, -2.0, 0.5, 65504.0)
put("safetensors", "three_dtypes", safetensors(
    [("w", "F32", [2, 3], f32), ("b", "BF16", [4], bf16), ("h", "F16", [2, 2], f16)], {"format": "pt"}))
put("safetensors", "scalar_and_empty", safetensors([("s", "F32", [], struct.pack("<f", 1.5)), ("e", "F32", [0], b"")]))

# hf_config: a Llama config.json in transformers' 4.x form and in 5.x form (rope_parameters).
llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
put("hf_config", "llama4x", json.dumps(llama, indent=2))
v5 = dict(llama)
del v5["rope_theta"]
v5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
put("hf_config", "llama5x_rope_parameters", json.dumps(v5, indent=2))

# store: what one client sends over its connection, after a first byte whose low bit asks the target
# to put a valid hello first. Frames: [u32 length][u8 op][payload]; i64 little-endian; str = u32
# length + bytes. Ops: 1 hello, 2 set, 3 get, 4 add, 5 wait, 6 check, 7 erase, 8 register, 9 goodbye,
# 10 watch, 11 report failure.
def frame(op, payload=b""):
    return struct.pack("<IB", len(payload) + 1, op) + payload
def i64(v):
    return struct.pack("<q", v)
def s(text):
    b = text.encode()
    return struct.pack("<I", len(b)) + b
hello = frame(1, i64(0x316e7274676e6f6c))
put("store", "session", b"\x01" + frame(2, s("a") + s("1")) + frame(3, s("a")) + frame(4, s("n") + i64(5)) +
    frame(5, i64(10) + i64(2) + s("a") + s("n") + i64(0)) + frame(6, i64(2) + s("a") + s("b")) +
    frame(7, s("a")) + frame(3, s("a")))
put("store", "ranks", b"\x01" + frame(8, i64(0) + i64(2) + i64(1234) + s("host")) + frame(10, i64(0) + i64(5)) +
    frame(11, i64(0) + s("out of memory")) + frame(5, i64(5) + i64(1) + s("k") + i64(1)) + frame(9, i64(0)))
put("store", "explicit_hello", b"\x00" + hello + frame(3, s("missing")) + frame(99))
put("store", "no_hello", b"\x00" + frame(2, s("a") + s("b")))

# launcher_args: NUL-separated argv items after "longtrain-run"; "=NAME=VALUE" items set the environment.
put("launcher_args", "two_nodes", "\0".join(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4",
                                             "--master-addr", "node0", "--master-port", "29500", "--log-dir", "logs",
                                             "--grace-period", "2.5", "--", "longtrain", "train", "c.yaml"]))
put("launcher_args", "slurm", "\0".join(["=SLURM_STEP_ID=0", "=SLURM_NTASKS=2", "=SLURM_NNODES=2",
                                         "=SLURM_NODEID=1", "=SLURM_JOB_NODELIST=gpu[03-05,9],cpu7",
                                         "=MASTER_PORT=29600", "--nproc_per_node", "8", "longtrain", "train"]))
put("launcher_args", "help", "--help")
put("launcher_args", "bad_values", "\0".join(["--nnodes", "0", "--preempt-grace", "-1", "--", "x"]))

# shards: FuzzedDataProvider's order: manifest.json as a "random length string" (ended by a backslash
# and one other byte; a backslash inside is doubled), then the .idx whose length is read from the
# input's last two bytes, then the .bin (the rest).
if len(sys.argv) > 1:
    d = sys.argv[1]
    manifest = json.load(open(f"{d}/manifest.json"))
    # The fuzz target names the shard train-00000: keep only that one in the manifest.
    manifest["splits"] = {"train": manifest["splits"]["train"]}
    text = json.dumps(manifest).replace("\\", "\\\\").encode() + b"\\\n"
    idx = open(f"{d}/train-00000.idx", "rb").read()
    bin_ = open(f"{d}/train-00000.bin", "rb").read()
    assert len(idx) <= 4096
    n = len(idx)  # ConsumeIntegralInRange(0, 4096) reads the last byte as the high one, then the one before
    put("shards", "prepared", text + idx + bin_ + bytes([n & 0xff, n >> 8]))

# megatron: the .idx (its length in the input's last two bytes, as for shards), then the .bin.
for name in ("tiny_uint16", "tiny_int64"):
    idx = open(f"tests/fixtures/megatron/{name}.idx", "rb").read()
    bin_ = open(f"tests/fixtures/megatron/{name}.bin", "rb").read()
    n = len(idx)
    put("megatron", name, idx + bin_ + bytes([n & 0xff, n >> 8]))

# hf_tokenizer: the text as a random-length string (ended by a backslash and one other byte), then
# the tokenizer.json (the rest).
def fuzz_string(text):
    return text.replace("\\", "\\\\").encode() + b"\\\n"
for name, text in (("gpt2_style", "Hello <|endoftext|> world 42!"), ("llama3_style", "It's Mr. Darcy\n\n  caf\u00e9")):
    tok = open(f"tests/fixtures/hf_tokenizer/{name}/tokenizer.json", "rb").read()
    put("hf_tokenizer", name, fuzz_string(text) + tok)

# hf_tokenizer, small: a byte-level vocabulary with a few merges behind every normalizer (so that
# mutations reach the normalizers, not only a large vocabulary), an added token matched on
# normalized text and one on raw text.
def byte_level_alphabet():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]
vocab = {c: i for i, c in enumerate(byte_level_alphabet())}
merges = [["\u0120", "t"], ["h", "e"], ["\u0120t", "he"], ["c", "a"], ["f", "\u00c3"]]
for a, b in merges:
    vocab.setdefault(a, len(vocab))
    vocab.setdefault(b, len(vocab))
    vocab[a + b] = len(vocab)
small = {
    "added_tokens": [
        {"id": len(vocab), "content": "<|eot|>", "single_word": False, "lstrip": False, "rstrip": True,
         "normalized": False, "special": True},
        {"id": len(vocab) + 1, "content": "Miss Bennet", "single_word": True, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False}],
    "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "NFKC"}, {"type": "Lowercase"}, {"type": "NFD"}, {"type": "StripAccents"}, {"type": "NFC"},
        {"type": "NFKD"}, {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
        {"type": "Strip", "strip_left": True, "strip_right": True}, {"type": "Prepend", "prepend": " "}]},
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "post_processor": None,
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "ignore_merges": True, "vocab": vocab,
              "merges": merges},
}
put("hf_tokenizer", "normalizers", fuzz_string("THE caf\u00e9 \ufb01 \u039f\u03a3 \u0130 MISS BENNET<|eot|>  x")
    + json.dumps(small, ensure_ascii=False).encode())
