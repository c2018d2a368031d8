"""DeepSeek-V3's block-scaled FP8 weights, dequantized on the host.

The released checkpoint stores most linear weights as float8_e4m3fn [out, in] beside a float32
`weight_scale_inv` [ceil(out / 128), ceil(in / 128)]: the real weight is the FP8 value times the
scale of its 128 x 128 block. Edge blocks are partial when a dimension is not a multiple of 128.
"""

from __future__ import annotations

import numpy as np

BLOCK = 128  # the released checkpoints' weight_block_size, both axes


def dequantize_fp8_block(weight, scale_inv, block: int = BLOCK) -> np.ndarray:
    """float32 [..., out, in] = weight (float8_e4m3fn, ml_dtypes) * scale_inv [..., ceil(out/block),
    ceil(in/block)] broadcast over block x block tiles; leading axes (stacked experts) pass through."""
    weight = np.asarray(weight)
    scale_inv = np.asarray(scale_inv, np.float32)
    out, n_in = weight.shape[-2:]
    blocks = (-(-out // block), -(-n_in // block))
    if scale_inv.shape[-2:] != blocks:
        raise ValueError(f"scale_inv {scale_inv.shape} does not tile weight {weight.shape} in blocks of {block}")
    # Pad to whole blocks so one reshape puts each block on its own axes; the padding is cut off.
    pad = [(0, 0)] * (weight.ndim - 2) + [(0, blocks[0] * block - out), (0, blocks[1] * block - n_in)]
    w = np.pad(weight.astype(np.float32), pad)
    w = w.reshape(*w.shape[:-2], blocks[0], block, blocks[1], block)
    w = w * scale_inv[..., :, None, :, None]
    return w.reshape(*w.shape[:-4], blocks[0] * block, blocks[1] * block)[..., :out, :n_in]
