#!/usr/bin/env python3
"""An independent LLaMA forward in numpy over a Hugging Face directory.

Reads model.safetensors (its own parser of the documented format) and
config.json, runs transformers' LLaMA math (RMSNorm, rotate-half rotary
embeddings, grouped-query causal attention, SwiGLU, untied or tied head) on
the tokens in DIR/test_tokens.txt and compares the logits with
DIR/test_logits.f32 (what detour computed), atol 1e-4.

  hf_numpy_reference.py DIR BATCH SEQ

Exit status: 0 when they match, 1 when they do not (or the files are bad),
77 when numpy is missing (a skip).
"""
import json
import os
import struct
import sys

try:
    import numpy as np
except ImportError:
    print("numpy is not installed; skipping")
    sys.exit(77)

DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    buf = memoryview(data)[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        raw = buf[begin:end]
        if e["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(DTYPES[e["dtype"]]).newbyteorder("<"))
        out[name] = arr.astype(np.float64).reshape(e["shape"])
    return out


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rotary(x, theta):
    # x: [B, heads, T, hd]; rotate-half pairs element i with i + hd/2.
    t, hd = x.shape[2], x.shape[3]
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.outer(np.arange(t, dtype=np.float64), inv)
    cos = np.concatenate([np.cos(ang)] * 2, -1)
    sin = np.concatenate([np.sin(ang)] * 2, -1)
    half = hd // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def forward(w, cfg, tokens):
    d = cfg["hidden_size"]
    h = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads") or h
    hd = d // h
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = cfg.get("rope_theta", 10000.0)
    b, t = tokens.shape
    x = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.ones((t, t), dtype=bool), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        a = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(b, t, kvh, hd).transpose(0, 2, 1, 3)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(b, t, kvh, hd).transpose(0, 2, 1, 3)
        q, k = rotary(q, theta), rotary(k, theta)
        k = np.repeat(k, h // kvh, axis=1)
        v = np.repeat(v, h // kvh, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
        s = np.where(mask, -np.inf, s)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = (s @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = m @ w[p + "mlp.gate_proj.weight"].T
        u = m @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight")
    if head is None and cfg.get("tie_word_embeddings"):
        head = w["model.embed_tokens.weight"]
    return x @ head.T


def main():
    if len(sys.argv) != 4:
        print(__doc__)
        return 1
    d, b, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "llama":
        print("config.json model_type is not llama")
        return 1
    w = read_safetensors(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "test_tokens.txt")) as f:
        tokens = np.array([int(x) for x in f.read().split()], dtype=np.int64).reshape(b, t)
    ours = np.fromfile(os.path.join(d, "test_logits.f32"), dtype="<f4")
    ours = ours.reshape(b, t, cfg["vocab_size"]).astype(np.float64)
    ref = forward(w, cfg, tokens)
    diff = float(np.abs(ref - ours).max())
    print("numpy reference: %d tensors, logits %s, max abs diff %.3g" % (len(w), ref.shape, diff))
    return 0 if diff <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
