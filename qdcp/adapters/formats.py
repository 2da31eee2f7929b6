"""Plain-torch helpers for the low-precision formats several adapter families share.

Nothing here knows a tensor class: these are the byte layouts themselves (128x4-tiled block
scales, packed E2M1 nibbles, 1-byte reinterpretation), written once so that the torchao and
TransformerEngine adapters agree on them bit for bit. The tiled layout is the one cuBLAS uses
for block-scaled GEMMs; torchao's ``to_blocked`` / ``from_blocked`` and TE's swizzled scales are
this layout (tests compare against torchao's own functions).
"""
from __future__ import annotations

import math

import torch

from qdcp.layouts import ceil_div

__all__ = [
    "MXFP8_FORMS", "NVFP4_ROW16", "NVFP4_GLOBAL_DIVISOR", "nvfp4_decode_scale", "affine_form",
    "parse_affine_form", "ceil_div", "round_up", "rows", "repeat_blocks", "pad2", "swizzle_128x4",
    "unswizzle_128x4", "as_u8", "bits_as", "copy_bits", "e2m1_to_float", "unpack_fp4",
]

# ----------------------------------------------------------------------------- raw interchange forms
#
# A *form* is a library-neutral statement of the bits of a quantized tensor, so that two adapter
# families that hold the same format can convert raw, each knowing only its own tensors: the source
# adapter turns its stored components into the form's tensors (RawInterchangeAdapter.to_raw_form),
# the target's adapter fills its tensor from them (RawInterchangeAdapter.from_raw_form). Tensors of
# a form cover the same logical chunk as the components they came from.
#
# ``mxfp8_e4m3_row32`` / ``mxfp8_e5m2_row32`` (OCP MX, one E8M0 scale per 32 elements of a row):
#   ``data``  uint8, the logical shape: the fp8 bytes;
#   ``scale`` uint8, ``(..., ceil(K / 32))``: E8M0 exponents, plain (not tiled), no padding.
# ``nvfp4_row16`` (NVIDIA FP4: E2M1 codes, one E4M3 scale per 16 elements of a row, one fp32 global):
#   ``data``  uint8, ``(..., K / 2)``: two E2M1 codes a byte, element 2k in the low nibble;
#   ``scale`` uint8, ``(..., K / 16)``: E4M3 bytes, plain, no padding;
#   ``amax``  float32, shape ``()``: the tensor's global abs-max; the second-level decode scale is
#             ``amax / (6 * 448)`` (:data:`NVFP4_GLOBAL_DIVISOR`).
# ``affine_<kind>_b<bn>x<bk>`` (:func:`affine_form`; ``kind`` is ``float8``, ``int8``, ``int4``...; 2-D
#   tensors; one scale per ``bn x bk`` block, value = (data - zero_point) * scale):
#   ``data``       the elements in their own dtype (float8_*, or int8 holding the integer values),
#                  the logical shape;
#   ``scale``      ``(N / bn, K / bk)``, the scale values in their own dtype;
#   ``zero_point`` (int kinds, optional) like ``scale``, int8.

#: the MXFP8 form of each fp8 element dtype
MXFP8_FORMS = {torch.float8_e4m3fn: "mxfp8_e4m3_row32", torch.float8_e5m2: "mxfp8_e5m2_row32"}
NVFP4_ROW16 = "nvfp4_row16"
NVFP4_GLOBAL_DIVISOR = 6.0 * 448.0


def nvfp4_decode_scale(amax: torch.Tensor) -> torch.Tensor:
    """The NVFP4 second-level decode scale of the form's ``amax``: ``amax / (6 * 448)`` in fp32, shape ``()``."""
    return amax.float().reshape(()) / torch.tensor(NVFP4_GLOBAL_DIVISOR, dtype=torch.float32)


def affine_form(kind: str, block) -> str:
    """The affine form name for elements of ``kind`` with one scale per ``block`` (2 sizes)."""
    bn, bk = (int(b) for b in block)
    return f"affine_{kind}_b{bn}x{bk}"


def parse_affine_form(form: str) -> tuple[str, tuple[int, int]] | None:
    """``(kind, block)`` of an affine form name, or None for other forms."""
    parts = form.split("_")
    if len(parts) != 3 or parts[0] != "affine" or not parts[2].startswith("b"):
        return None
    bn, _, bk = parts[2][1:].partition("x")
    return (parts[1], (int(bn), int(bk))) if bn.isdigit() and bk.isdigit() else None


# E2M1 code -> value (codes 8-15 are the negatives of 0-7).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return ceil_div(x, m) * m


def rows(shape) -> int:
    """Rows of ``shape`` seen as a 2-D matrix (all dims but the last; 1 for a scalar)."""
    return math.prod(shape[:-1]) if len(shape) else 1


def repeat_blocks(scale: torch.Tensor, block_rows: int, block_cols: int, shape) -> torch.Tensor:
    """One value per ``block_rows x block_cols`` block (of the last two dims; ``block_rows`` 1 for
    1-D) spread over elements of ``shape``, partial last blocks cropped."""
    s = scale
    if block_rows > 1:
        s = s.repeat_interleave(block_rows, dim=-2)[..., : shape[-2], :]
    if block_cols > 1:
        s = s.repeat_interleave(block_cols, dim=-1)[..., : shape[-1]]
    return s


def pad2(t: torch.Tensor, n_rows: int, n_cols: int) -> torch.Tensor:
    """``t`` (2-D) in the top-left corner of a zero ``(n_rows, n_cols)`` tensor of its dtype."""
    if tuple(t.shape) == (n_rows, n_cols):
        return t.contiguous()
    out = torch.zeros((n_rows, n_cols), dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def swizzle_128x4(compact: torch.Tensor) -> torch.Tensor:
    """128x4-tiled layout of a 2-D ``(rows, cols)`` scale, zero padded.

    Returns ``(round_up(rows, 128), round_up(cols, 4))``: tiles row-major, and inside a tile the
    byte for ``(r, c)`` sits at ``(r % 32) * 16 + (r // 32) * 4 + c``.
    """
    n_rows, n_cols = round_up(compact.shape[0], 128), round_up(compact.shape[1], 4)
    p = pad2(compact, n_rows, n_cols)
    return p.view(n_rows // 128, 4, 32, n_cols // 4, 4).permute(0, 3, 2, 1, 4).reshape(n_rows, n_cols)


def unswizzle_128x4(swizzled: torch.Tensor, n_rows: int, n_cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`: the compact ``(n_rows, n_cols)`` scale (padding dropped)."""
    pr, pc = round_up(n_rows, 128), round_up(n_cols, 4)
    flat = swizzled.reshape(-1)[: pr * pc]
    out = flat.view(pr // 128, pc // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(pr, pc)
    return out[:n_rows, :n_cols]


def as_u8(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as uint8 (``t`` has 1-byte elements)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def bits_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret ``t``'s bytes as ``dtype`` when both are 1-byte types, else convert values."""
    if t.dtype == dtype:
        return t
    if t.element_size() == 1 and torch.empty((), dtype=dtype).element_size() == 1:
        return t.view(dtype)
    return t.to(dtype)


def copy_bits(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s bytes into ``dst`` (both 1 byte per element), or values for wider dtypes."""
    if dst.element_size() == 1 and src.element_size() == 1:
        dst.view(torch.uint8).copy_(src.reshape(dst.shape).view(torch.uint8))
    else:
        dst.copy_(src.reshape(dst.shape))


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8 in 0..15)."""
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``(..., K/2)`` packed bytes -> ``(..., K)`` E2M1 codes; element 2k is the low nibble."""
    p = as_u8(packed)
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
