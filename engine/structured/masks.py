"""One step's token masks: which tokens each constrained row of the step may sample.

A request sampling ``1 + d`` positions in a step (its next token, and one after each of
its d draft tokens under speculative decoding) gets ``1 + d`` mask rows: row j is the
grammar's mask after the request's output and its first j drafts. llguidance's executor
computes them on its threads with the GIL released, advancing each matcher through the
drafts and rolling it back afterwards, so the matcher is where it was before the step
(the drafts were checked against the grammar when they were proposed, so every one of
them is allowed). The step's forward runs meanwhile (``ModelRunner.execute``).

Masks are ``int32 [rows, ceil(V / 32)]`` bitmasks, bit ``t % 32`` of word ``t // 32``
set when token t is allowed (the layout of llguidance and xgrammar).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.structured.compiler import Constraint


@dataclass
class TokenMasks:
    """The masked rows of one ``Sampler.sample`` call.

    Attributes:
        rows: indices of the sampled rows (of the call's batch) that are masked.
        bits: int32 ``[len(rows), ceil(V / 32)]`` bitmasks, on the CPU.
    """

    rows: list[int]
    bits: torch.Tensor


def allowed_matrix(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmasks as booleans.

    Args:
        bits: int32 ``[R, W]`` with ``32 * W >= vocab_size``.
        vocab_size: V.

    Returns:
        bool ``[R, V]``, True where the token is allowed.
    """
    if bits.device.type == "cpu":  # numpy's unpackbits is one C pass, several times faster than shifts here
        unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(np.ascontiguousarray(unpacked)).view(torch.bool)
    return allowed_by_shifts(bits, vocab_size)


def allowed_by_shifts(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``allowed_matrix`` in tensor ops on any device (the path GPUs take)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    expanded = (bits.unsqueeze(-1) >> shifts) & 1
    return expanded.reshape(bits.shape[0], -1)[:, :vocab_size].bool()


def _set_bit(bits: torch.Tensor, row: int, token_id: int) -> None:
    """Allow ``token_id`` in row ``row`` of an int32 bitmask (bit 31 is the sign bit)."""
    word, bit = divmod(token_id, 32)
    value = (1 << bit) if bit < 31 else -(1 << 31)
    bits[row, word] |= value


class MaskFiller:
    """Computes a step's masks with llguidance's thread pool.

    Args:
        threads: threads of the pool (the step's compute threads: on the CPU the forward
            has finished when the masks are computed).
    """

    def __init__(self, threads: int) -> None:
        from llguidance import LLExecutor

        self.executor = LLExecutor(max(1, threads))
        self._buf = torch.zeros(0, 0, dtype=torch.int32)

    @torch.inference_mode()
    def fill(self, entries: list[tuple[Constraint, int, list[int]]]) -> TokenMasks | None:
        """Masks for the step's constrained requests.

        Args:
            entries: per constrained request, its constraint, the sampler row of its first
                position, and the draft tokens it verifies (so it has ``1 + len(drafts)``
                consecutive rows from that one).

        Returns:
            The masks, or None when ``entries`` is empty. A row that allows no token (a
            dead end), or the first row of a matcher in its error state, allows the first
            end-of-reply token instead, so the sampler never sees an empty row, and the
            constraint's ``dead_rows`` names that position and why (the engine ends the
            reply there).
        """
        if not entries:
            return None
        words = entries[0][0].words
        total = sum(1 + len(d) for _, _, d in entries)
        if self._buf.shape[0] < total or self._buf.shape[1] != words:
            self._buf = torch.zeros(max(total, 2 * self._buf.shape[0]), words, dtype=torch.int32)
        bits = self._buf[:total]
        bits.zero_()
        plain: list[tuple[Any, int]] = []
        drafted: list[tuple[Any, int, list[int]]] = []
        rows: list[int] = []
        k = 0
        for constraint, first, drafts in entries:
            constraint.dead_rows = {}
            if drafts:
                drafted.append((constraint.matcher, k, list(drafts)))
            else:
                plain.append((constraint.matcher, k))
            rows.extend(range(first, first + 1 + len(drafts)))
            k += 1 + len(drafts)
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, bits.data_ptr(), words * 4, total)
        if drafted:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bits.data_ptr(), words * 4, total)
        empty = set((~bits.any(dim=1)).nonzero().flatten().tolist())
        k = 0
        for constraint, _first, drafts in entries:
            if constraint.matcher.is_error():  # its mask offers only an end token: not a real end
                empty.add(k)
            k += 1 + len(drafts)
        if empty:
            self._mark_dead(entries, empty, bits)
        return TokenMasks(rows=rows, bits=bits.clone())

    @staticmethod
    def _mark_dead(entries: list[tuple[Constraint, int, list[int]]], dead: set[int], bits: torch.Tensor) -> None:
        """Record the positions whose mask is empty (or whose matcher is in its error state)
        and let them sample an end token."""
        k = 0
        for constraint, _first, drafts in entries:
            for j in range(1 + len(drafts)):
                if k + j in dead:
                    reason = constraint.error or "the grammar allows no token here"
                    constraint.dead_rows[j] = reason
                    eos = constraint.vocab.eos_ids
                    if eos:
                        _set_bit(bits, k + j, eos[0])
                    else:  # no end token to offer: leave the row unmasked rather than empty
                        bits[k + j] = -1
            k += 1 + len(drafts)
