#!/usr/bin/env python3
"""gen_quant_fixtures.py — quantised checkpoints of tests/fixtures/tiny_hf and their exactly dequantised weights.

numpy only, written from the formats' definitions (docs/checkpoints.md), not from ds4's C code:
  e4m3 (torch float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
      (m/8 * 2^-6); S.1111.111 is NaN; no infinities; largest 448.
  e8m0: one byte b, the value 2^(b-127); 255 is NaN.
  e2m1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; two
      per byte, element 2j in the low nibble and 2j+1 in the high one (DeepSeek's converter unpacks
      low, high); one e8m0 scale per 32 consecutive values of a row.
  FP8 block scales: one per br x bc block of the weight, [ceil(rows/br), ceil(cols/bc)]; value = e4m3 * scale.

Writes, under tests/fixtures/:
  quant_official/      official names (layers.N.attn.wq_a.weight + .scale, per-expert experts.E.w1.weight),
                       e8m0 scales, routed experts FP4 packed in I8 where their rows are a multiple of 32 values
                       long (w1, w3; tiny_hf's w2 rows are 16 long, so w2 is FP8), every other 2-D weight FP8 with
                       128x128 blocks; two shards with an index, each scale in the other shard than its weight.
  quant_official_ref/  the same tensors dequantised to F32 (official names).
  quant_hf/            tiny_hf's names, FP8 with F32 `weight_scale_inv` in 16x24 blocks (quantization_config's
                       weight_block_size), so that blocks are many and the last ones partial; packed 3-D experts
                       stay F32.
  quant_hf_ref/        the same dequantised to F32.
  quant_fp4/           a variant of tiny_hf with 8 routed experts of intermediate size 32 (the new expert tensors
                       random, seeded), so that every routed expert matrix (w1, w2, w3) has rows of 32 values and is
                       FP4; everything else F32, official names. The fixture of the FP4-resident experts.
  quant_fp4_ref/       the same dequantised to F32.
tests/gen_quant_logits.py (torch, transformers) adds transformers' logits of each *_ref model.
The products are computed in float32, as the format's readers do (an e8m0 scale makes them exact).

Usage: python3 tests/gen_quant_fixtures.py [FIXTURES_DIR]
"""
import json
import os
import struct
import sys

import numpy as np

FP8_MAX = 448.0
FP4_BLOCK = 32


# ------------------------------------------------------------------------------------------ safetensors (numpy)

DTYPES = {"F32": np.float32, "I64": np.int64, "I8": np.int8, "U8": np.uint8, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8}


def st_read(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        arr = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=DTYPES[meta["dtype"]])
        out[name] = (meta["dtype"], arr.reshape(meta["shape"]).copy())
    return out


def st_write(path, tensors):
    """tensors: list of (name, dtype string, array) in file order."""
    header, blobs, off = {}, [], 0
    for name, dtype, arr in tensors:
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


# ------------------------------------------------------------------------------------------ the formats

def e4m3_values():
    """The value of every byte 0..255 (NaN for S.1111.111)."""
    v = np.empty(256, dtype=np.float64)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        if e == 15 and m == 7:
            v[b] = np.nan
        elif e == 0:
            v[b] = m / 8.0 * 2.0 ** -6
        else:
            v[b] = (1 + m / 8.0) * 2.0 ** (e - 7)
        if s:
            v[b] = -v[b]
    return v


E4M3 = e4m3_values()
E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_values():
    return np.array([(-1.0 if c & 8 else 1.0) * E2M1_MAG[c & 7] for c in range(16)])


E2M1 = e2m1_values()


def nearest_code(x, table):
    """The finite non-negative code of `table` (codes 0..len/2-1) nearest to |x|, with the sign bit of x."""
    half = len(table) // 2
    mags = table[:half]
    ok = np.isfinite(mags)
    idx = np.nonzero(ok)[0]
    best = idx[np.argmin(np.abs(np.abs(x)[..., None] - mags[idx]), axis=-1)]
    return np.where(np.signbit(x), best + half, best).astype(np.uint8)


def e8m0_byte(x):
    """The byte of 2^ceil(log2 x): the smallest power of two >= x (so |w| / scale stays within range)."""
    e = int(np.ceil(np.log2(x))) if x > 0 else 0
    return np.uint8(min(max(e + 127, 0), 254))


def e8m0_value(b):
    return np.float32(2.0 ** (int(b) - 127))


def quant_fp8(w, br, bc, e8m0):
    """w [rows, cols] float32 -> (codes uint8 [rows, cols], scales, dequantised float32)."""
    rows, cols = w.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    codes = np.zeros((rows, cols), dtype=np.uint8)
    scales = np.zeros((nr, nc), dtype=np.uint8 if e8m0 else np.float32)
    deq = np.zeros((rows, cols), dtype=np.float32)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].astype(np.float64)
            amax = float(np.abs(blk).max())
            if e8m0:
                scales[i, j] = e8m0_byte(amax / FP8_MAX)
                s = e8m0_value(scales[i, j])
            else:
                scales[i, j] = s = np.float32(amax / FP8_MAX if amax > 0 else 1.0)
            c = nearest_code(blk / float(s), E4M3)
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = c
            deq[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = E4M3[c].astype(np.float32) * s
    return codes, scales, deq


def quant_fp4(w):
    """w [rows, cols] (cols % 32 == 0) -> (packed int8 [rows, cols/2], e8m0 scales [rows, cols/32], dequantised)."""
    rows, cols = w.shape
    assert cols % FP4_BLOCK == 0
    scales = np.zeros((rows, cols // FP4_BLOCK), dtype=np.uint8)
    codes = np.zeros((rows, cols), dtype=np.uint8)
    deq = np.zeros((rows, cols), dtype=np.float32)
    for r in range(rows):
        for j in range(cols // FP4_BLOCK):
            blk = w[r, j * FP4_BLOCK:(j + 1) * FP4_BLOCK].astype(np.float64)
            scales[r, j] = e8m0_byte(float(np.abs(blk).max()) / 6.0)
            s = e8m0_value(scales[r, j])
            c = nearest_code(blk / float(s), E2M1)
            codes[r, j * FP4_BLOCK:(j + 1) * FP4_BLOCK] = c
            deq[r, j * FP4_BLOCK:(j + 1) * FP4_BLOCK] = E2M1[c].astype(np.float32) * s
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, scales, deq


# ------------------------------------------------------------------------------------------ names

ATTN = {"q_a_proj": "wq_a", "q_b_proj": "wq_b", "q_a_norm": "q_norm", "kv_proj": "wkv", "kv_norm": "kv_norm",
        "o_a_proj": "wo_a", "o_b_proj": "wo_b"}
COMP = {"kv_proj": "wkv", "gate_proj": "wgate", "kv_norm": "norm", "position_bias": "ape"}
SHARED = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def official_name(hf):
    """tiny_hf's transformers name -> the official release's (docs/architecture.md, "Checkpoint names")."""
    top = {"lm_head.weight": "head.weight", "model.embed_tokens.weight": "embed.weight",
           "model.norm.weight": "norm.weight", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_scale": "hc_head_scale"}
    if hf in top:
        return top[hf]
    p = hf.split(".")
    assert p[0] == "model" and p[1] == "layers", hf
    pre, r = "layers.%s." % p[2], p[3:]
    if r[0] in ("attn_hc", "ffn_hc"):
        return pre + "hc_%s_%s" % (r[0][:-3], r[1])
    if r == ["input_layernorm", "weight"]:
        return pre + "attn_norm.weight"
    if r == ["post_attention_layernorm", "weight"]:
        return pre + "ffn_norm.weight"
    if r[0] == "mlp":
        if r[1] == "gate":
            return pre + "ffn.gate." + {"e_score_correction_bias": "bias"}.get(r[2], r[2])
        if r[1] == "shared_experts":
            return pre + "ffn.shared_experts.%s.weight" % SHARED[r[2]]
    if r[0] == "self_attn":
        if r[1] == "sinks":
            return pre + "attn.attn_sink"
        if r[1] in ATTN:
            return pre + "attn.%s.weight" % ATTN[r[1]]
        if r[1] == "compressor":
            if r[2] == "indexer":
                if r[3] == "q_b_proj":
                    return pre + "attn.indexer.wq_b.weight"
                if r[3] == "scorer":
                    return pre + "attn.indexer.weights_proj.weight"
                return pre + "attn.indexer.compressor." + COMP[r[3]] + (".weight" if r[3] != "position_bias" else "")
            return pre + "attn.compressor." + COMP[r[2]] + (".weight" if r[2] != "position_bias" else "")
    raise ValueError("no official name for " + hf)


def official_tensors(src):
    """tiny_hf's tensors under official names, the packed experts split per expert (w1, w2, w3)."""
    out = []
    for name, (dtype, arr) in src.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            pre = "layers.%s.ffn.experts." % name.split(".")[2]
            for e in range(arr.shape[0]):
                if name.endswith("gate_up_proj"):
                    half = arr.shape[1] // 2  # rows [0, I) are w1 (gate), [I, 2I) are w3 (up)
                    out.append((pre + "%d.w1.weight" % e, dtype, arr[e, :half]))
                    out.append((pre + "%d.w3.weight" % e, dtype, arr[e, half:]))
                else:
                    out.append((pre + "%d.w2.weight" % e, dtype, arr[e]))
        else:
            out.append((official_name(name), dtype, arr))
    return out


# ------------------------------------------------------------------------------------------ writers

def is_linear(name, arr):
    return arr.ndim == 2 and name.endswith(".weight")


def split(tensors, quantise):
    """(quantised tensors, reference tensors): quantise(name, arr) gives (weight entry, scale entry, dequantised)
    for every F32 2-D weight; the other tensors go to both lists unchanged."""
    quant, ref = [], []
    for name, dtype, arr in tensors:
        if dtype == "F32" and is_linear(name, arr):
            w, s, deq = quantise(name, arr)
            quant += [w, s]
            ref.append((name, "F32", deq))
        else:
            quant.append((name, dtype, arr))
            ref.append((name, dtype, arr))
    return quant, ref


def official_quantise(name, arr):
    scale_name = name[:-len(".weight")] + ".scale"
    if ".ffn.experts." in name and arr.shape[1] % FP4_BLOCK == 0:
        packed, scales, deq = quant_fp4(arr)
        return (name, "I8", packed), (scale_name, "F8_E8M0", scales), deq
    codes, scales, deq = quant_fp8(arr, 128, 128, e8m0=True)
    return (name, "F8_E4M3", codes), (scale_name, "F8_E8M0", scales), deq


def write_official(src, cfg, root):
    quant, ref = split(official_tensors(src), official_quantise)
    qcfg = dict(cfg, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128], "scale_fmt": "ue8m0"})
    # two shards; a scale goes to the other shard than its weight, so a reader must look across shards
    shards, weight_map, home = ([], []), {}, {}
    for k, (name, dtype, arr) in enumerate(quant):
        if name.endswith(".scale") and name[:-len(".scale")] + ".weight" in home:
            s = 1 - home[name[:-len(".scale")] + ".weight"]
        else:
            s = k % 2
        home[name] = s
        shards[s].append((name, dtype, arr))
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    d = os.path.join(root, "quant_official")
    os.makedirs(d, exist_ok=True)
    for s in range(2):
        st_write(os.path.join(d, files[s]), shards[s])
        for name, _, _ in shards[s]:
            weight_map[name] = files[s]
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    write_config(d, qcfg)
    d = os.path.join(root, "quant_official_ref")
    os.makedirs(d, exist_ok=True)
    st_write(os.path.join(d, "model.safetensors"), ref)
    write_config(d, cfg)


def write_hf(src, cfg, root):
    br, bc = 16, 24

    def quantise(name, arr):
        codes, scales, deq = quant_fp8(arr, br, bc, e8m0=False)
        return (name, "F8_E4M3", codes), (name + "_scale_inv", "F32", scales), deq

    quant, ref = split([(n, d, a) for n, (d, a) in src.items()], quantise)
    qcfg = dict(cfg, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": [br, bc]})
    for sub, tensors, c in (("quant_hf", quant, qcfg), ("quant_hf_ref", ref, cfg)):
        d = os.path.join(root, sub)
        os.makedirs(d, exist_ok=True)
        st_write(os.path.join(d, "model.safetensors"), tensors)
        write_config(d, c)


FP4_E, FP4_I = 8, 32  # quant_fp4: every routed expert matrix has 32-value rows


def fp4_variant(src, cfg, seed=1414):
    """tiny_hf with FP4_E routed experts of intermediate size FP4_I, in HF names: the tensors whose shapes depend
    on E or I are new (normal, each with the spread of the tiny_hf tensor it replaces; the hash table a random
    choice of K distinct experts per token), the others tiny_hf's."""
    rng = np.random.default_rng(seed)
    E, I, D, K = FP4_E, FP4_I, cfg["hidden_size"], cfg["num_experts_per_tok"]
    shapes = {"mlp.experts.gate_up_proj": (E, 2 * I, D), "mlp.experts.down_proj": (E, D, I), "mlp.gate.weight": (E, D),
              "mlp.gate.e_score_correction_bias": (E,), "mlp.shared_experts.gate_proj.weight": (I, D),
              "mlp.shared_experts.up_proj.weight": (I, D), "mlp.shared_experts.down_proj.weight": (D, I)}
    out = {}
    for name, (dtype, arr) in src.items():
        tail = next((t for t in shapes if name.endswith(t)), None)
        if name.endswith("mlp.gate.tid2eid"):
            arr = np.stack([rng.permutation(E)[:K] for _ in range(arr.shape[0])]).astype(arr.dtype)
        elif tail:
            arr = (rng.standard_normal(shapes[tail]) * float(arr.std() or 0.05)).astype(np.float32)
        out[name] = (dtype, arr)
    return out, dict(cfg, n_routed_experts=E, moe_intermediate_size=I)


def write_fp4(src, cfg, root):
    var, vcfg = fp4_variant(src, cfg)

    def quantise(name, arr):
        if ".ffn.experts." not in name:
            return None
        packed, scales, deq = quant_fp4(arr)
        return (name, "U8", packed.view(np.uint8)), (name[:-len(".weight")] + ".scale", "F8_E8M0", scales), deq

    quant, ref = [], []
    for name, dtype, arr in official_tensors(var):
        got = quantise(name, arr) if dtype == "F32" and is_linear(name, arr) else None
        if got:
            quant += [got[0], got[1]]
            ref.append((name, "F32", got[2]))
        else:
            quant.append((name, dtype, arr))
            ref.append((name, dtype, arr))
    for sub, tensors in (("quant_fp4", quant), ("quant_fp4_ref", ref)):
        d = os.path.join(root, sub)
        os.makedirs(d, exist_ok=True)
        st_write(os.path.join(d, "model.safetensors"), tensors)
        write_config(d, vcfg)


def write_config(d, cfg):
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
    src = st_read(os.path.join(root, "tiny_hf", "model.safetensors"))
    with open(os.path.join(root, "tiny_hf", "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    # self-checks of the tables against the definitions' landmarks
    assert E4M3[0x7E] == 448.0 and np.isnan(E4M3[0x7F]) and E4M3[0x01] == 2.0 ** -9 and E4M3[0x38] == 1.0
    assert list(E2M1[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6] and E2M1[15] == -6.0
    write_official(src, cfg, root)
    write_hf(src, cfg, root)
    write_fp4(src, cfg, root)


if __name__ == "__main__":
    main()
