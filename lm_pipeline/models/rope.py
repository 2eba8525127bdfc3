"""Rotary embedding frequencies, plain and scaled, as transformers computes them
(``transformers.modeling_rope_utils``: ``default``, ``linear``, ``llama3``, ``yarn``). NumPy
only: the frequencies are constants of the compiled program.

:func:`rope_frequencies` gives the inverse frequencies of the ``head_dim / 2`` rotated pairs and
the factor that multiplies cos and sin (YaRN's attention temperature; 1 otherwise).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lm_pipeline.models.config import RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """(inverse frequencies f32 ``[head_dim // 2]``, cos/sin factor) for ``scaling`` (None: the plain rope)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32), 1.0
    if scaling.type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32), 1.0
    if scaling.type == "llama3":
        return _llama3(inv_freq, scaling).astype(np.float32), 1.0
    return _yarn(head_dim, theta, scaling)


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1's: wavelengths above original/low_freq_factor divided by factor, below
    original/high_freq_factor kept, smoothly interpolated between."""
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023): interpolated frequencies below the beta_slow..beta_fast rotation
    band, extrapolated above it, a linear ramp across it; cos/sin scaled by the attention factor."""
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _mscale(s.factor, s.mscale) / _mscale(s.factor, s.mscale_all_dim)
    else:
        attention = _mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos = theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    inv_freq = (1.0 / (s.factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv_freq.astype(np.float32), float(attention)
