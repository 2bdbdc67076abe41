"""UV texture sampling as nvdiffrast's ``texture(filter_mode='linear')``, wrap or clamp."""

from __future__ import annotations

import torch

from mptex.render.rasterize import Backend, _resolve_backend

__all__ = ["texture"]


def texture(
    tex: torch.Tensor,
    uv: torch.Tensor,
    filter_mode: str = "linear",
    boundary_mode: str = "wrap",
    backend: Backend = "auto",
) -> torch.Tensor:
    """Sample a 2D texture bilinearly at UV coordinates, with wrap-around or clamped addressing.

    Texel (i, j) (column i, row j of ``tex``) has its centre at ``((i + 0.5) / W, (j + 0.5) / H)``
    in UV space; v = 0 is row 0 of the tensor, as in nvdiffrast (loaders flip OBJ's v instead).

    Args:
        tex: [B, H, W, C] or [1, H, W, C] (shared) floating-point texture.
        uv: [B, h, w, 2] floating-point texture coordinates.
        filter_mode: only "linear" is implemented (no mipmaps).
        boundary_mode: "wrap" (repeat: u and u + 1 sample the same colour, and a bilinear
            lookup next to an edge blends with the opposite edge) or "clamp" (clamp to edge:
            outside [0, 1] the nearest edge texel; no blending across edges).
        backend: "auto", "torch" or "nvdiffrast" (``nvdiffrast.torch.texture``).

    Returns:
        [B, h, w, C] samples in the dtype ``tex`` and ``uv`` promote to (the torch backend
        interpolates in it; nvdiffrast takes float32 only); differentiable w.r.t. ``tex`` and
        ``uv``.
    """
    if filter_mode != "linear":
        raise ValueError(f"filter_mode: expected 'linear', received {filter_mode!r}")
    if boundary_mode not in ("wrap", "clamp"):
        raise ValueError(f"boundary_mode: expected 'wrap' or 'clamp', received {boundary_mode!r}")
    if not isinstance(tex, torch.Tensor) or tex.dim() != 4:
        got = list(tex.shape) if isinstance(tex, torch.Tensor) else type(tex).__name__
        raise ValueError(f"tex: expected shape [B, H, W, C], received {got}")
    if tex.shape[1] < 1 or tex.shape[2] < 1:
        raise ValueError(
            f"tex: expected at least one texel (H, W >= 1), received {list(tex.shape)}"
        )
    if not isinstance(uv, torch.Tensor) or uv.dim() != 4 or uv.shape[-1] != 2:
        got = list(uv.shape) if isinstance(uv, torch.Tensor) else type(uv).__name__
        raise ValueError(f"uv: expected shape [B, h, w, 2], received {got}")
    if tex.shape[0] not in (1, uv.shape[0]):
        raise ValueError(f"tex: expected batch size 1 or {uv.shape[0]}, received {tex.shape[0]}")
    chosen = _resolve_backend(backend, uv.device, "mptex.render.texture")
    if chosen == "nvdiffrast":
        from mptex._backends import import_nvdiffrast

        dr = import_nvdiffrast()
        return dr.texture(
            tex.contiguous(), uv.contiguous(), filter_mode="linear", boundary_mode=boundary_mode
        )

    batch, height, width, channels = tex.shape
    n_out = uv.shape[0]
    x = uv[..., 0] * width - 0.5
    y = uv[..., 1] * height - 0.5
    x0, y0 = torch.floor(x), torch.floor(y)
    fx, fy = (x - x0).unsqueeze(-1), (y - y0).unsqueeze(-1)
    if boundary_mode == "wrap":
        ix0 = torch.remainder(x0.long(), width)
        iy0 = torch.remainder(y0.long(), height)
        ix1 = torch.remainder(ix0 + 1, width)
        iy1 = torch.remainder(iy0 + 1, height)
    else:  # clamp to edge: both taps clamp, so beyond the edge the weights blend equal texels
        ix0, ix1 = x0.long().clamp(0, width - 1), (x0.long() + 1).clamp(0, width - 1)
        iy0, iy1 = y0.long().clamp(0, height - 1), (y0.long() + 1).clamp(0, height - 1)
    flat = tex.reshape(batch, height * width, channels)
    if batch == 1 and n_out > 1:
        flat = flat.expand(n_out, -1, -1)

    def fetch(iy: torch.Tensor, ix: torch.Tensor) -> torch.Tensor:
        index = (iy * width + ix).reshape(n_out, -1, 1).expand(-1, -1, channels)
        return torch.gather(flat, 1, index).reshape(*uv.shape[:-1], channels)

    top = fetch(iy0, ix0) * (1 - fx) + fetch(iy0, ix1) * fx
    bottom = fetch(iy1, ix0) * (1 - fx) + fetch(iy1, ix1) * fx
    return top * (1 - fy) + bottom * fy
