"""Per-page key summaries: the element-wise min and max of a page's keys, per KV head.

A page's summary bounds q.k for every key in it: for each dimension d, q_d * k_d <= max(q_d * kmin_d,
q_d * kmax_d), so the sum over d is an upper bound of any key's score (Quest's bound). Summaries are
small (2 x Hkv x D per layer page, 1/S of the page's keys) and stay on the compute device.
"""

from __future__ import annotations

import torch


def key_bounds(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k [n, S, Hkv, D] (n full pages) -> (kmin, kmax) [n, Hkv, D] each, float32."""
    kf = k.float()
    return kf.amin(dim=1), kf.amax(dim=1)


class PageSummaries:
    """The summaries of one sequence's sealed pages, all layers: kmin, kmax [L, P, Hkv, D], grown as needed."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 initial_pages: int = 64) -> None:
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.device = device
        cap = max(1, initial_pages)
        self.kmin = torch.zeros((num_layers, cap, num_kv_heads, head_dim), dtype=torch.float32, device=device)
        self.kmax = torch.zeros_like(self.kmin)

    def _ensure(self, pages: int) -> None:
        cap = self.kmin.shape[1]
        if pages <= cap:
            return
        new_cap = max(pages, 2 * cap)
        L, H, D = self.shape
        for name in ("kmin", "kmax"):
            old = getattr(self, name)
            with torch.inference_mode(False):  # stays writable outside the model's forward
                grown = torch.zeros((L, new_cap, H, D), dtype=old.dtype, device=self.device)
                grown[:, :cap] = old
            setattr(self, name, grown)

    def set(self, layer: int, first_page: int, k: torch.Tensor) -> None:
        """Summarise full pages k [n, S, Hkv, D] of ``layer`` as pages first_page .. first_page+n-1."""
        n = k.shape[0]
        if n == 0:
            return
        self._ensure(first_page + n)
        lo, hi = key_bounds(k)
        self.kmin[layer, first_page : first_page + n] = lo
        self.kmax[layer, first_page : first_page + n] = hi

    def of(self, layer: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kmin, kmax [pages, Hkv, D] of the first ``pages`` pages of ``layer``."""
        return self.kmin[layer, :pages], self.kmax[layer, :pages]
