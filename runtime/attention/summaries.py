"""Per-page key summaries of the running sequences, one row per sequence, all layers in one tensor.

A page's summary bounds q.k for every key in it (Quest's bound): for each dimension d, q_d * k_d <=
max(q_d * kmin_d, q_d * kmax_d), so q+ . kmax + q- . kmin is an upper bound of any key's score. Stored as
the box's center c = (kmax + kmin) / 2 and radius r = (kmax - kmin) / 2, the same bound is
q . c + |q| . r: one ``bmm`` against ``[q, |q|]``. Summaries are small (2 x Hkv x D per layer page, 1/S of
the page's keys) and stay on the compute device.

Layout ``[L, rows, Hkv, Pcap, 2D]`` float32, last dim center then radius: one layer's summaries of a batch
of consecutive rows are a strided view whose (row, head) batch folds into one ``bmm`` without a copy. Rows
and page capacity grow by doubling, between steps.

Beside each box the table keeps the attention mass the page drew at its layer's last decode step (``mass``,
``[L, rows, Pcap]``, summed over query heads; zero for pages that step did not select). Selection adds it
to the bound's estimate: a bound is loose (a box over 16 keys in D dimensions), so among ~2,000 pages at
32K a page that really holds what the query looks for can rank below looser boxes; the mass it drew one
step earlier is exact evidence, and it keeps the page while it still draws attention
(``docs/attention.md``, measured on Gemma 3 at 32K).
"""

from __future__ import annotations

import torch


def key_bounds(k: torch.Tensor) -> torch.Tensor:
    """k [n, Hkv, S, D] (n full pages, head-major) -> [n, Hkv, 2D] float32: the center and the radius of the
    box the page's keys span."""
    kf = k.float()
    hi, lo = kf.amax(dim=2), kf.amin(dim=2)
    return torch.cat([(hi + lo) * 0.5, (hi - lo) * 0.5], dim=-1)


def spread_to_neighbours(mass: torch.Tensor, share: float) -> torch.Tensor:
    """mass [B, P] -> [B, P]: each page's mass plus ``share`` x that of the pages before and after it."""
    if not share:
        return mass
    out = mass.clone()
    out[:, 1:] += share * mass[:, :-1]
    out[:, :-1] += share * mass[:, 1:]
    return out


class SummaryTable:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 rows: int = 1, pages: int = 64) -> None:
        self.shape = (num_layers, num_kv_heads, 2 * head_dim)
        self.device = device
        self.table, self.mass = self._zeros(max(1, rows), max(1, pages))

    def _zeros(self, rows: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        L, H, D2 = self.shape
        with torch.inference_mode(False):  # long-lived: written from the model's forward and outside it
            return (torch.zeros((L, rows, H, pages, D2), dtype=torch.float32, device=self.device),
                    torch.zeros((L, rows, pages), dtype=torch.float32, device=self.device))

    @property
    def rows(self) -> int:
        return self.table.shape[1]

    @property
    def pages(self) -> int:
        return self.table.shape[3]

    def ensure(self, rows: int, pages: int) -> None:
        """Room for rows 0..rows-1 and pages 0..pages-1 (doubling)."""
        r, p = self.rows, self.pages
        if rows <= r and pages <= p:
            return
        while r < rows:
            r *= 2
        while p < pages:
            p *= 2
        table, mass = self._zeros(r, p)
        table[:, : self.rows, :, : self.pages] = self.table
        mass[:, : self.rows, : self.pages] = self.mass
        self.table, self.mass = table, mass

    def set(self, layer: int, row: int, first_page: int, k: torch.Tensor) -> None:
        """Summarise full pages k [n, Hkv, S, D] of ``layer`` as pages first_page.. of ``row`` (a page written
        has drawn no attention yet: a row reused by another sequence starts without the old one's)."""
        n = k.shape[0]
        if n:
            self.table[layer, row, :, first_page : first_page + n] = key_bounds(k).transpose(0, 1)
            self.mass[layer, row, first_page : first_page + n] = 0.0

    def set_all_layers(self, row: int, page: int, k: torch.Tensor) -> None:
        """Summarise page ``page`` of ``row`` in every layer at once: k [L, Hkv, S, D] (a decode page that filled)."""
        self.table[:, row, :, page] = key_bounds(k)
        self.mass[:, row, page] = 0.0

    def batch(self, layer: int, rows: torch.Tensor, first_row: int | None, pages: int) -> torch.Tensor:
        """[B, Hkv, pages, 2D] of ``rows``: a view when they are consecutive (``first_row`` given)."""
        t = self.table[layer]
        if first_row is not None:
            return t[first_row : first_row + rows.shape[0], :, :pages]
        return t.index_select(0, rows)[:, :, :pages]

    def drawn(self, layer: int, rows: torch.Tensor, first_row: int | None, pages: int) -> torch.Tensor:
        """[B, pages]: the attention mass each page of ``rows`` drew at ``layer``'s last decode step."""
        m = self.mass[layer]
        if first_row is not None:
            return m[first_row : first_row + rows.shape[0], :pages]
        return m.index_select(0, rows)[:, :pages]

    def shared_drawn(self, rows: torch.Tensor, first_row: int | None, pages: int, neighbours: float) -> torch.Tensor:
        """[B, pages]: the most mass each page of ``rows`` drew at any layer's last decode step, plus
        ``neighbours`` x that of the pages before and after it (a value read across a page boundary goes on in
        the next page)."""
        m = self.mass[:, first_row : first_row + rows.shape[0], :pages] if first_row is not None \
            else self.mass.index_select(1, rows)[:, :, :pages]
        return spread_to_neighbours(m.amax(dim=0), neighbours)  # [B, pages]

    def record_drawn(self, rows: torch.Tensor, pages: torch.Tensor, mass: torch.Tensor) -> None:
        """A decode step's attention in every layer: ``rows`` [B] attended page indices ``pages`` [L, B, K]
        (distinct per row and layer), drawing ``mass`` [L, B, K] (summed over query heads); every other page
        of those rows drew none."""
        m = self.mass
        m.index_fill_(1, rows, 0.0)
        layers = torch.arange(m.shape[0], device=m.device)[:, None, None]
        m.index_put_((layers.expand_as(pages), rows[None, :, None].expand_as(pages), pages), mass.float())
