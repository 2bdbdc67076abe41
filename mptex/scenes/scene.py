"""``Scene``: a fixed mesh, its training and validation cameras, reference images and G-buffers.

This is what a training loop consumes. Every view has a stable key (``("train", i)`` or
``("val", i)``); its G-buffer and reference image are computed on first use and cached on the
scene's device, so each distinct view is rasterized exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mptex.render.camera import Cameras
from mptex.render.mesh import Mesh
from mptex.scenes.gbuffer import GBuffer, GBufferCache

__all__ = ["Scene", "ViewBatch"]

# Computes reference RGBA [B, H, W, 4] (linear RGB, alpha = coverage) from G-buffers.
ReferenceFn = Callable[[GBuffer], torch.Tensor]


@dataclass
class ViewBatch:
    """A batch of B views with their references and cached G-buffers.

    Attributes:
        index: [B] int64 view indices within their split.
        mv: [B, 4, 4] float32 world-to-camera matrices.
        mvp: [B, 4, 4] float32 world-to-clip matrices.
        campos: [B, 3] float32 camera positions.
        rgba: [B, H, W, 4] float32 reference, linear RGB and alpha (coverage or image alpha).
        gbuffer: the views' ``GBuffer`` (``rast``, ``position``, ``normal``, ``mask``).
    """

    index: torch.Tensor
    mv: torch.Tensor
    mvp: torch.Tensor
    campos: torch.Tensor
    rgba: torch.Tensor
    gbuffer: GBuffer

    @property
    def position(self) -> torch.Tensor:
        """[B, H, W, 3] float32 world-space surface positions (0 on background)."""
        return self.gbuffer.position

    @property
    def mask(self) -> torch.Tensor:
        """[B, H, W] bool pixel coverage."""
        return self.gbuffer.mask

    def __len__(self) -> int:
        return self.index.shape[0]


class Scene:
    """A fixed mesh seen from fixed training and validation cameras.

    Args:
        name: scene name (as in its config).
        mesh: the mesh, moved to ``device``.
        resolution: (H, W) of every view.
        train_cameras, val_cameras: the views of each split.
        reference: a function of a ``GBuffer`` giving reference RGBA (procedural or textured
            scenes), or a dict ``{"train": [N, H, W, 4], "val": [M, H, W, 4]}`` of images.
        device: where G-buffers and references live.
        backend: rasterizer backend for G-buffers.
        gt_texture: the ground-truth 3D texture [N, 3] -> [N, 3], when the scene has one.
    """

    def __init__(
        self,
        name: str,
        mesh: Mesh,
        resolution: tuple[int, int],
        train_cameras: Cameras,
        val_cameras: Cameras,
        reference: ReferenceFn | dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        backend: str = "auto",
        gt_texture: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.name = name
        self.device = torch.device(device)
        self.mesh = mesh.to(self.device)
        self.resolution = (int(resolution[0]), int(resolution[1]))
        self.gt_texture = gt_texture
        self._cameras = {"train": _to(train_cameras, self.device), "val": _to(val_cameras, device)}
        self._reference = reference
        self._rgba: dict[tuple[str, int, int], torch.Tensor] = {}
        self.gbuffers = GBufferCache(self.mesh, self.resolution, backend=backend)
        # Supersampled views (``spp`` > 1) at spp x the resolution: a cache per spp.
        self._spp_gbuffers = {1: self.gbuffers}

    @property
    def aabb(self) -> torch.Tensor:
        """[2, 3] float32 min and max corner of the mesh (nvdiffrec's MLPTexture3D bounds)."""
        return self.mesh.aabb

    @property
    def n_train_views(self) -> int:
        return len(self._cameras["train"])

    @property
    def n_val_views(self) -> int:
        return len(self._cameras["val"])

    def views(self, split: str, indices: Sequence[int] | torch.Tensor, spp: int = 1) -> ViewBatch:
        """The views ``indices`` of ``split`` ("train" or "val"), G-buffers from the cache.

        ``spp`` > 1 renders the same cameras at ``spp`` x the resolution (``[B, H * spp,
        W * spp, ...]``): the pixel (y, x) of the scene's resolution is covered by the
        sub-pixels (y * spp + i, x * spp + j), 0 <= i, j < spp, whose centres tile it evenly
        (what a box-filtered, supersampled image averages). Only scenes whose reference is
        rendered (mesh, builtin); image references have no sub-pixels.
        """
        if split not in self._cameras:
            raise ValueError(f"split: expected 'train' or 'val', received {split!r}")
        if not (isinstance(spp, int) and spp >= 1):
            raise ValueError(f"spp: expected an integer >= 1, received {spp!r}")
        if spp > 1 and not callable(self._reference):
            raise ValueError(
                f"spp: scene {self.name!r} has image references at {self.resolution}; "
                f"expected 1, received {spp}"
            )
        cams = self._cameras[split]
        index = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= len(cams)):
            raise ValueError(
                f"indices: expected values in [0, {len(cams) - 1}] for split {split!r}, "
                f"received {index.tolist()}"
            )
        keys = [(split, int(i)) for i in index]
        dev_index = index.to(self.device)
        mvp = cams.mvp[dev_index]
        if spp not in self._spp_gbuffers:
            height, width = self.resolution
            self._spp_gbuffers[spp] = GBufferCache(
                self.mesh, (height * spp, width * spp), backend=self.gbuffers.backend
            )
        gbuffer = self._spp_gbuffers[spp].get(keys, mvp)
        rgba = torch.cat(
            [self._reference_rgba(k, spp, gbuffer[n : n + 1]) for n, k in enumerate(keys)]
        )
        return ViewBatch(
            index=index,
            mv=cams.mv[dev_index],
            mvp=mvp,
            campos=cams.campos[dev_index],
            rgba=rgba,
            gbuffer=gbuffer,
        )

    def train_views(self, indices: Sequence[int] | torch.Tensor) -> ViewBatch:
        """Training views by index."""
        return self.views("train", indices)

    def train_view(self, i: int) -> ViewBatch:
        """One training view as a batch of 1."""
        return self.views("train", [i])

    def sample_train_batch(self, batch_size: int, generator: torch.Generator) -> ViewBatch:
        """``batch_size`` training views drawn uniformly with replacement from the fixed pool.

        Args:
            batch_size: number of views B.
            generator: a CPU ``torch.Generator``; seed it for deterministic runs.
        """
        index = torch.randint(self.n_train_views, (batch_size,), generator=generator)
        return self.views("train", index)

    def val_views(self, spp: int = 1) -> ViewBatch:
        """All validation views (an orbit for builtin/mesh scenes, the test split for nerf)."""
        return self.views("val", range(self.n_val_views), spp)

    def _reference_rgba(self, key: tuple[str, int], spp: int, gbuffer: GBuffer) -> torch.Tensor:
        if (*key, spp) not in self._rgba:
            if callable(self._reference):
                with torch.no_grad():
                    self._rgba[(*key, spp)] = self._reference(gbuffer).float()
            else:
                split, i = key
                self._rgba[(*key, spp)] = self._reference[split][i : i + 1].to(self.device)
        return self._rgba[(*key, spp)]


def _to(cameras: Cameras, device) -> Cameras:
    return Cameras(
        mv=cameras.mv.to(device), mvp=cameras.mvp.to(device), campos=cameras.campos.to(device)
    )
