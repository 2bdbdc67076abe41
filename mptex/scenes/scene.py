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

__all__ = ["Scene", "ViewBatch", "TrainingBatch"]

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


@dataclass
class TrainingBatch:
    """A batch of B training views as the training loop consumes it: only what one iteration
    reads, gathered from per-view tensors prepared once on the scene's device
    (:meth:`Scene.training_batch`), so that drawing a batch reads nothing from the device.

    Attributes:
        index: the B view indices (Python ints, drawn on the host).
        rgba: [B, H, W, 4] float32 reference, linear RGB and alpha.
        coverage: [B, H, W, 1] float32, 1.0 where a triangle covers the pixel centre, else 0.
        covered: [N] int64 indices of the covered pixels in the flattened ``[B * H * W]``
            image, ascending (``coverage.reshape(-1).nonzero()``).
        points: [N, 3] float32 world-space surface positions of the covered pixels.
        normals: [N, 3] float32 unit normals of the covered pixels (None unless prepared).
    """

    index: list[int]
    rgba: torch.Tensor
    coverage: torch.Tensor
    covered: torch.Tensor
    points: torch.Tensor
    normals: torch.Tensor | None

    @property
    def mask(self) -> torch.Tensor:
        """[B, H, W] bool pixel coverage (a new tensor)."""
        return self.coverage[..., 0] > 0

    def __len__(self) -> int:
        return len(self.index)


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
        # Per training view, what training_batch gathers (prepare_training).
        self._training: list[dict[str, torch.Tensor]] | None = None
        self._training_normals = False

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

    def prepare_training(self, normals: bool = False, chunk: int = 16) -> None:
        """Rasterize every training view now (``chunk`` views per rasterizer call) and keep, per
        view on the scene's device, what :meth:`training_batch` gathers: the reference, the
        coverage, the covered pixels' indices, positions and (with ``normals``) normals.

        Each view's G-buffer and reference are those :meth:`views` returns (a G-buffer does
        not depend on the batch it was rasterized in), so training on prepared views takes the
        same values, bit for bit. Reads each view's covered-pixel count once, here.
        """
        if self._training is not None and (self._training_normals or not normals):
            return
        prepared = []
        for start in range(0, self.n_train_views, chunk):
            batch = self.views("train", range(start, min(start + chunk, self.n_train_views)))
            for n in range(len(batch)):
                mask = batch.mask[n].reshape(-1)
                covered = mask.nonzero().squeeze(1)
                view = {
                    "rgba": batch.rgba[n : n + 1],
                    "coverage": mask.to(torch.float32).view(1, *self.resolution, 1),
                    "covered": covered,
                    "points": batch.position[n].reshape(-1, 3).index_select(0, covered),
                }
                if normals:
                    normal = batch.gbuffer.normal[n].reshape(-1, 3)
                    view["normals"] = normal.index_select(0, covered)
                prepared.append(view)
        self._training, self._training_normals = prepared, normals

    def covered_pixels(self, normals: bool = False) -> list[int]:
        """Covered pixels of each training view (the texture's points each one gives an
        iteration), from the prepared views (:meth:`prepare_training`, run on first use)."""
        self.prepare_training(normals)
        return [int(view["covered"].shape[0]) for view in self._training]

    def training_batch(
        self, batch_size: int, generator: torch.Generator, normals: bool = False
    ) -> TrainingBatch:
        """``batch_size`` training views drawn as :meth:`sample_train_batch` draws them (the
        same indices from the same CPU ``generator``), gathered from the prepared views
        (:meth:`prepare_training`, run on first use).

        On a device this reads nothing back and copies nothing to it: the indices are drawn
        on the host, and each field is one concatenation of prepared per-view tensors (the
        covered indices then offset by each view's place in the batch, in place).
        """
        self.prepare_training(normals)
        index = torch.randint(self.n_train_views, (batch_size,), generator=generator).tolist()
        views = [self._training[i] for i in index]
        covered = torch.cat([v["covered"] for v in views])
        pixels, start = self.resolution[0] * self.resolution[1], 0
        for n, view in enumerate(views):
            count = view["covered"].shape[0]
            if n:
                covered[start : start + count].add_(n * pixels)  # one op: no copy back
            start += count
        return TrainingBatch(
            index=index,
            rgba=torch.cat([v["rgba"] for v in views]),
            coverage=torch.cat([v["coverage"] for v in views]),
            covered=covered,
            points=torch.cat([v["points"] for v in views]),
            normals=torch.cat([v["normals"] for v in views]) if normals else None,
        )

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
