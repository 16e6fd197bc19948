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

With a key sketch (``sketch_bits`` 8 or 4) the table also keeps every key of every page, quantised inside
its page's own box: ``code = round((k - kmin) / (kmax - kmin) * (2^bits - 1))`` per dimension, so a key
is ``kmin + code * step`` with ``step = 2r / (2^bits - 1)``, within ``step / 2`` of the truth in each
dimension. Layout ``[L, rows, Hkv, Pcap, D * bits / 8, S]`` uint8, dimension-major within a page (byte
``(j, t)``: token t's code of dimension j, or at 4 bits of dimensions 2j in the low nibble and 2j + 1 in the
high one), so that one 16-byte load is a dimension of a 16-token page's keys (the native kernel's lanes).
It costs ``D * bits / 8`` bytes per token and head beside the box's ``8D / S`` (at S = 16, D = 64: 32 bytes
at 4 bits, as much as the box), and it turns a page's score from a bound into an estimate of the attention
mass the page really draws (``selection.sketch_weights``).

For ``--selection-rest`` (the pages a decode step leaves out, attended as one column instead of dropped from
the softmax: ``selection.rest_of_pages``) the table also keeps, under "means", each page's mean value per KV
head (``values``, ``[L, rows, Hkv, Pcap, D]`` float32, 1/S of the page's values), weighed by the attention
the key sketch predicts for the page; under "sketch", the box of each page's values (``values``, ``[...,
2D]``, as the keys' box) and every value quantised to 8 bits inside it (``vcodes``, ``[L, rows, Hkv, Pcap,
S, D]`` uint8, token-major), each weighed by the attention its sketched key predicts.
"""

from __future__ import annotations

import torch


def key_bounds(k: torch.Tensor) -> torch.Tensor:
    """k [n, Hkv, S, D] (n full pages, head-major) -> [n, Hkv, 2D] float32: the center and the radius of the
    box the page's keys span."""
    kf = k.float()
    hi, lo = kf.amax(dim=2), kf.amin(dim=2)
    return torch.cat([(hi + lo) * 0.5, (hi - lo) * 0.5], dim=-1)


def key_codes(k: torch.Tensor, bounds: torch.Tensor, bits: int) -> torch.Tensor:
    """k [..., S, D]; bounds [..., 2D] (``key_bounds`` of the same keys) -> [..., D * bits / 8, S] uint8: each
    key quantised in its page's box, dimension-major (4 bits: two dimensions a byte, the even one in the low
    nibble)."""
    d = k.shape[-1]
    c, r = bounds[..., None, :d], bounds[..., None, d:]
    top = (1 << bits) - 1
    scale = torch.where(r > 0, top / (2 * r).clamp_min(1e-30), torch.zeros_like(r))
    q = ((k.float() - (c - r)) * scale).round_().clamp_(0, top).to(torch.uint8).transpose(-1, -2)  # [..., D, S]
    return (q if bits == 8 else q[..., 0::2, :] | (q[..., 1::2, :] << 4)).contiguous()


def value_codes(v: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """v [..., S, D]; bounds [..., 2D] (``key_bounds`` of the same values) -> [..., S, D] uint8: each value
    quantised to 8 bits in its page's box, token-major (a token's D codes are one run: the native kernel
    weighs each token's whole value vector at once)."""
    return key_codes(v, bounds, 8).transpose(-1, -2).contiguous()


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D * bits / 8, S] uint8 -> [..., D, S] float32 codes (``key_codes``' inverse packing)."""
    if bits == 8:
        return codes.float()
    return torch.stack([codes & 0xF, codes >> 4], dim=-2).flatten(-3, -2).float()


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
                 rows: int = 1, pages: int = 64, page_size: int = 16, sketch_bits: int = 0,
                 rest: str = "drop") -> None:
        if sketch_bits not in (0, 4, 8):
            raise ValueError(f"sketch_bits {sketch_bits}: expected 0 (no key sketch), 4 or 8")
        if rest not in ("drop", "means", "sketch"):
            raise ValueError(f"rest {rest!r}: expected drop, means or sketch")
        self.shape = (num_layers, num_kv_heads, 2 * head_dim)
        self.page_size, self.sketch_bits, self.rest = page_size, sketch_bits, rest
        self.device = device
        self.table, self.mass, self.codes, self.values, self.vcodes = self._zeros(max(1, rows), max(1, pages))

    def _zeros(self, rows: int, pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                     torch.Tensor | None, torch.Tensor | None]:
        L, H, D2 = self.shape

        def zeros(*tail: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros((L, rows, H, pages, *tail), dtype=dtype, device=self.device)

        with torch.inference_mode(False):  # long-lived: written from the model's forward and outside it
            codes = zeros(D2 // 2 * self.sketch_bits // 8, self.page_size, dtype=torch.uint8) if self.sketch_bits else None
            values = zeros(D2 // 2) if self.rest == "means" else zeros(D2) if self.rest == "sketch" else None
            vcodes = zeros(self.page_size, D2 // 2, dtype=torch.uint8) if self.rest == "sketch" else None
            return (zeros(D2), torch.zeros((L, rows, pages), dtype=torch.float32, device=self.device), codes,
                    values, vcodes)

    def bytes_per_token(self) -> tuple[int, int]:
        """(summary bytes, sketch bytes) a token of one sequence takes in this table, all layers: the key box
        (and the value means or the value box), the key sketch (and the value sketch)."""
        L, H, D2 = self.shape
        box = L * H * (D2 + (D2 // 2 if self.rest == "means" else D2 if self.rest == "sketch" else 0)) * 4 // self.page_size
        return box, L * H * D2 // 2 * (self.sketch_bits + (8 if self.rest == "sketch" else 0)) // 8

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
        grown = self._zeros(r, p)
        grown[1][:, : self.rows, : self.pages] = self.mass
        for new, old in zip(grown, (self.table, None, self.codes, self.values, self.vcodes), strict=True):
            if new is not None and old is not None:
                new[:, : self.rows, :, : self.pages] = old
        self.table, self.mass, self.codes, self.values, self.vcodes = grown

    def set(self, layer: int, row: int, first_page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Summarise full pages k, v [n, Hkv, S, D] of ``layer`` as pages first_page.. of ``row`` (a page
        written has drawn no attention yet: a row reused by another sequence starts without the old one's)."""
        n = k.shape[0]
        if n:
            bounds = key_bounds(k)  # [n, Hkv, 2D]
            self.table[layer, row, :, first_page : first_page + n] = bounds.transpose(0, 1)
            self.mass[layer, row, first_page : first_page + n] = 0.0
            if self.codes is not None:
                self.codes[layer, row, :, first_page : first_page + n] = \
                    key_codes(k, bounds, self.sketch_bits).transpose(0, 1)
            if self.values is not None:
                self.values[layer, row, :, first_page : first_page + n] = self._of_values(v).transpose(0, 1)
            if self.vcodes is not None:
                self.vcodes[layer, row, :, first_page : first_page + n] = \
                    value_codes(v, self.values[layer, row, :, first_page : first_page + n].transpose(0, 1)).transpose(0, 1)

    def set_all_layers(self, row: int, page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Summarise page ``page`` of ``row`` in every layer at once: k, v [L, Hkv, S, D] (a decode page that
        filled)."""
        bounds = key_bounds(k)  # [L, Hkv, 2D]
        self.table[:, row, :, page] = bounds
        self.mass[:, row, page] = 0.0
        if self.codes is not None:
            self.codes[:, row, :, page] = key_codes(k, bounds, self.sketch_bits)
        if self.values is not None:
            self.values[:, row, :, page] = self._of_values(v)
        if self.vcodes is not None:
            self.vcodes[:, row, :, page] = value_codes(v, self.values[:, row, :, page])

    def _of_values(self, v: torch.Tensor) -> torch.Tensor:
        """v [n, Hkv, S, D] -> [n, Hkv, D] each page's mean value (rest "means") or [n, Hkv, 2D] its values'
        box (rest "sketch")."""
        return v.float().mean(dim=2) if self.rest == "means" else key_bounds(v)

    @staticmethod
    def _of_rows(t: torch.Tensor, rows: torch.Tensor, first_row: int | None, pages: int) -> torch.Tensor:
        """t [rows, Hkv, Pcap, ...] -> [B, Hkv, pages, ...] of ``rows``: a view when they are consecutive
        (``first_row`` given), else a copy."""
        if first_row is not None:
            return t[first_row : first_row + rows.shape[0], :, :pages]
        return t.index_select(0, rows)[:, :, :pages]

    def batch(self, layer: int, rows: torch.Tensor, first_row: int | None, pages: int) -> torch.Tensor:
        """[B, Hkv, pages, 2D] of ``rows``: a view when they are consecutive (``first_row`` given)."""
        return self._of_rows(self.table[layer], rows, first_row, pages)

    def sketch(self, layer: int, rows: torch.Tensor, first_row: int | None, pages: int) -> torch.Tensor | None:
        """[B, Hkv, pages, D * bits / 8, S] uint8: the key sketch of ``rows`` (None without one)."""
        return None if self.codes is None else self._of_rows(self.codes[layer], rows, first_row, pages)

    def value_summary(self, layer: int, rows: torch.Tensor, first_row: int | None,
                      pages: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Rest "means": ([B, Hkv, pages, D] each page's mean value, None); rest "sketch": ([B, Hkv, pages, 2D]
        its values' box, [B, Hkv, pages, S, D] uint8 its values quantised to 8 bits in that box); None under
        "drop"."""
        if self.values is None:
            return None
        vcodes = None if self.vcodes is None else self._of_rows(self.vcodes[layer], rows, first_row, pages)
        return self._of_rows(self.values[layer], rows, first_row, pages), vcodes

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
