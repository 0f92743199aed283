"""A small numpy rasteriser for the synthetic sets: the same pixels with every Pillow version.

Shapes (rotated ellipses, polygons, thick polylines, capsules) are filled with a point-in-shape test at the
centres of a supersampled grid and composited with premultiplied alpha; ``Canvas.resolve`` box-averages the grid
down (anti-aliasing). ``gaussian_blur`` and ``resize_bilinear`` replace Pillow's filters. Per-pixel work uses only
float64 ``+ - * /`` and comparisons (exactly rounded under IEEE 754); transcendental functions are evaluated on
Python scalars (``math``), so results do not depend on numpy's SIMD code paths or on Pillow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Point = tuple[float, float]


class Canvas:
    """A premultiplied RGBA float64 canvas of ``(h, w)`` output pixels, each sampled ``ss`` x ``ss`` times."""

    def __init__(self, h: int, w: int, ss: int = 4, background: Sequence[float] | None = None):
        self.h, self.w, self.ss = h, w, ss
        self.rgb = np.zeros((h * ss, w * ss, 3))
        self.alpha = np.zeros((h * ss, w * ss))
        if background is not None:
            self.rgb[:] = np.asarray(background[:3], dtype=np.float64)
            self.alpha[:] = 1.0

    def _grid(self, x0: float, y0: float, x1: float, y1: float):
        """Sample centres (in output-pixel units) of the supersampled cells covering a bounding box."""
        ss = self.ss
        c0, r0 = max(0, math.floor(x0 * ss)), max(0, math.floor(y0 * ss))
        c1, r1 = min(self.w * ss, math.ceil(x1 * ss) + 1), min(self.h * ss, math.ceil(y1 * ss) + 1)
        if c0 >= c1 or r0 >= r1:
            return None
        xs = (np.arange(c0, c1) + 0.5) / ss
        ys = (np.arange(r0, r1) + 0.5) / ss
        return (slice(r0, r1), slice(c0, c1)), xs[None, :], ys[:, None]

    def _paint(self, where: tuple[slice, slice], inside: np.ndarray, color: Sequence[float]) -> None:
        """Composite ``color`` (RGB or RGBA, 0-255) over the cells where ``inside`` holds."""
        a = (color[3] / 255.0 if len(color) > 3 else 1.0) * inside
        rgb, alpha = self.rgb[where], self.alpha[where]
        for c in range(3):
            rgb[..., c] = color[c] * a + rgb[..., c] * (1.0 - a)
        alpha[...] = a + alpha * (1.0 - a)

    def ellipse(
        self, cx: float, cy: float, rx: float, ry: float, angle: float, color: Sequence[float]
    ) -> None:
        """Filled ellipse with centre, semi-axes and rotation ``angle`` (radians, clockwise in image space)."""
        r = max(rx, ry)
        grid = self._grid(cx - r, cy - r, cx + r, cy + r)
        if grid is None or rx <= 0 or ry <= 0:
            return
        where, xs, ys = grid
        cos, sin = math.cos(angle), math.sin(angle)
        dx, dy = xs - cx, ys - cy
        u, v = (dx * cos + dy * sin) / rx, (dy * cos - dx * sin) / ry
        self._paint(where, u * u + v * v <= 1.0, color)

    def polygon(self, pts: Sequence[Point], color: Sequence[float]) -> None:
        """Filled polygon (even-odd rule)."""
        xs_, ys_ = [p[0] for p in pts], [p[1] for p in pts]
        grid = self._grid(min(xs_), min(ys_), max(xs_), max(ys_))
        if grid is None:
            return
        where, xs, ys = grid
        inside = np.zeros((ys.shape[0], xs.shape[1]), dtype=bool)
        for (xa, ya), (xb, yb) in zip(pts, [*pts[1:], pts[0]], strict=True):
            if ya == yb:
                continue
            crosses = (ya > ys) != (yb > ys)  # (rows, 1)
            x_cross = xa + (ys - ya) * ((xb - xa) / (yb - ya))
            inside ^= crosses & (xs < x_cross)
        self._paint(where, inside, color)

    def capsule(self, a: Point, b: Point, radius: float, color: Sequence[float]) -> None:
        """Segment ``a``-``b`` thickened by ``radius`` with round caps."""
        grid = self._grid(
            min(a[0], b[0]) - radius,
            min(a[1], b[1]) - radius,
            max(a[0], b[0]) + radius,
            max(a[1], b[1]) + radius,
        )
        if grid is None:
            return
        where, xs, ys = grid
        ex, ey = b[0] - a[0], b[1] - a[1]
        n2 = ex * ex + ey * ey
        px, py = xs - a[0], ys - a[1]
        t = np.clip((px * ex + py * ey) / n2, 0.0, 1.0) if n2 > 0 else np.zeros_like(px * py)
        qx, qy = px - t * ex, py - t * ey
        self._paint(where, qx * qx + qy * qy <= radius * radius, color)

    def polyline(self, pts: Sequence[Point], width: float, color: Sequence[float]) -> None:
        """Thick polyline of ``width`` pixels (each segment a capsule, so joints are round)."""
        for a, b in zip(pts[:-1], pts[1:], strict=True):
            self.capsule(a, b, width / 2, color)

    def rectangle(self, x0: float, y0: float, x1: float, y1: float, color: Sequence[float]) -> None:
        """Axis-aligned filled rectangle."""
        self.polygon([(x0, y0), (x1, y0), (x1, y1), (x0, y1)], color)

    def resolve(self) -> tuple[np.ndarray, np.ndarray]:
        """Box-downsampled premultiplied RGB ``(h, w, 3)`` and alpha ``(h, w)`` (float64, RGB in 0-255)."""
        ss, h, w = self.ss, self.h, self.w
        rgb = self.rgb.reshape(h, ss, w, ss, 3).sum(axis=(1, 3)) / (ss * ss)
        alpha = self.alpha.reshape(h, ss, w, ss).sum(axis=(1, 3)) / (ss * ss)
        return rgb, alpha


def _kernel(sigma: float) -> list[float]:
    """Normalised 1-D Gaussian weights (Python floats) of radius ceil(3 sigma)."""
    radius = max(1, math.ceil(3 * sigma))
    weights = [math.exp(-0.5 * (i / sigma) ** 2) for i in range(-radius, radius + 1)]
    total = math.fsum(weights)
    return [wt / total for wt in weights]


def _convolve_axis(img: np.ndarray, weights: list[float], axis: int) -> np.ndarray:
    """Convolve along ``axis`` with edge-replicated borders, summing taps in a fixed order."""
    radius = len(weights) // 2
    pad = [(0, 0)] * img.ndim
    pad[axis] = (radius, radius)
    padded = np.pad(img, pad, mode="edge")
    n = img.shape[axis]
    out = np.zeros_like(img, dtype=np.float64)
    for i, wt in enumerate(weights):
        out += wt * np.take(padded, np.arange(i, i + n), axis=axis)
    return out


def gaussian_blur(img: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of an ``(h, w[, c])`` float array; ``sigma`` < 0.05 returns a copy."""
    img = np.asarray(img, dtype=np.float64)
    if sigma < 0.05:
        return img.copy()
    weights = _kernel(sigma)
    return _convolve_axis(_convolve_axis(img, weights, 0), weights, 1)


def resize_bilinear(img: np.ndarray, h: int, w: int) -> np.ndarray:
    """Bilinear resize of an ``(H, W[, c])`` float array to ``(h, w)`` (pixel centres aligned, edges clamped)."""
    img = np.asarray(img, dtype=np.float64)
    src_h, src_w = img.shape[:2]

    def taps(n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pos = np.clip((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0, n_in - 1.0)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, pos - lo

    r0, r1, fr = taps(h, src_h)
    c0, c1, fc = taps(w, src_w)
    extra = (None,) * (img.ndim - 2)
    fr, fc = fr[(slice(None), None, *extra)], fc[(None, slice(None), *extra)]
    top = img[r0][:, c0] * (1.0 - fc) + img[r0][:, c1] * fc
    bottom = img[r1][:, c0] * (1.0 - fc) + img[r1][:, c1] * fc
    return top * (1.0 - fr) + bottom * fr


def to_uint8(img: np.ndarray) -> np.ndarray:
    """Round to nearest and clip to ``uint8``."""
    return np.clip(np.floor(np.asarray(img, dtype=np.float64) + 0.5), 0, 255).astype(np.uint8)
