"""The repacked layout (quant.ROWS_X8) of Q4_K, Q5_K, Q6_K and IQ4_XS weights: eight rows' 256-value super-blocks
side by side, their sub-block scales unpacked to one byte each (cpu_ext/qmatmul.h draws the bytes and the kernels'
arithmetic). Per group of eight rows and super-block b, `GROUP_BYTES[qtype]` bytes:

    Q4_K   | d: f16[8] | dmin: f16[8] | sc: u8[8 j][8 r] | mn: u8[8 j][8 r] | pair 0 | ... | pair 3 |
    Q5_K   Q4_K's, then | qh: chunk 0 | ... | chunk 7 |
    Q6_K   | d: f16[8] | sc: i8[8 j][8 r][2] | half 0 | half 1 |
           half = | ql chunks (t = 0) | ql chunks (t = 1) | qh chunks |, qh's bit pairs as sub-blocks 1, 3, 0, 2
    IQ4_XS | d: f16[8] | sc - 32: i8[8 j][8 r] | sub-block 0: chunk 0..3 | ... | sub-block 7 |

    chunk c = | row 0: 4 bytes | ... | row 7: 4 bytes |   row r's bytes 4c .. 4c+3 of: qs[32p ...] (pair p), qh,
              ql[64h + 32t ...] and qh[32h ...] (Q6_K half h), qs[16j ...] (IQ4_XS sub-block j)

The packed scales are bijections of 6-bit values (Q4_K: 16 in 12 bytes, IQ4_XS: 8 in 6), so `from_groups` gives
GGUF's bytes back exactly. `to_groups` runs in numpy at load, `from_groups` in jnp (or numpy)."""

import numpy as np
from gguf import GGMLQuantizationType

Q4_K, Q5_K, Q6_K, IQ4_XS = (GGMLQuantizationType[name] for name in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS"))
GROUP_BYTES = {Q4_K: 1184, Q5_K: 1440, Q6_K: 1680, IQ4_XS: 1104}
ROWS = 8


def _chunks(q, n_chunks: int):
    """Rows' bytes [g, 8 r, nb, 4 n_chunks] -> [g, nb, n_chunks * 32]: chunk c holds row r's bytes 4c .. 4c+3."""
    g, _, nb, _ = q.shape
    return q.reshape(g, ROWS, nb, n_chunks, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, 32 * n_chunks)


def _rows(chunks, n_chunks: int):
    """_chunks' inverse: [g, nb, n_chunks * 32] -> [g, 8 r, nb, 4 n_chunks]."""
    g, nb, _ = chunks.shape
    return chunks.reshape(g, nb, n_chunks, ROWS, 4).transpose(0, 3, 1, 2, 4).reshape(g, ROWS, nb, 4 * n_chunks)


def _side_by_side(v):
    """Per-row values [g, 8 r, nb, k, width] -> [g, nb, k, 8 r, width] (flattened to bytes by the caller)."""
    return v.swapaxes(1, 2).swapaxes(2, 3)


def q4_k_unpack_scales(s):
    """12 packed bytes [..., 12] -> 6-bit scales, mins [..., 8] (qmatmul.h, q4_k_scale_min)."""
    low, mid, high = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def q4_k_pack_scales(xp, sc, mn):
    """q4_k_unpack_scales' inverse."""
    return xp.concatenate([sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6), mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6),
                           (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)], axis=-1)


def _q6_k_top_order(qh):
    """GGUF's Q6_K qh byte, sub-blocks 0..3 from the low bit pair up -> the repacked one, sub-blocks 1, 3, 0, 2."""
    return ((qh >> 2) & 3) | (((qh >> 6) & 3) << 2) | ((qh & 3) << 4) | (((qh >> 4) & 3) << 6)


def _q6_k_gguf_order(qh):
    """_q6_k_top_order's inverse."""
    return ((qh >> 4) & 3) | ((qh & 3) << 2) | (((qh >> 6) & 3) << 4) | (((qh >> 2) & 3) << 6)


def _flat(g, nb, *parts):
    return np.concatenate([p.reshape(g, nb, -1) for p in parts], axis=-1)


def to_groups(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """GGUF super-blocks of eight rows, uint8 [g, 8 r, nb, type_size] -> the groups, uint8 [g, nb, GROUP_BYTES]."""
    g, _, nb, _ = rows.shape
    if qtype in (Q4_K, Q5_K):
        sc, mn = q4_k_unpack_scales(rows[..., 4:16])
        qs = rows[..., 16:144] if qtype == Q4_K else rows[..., 48:176]
        parts = [_side_by_side(rows[..., None, 0:2]), _side_by_side(rows[..., None, 2:4]), _side_by_side(sc[..., None]),
                 _side_by_side(mn[..., None]), _chunks(qs, 32)]
        if qtype == Q5_K:
            parts.append(_chunks(rows[..., 16:48], 8))
    elif qtype == Q6_K:
        scales = rows[..., 192:208].reshape(g, ROWS, nb, 8, 2)
        halves = [_chunks(rows[..., 64 * h : 64 * h + 64], 16) for h in range(2)]
        top = [_chunks(_q6_k_top_order(rows[..., 128 + 32 * h : 160 + 32 * h]), 8) for h in range(2)]
        parts = [_side_by_side(rows[..., None, 208:210]), _side_by_side(scales), halves[0], top[0], halves[1], top[1]]
    elif qtype == IQ4_XS:
        scales_h = rows[..., 2].astype(np.uint16) | rows[..., 3].astype(np.uint16) << 8
        low = (rows[..., 4:8, None] >> np.array([0, 4], np.uint8)) & 0x0F
        high = ((scales_h[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
        sc = (low.reshape(g, ROWS, nb, 8) | (high << 4)) - np.uint8(32)  # ls - 32 as int8 bytes
        parts = [_side_by_side(rows[..., None, 0:2]), _side_by_side(sc[..., None]),
                 _chunks(rows[..., 8:136].reshape(g, ROWS, nb, 8, 16).reshape(g, ROWS, nb * 8, 16), 4)
                 .reshape(g, nb, 8 * 128)]
    else:
        raise ValueError(f"{qtype.name} has no super-block group layout")
    return _flat(g, nb, *parts)


def from_groups(xp, data, qtype: GGMLQuantizationType):
    """to_groups' inverse, with xp = jnp or np: [g, nb, GROUP_BYTES] -> uint8 [g, 8 r, nb, type_size]."""
    g, nb, _ = data.shape

    def side(at: int, k: int, width: int):  # k values of `width` bytes per row, side by side -> [g, 8 r, nb, k * width]
        part = data[..., at : at + k * ROWS * width].reshape(g, nb, k, ROWS, width)
        return part.transpose(0, 3, 1, 2, 4).reshape(g, ROWS, nb, k * width)

    if qtype in (Q4_K, Q5_K):
        d, dmin, sc, mn = side(0, 1, 2), side(16, 1, 2), side(32, 8, 1), side(96, 8, 1)
        qs = _rows(data[..., 160:1184], 32)
        parts = [d, dmin, q4_k_pack_scales(xp, sc, mn)]
        if qtype == Q5_K:
            parts.append(_rows(data[..., 1184:1440], 8))
        parts.append(qs)
    elif qtype == Q6_K:
        half = [data[..., 144 + 768 * h : 144 + 768 * (h + 1)] for h in range(2)]
        ql = [_rows(h[..., :512], 16) for h in half]
        qh = [_q6_k_gguf_order(_rows(h[..., 512:], 8)) for h in half]
        parts = [ql[0], ql[1], qh[0], qh[1], side(16, 8, 2), side(0, 1, 2)]
    elif qtype == IQ4_XS:
        ls = side(16, 8, 1) + xp.uint8(32)
        scales_l = (ls[..., 0::2] & 0x0F) | ((ls[..., 1::2] & 0x0F) << 4)
        top = ((ls >> 4) & 3).astype(xp.uint16) << (2 * xp.arange(8, dtype=xp.uint16))
        scales_h = top.sum(axis=-1, dtype=xp.uint16)
        h_bytes = xp.stack([scales_h & 0xFF, scales_h >> 8], axis=-1).astype(xp.uint8)
        qs = _rows(data[..., 80:1104].reshape(g, nb * 8, 128), 4).reshape(g, ROWS, nb, 128)
        parts = [side(0, 1, 2), h_bytes, scales_l, qs]
    else:
        raise ValueError(f"{qtype.name} has no super-block group layout")
    return xp.concatenate(parts, axis=-1)
