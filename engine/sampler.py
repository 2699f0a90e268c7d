"""Next-token sampling for one engine step, vectorised over the batch.

Per row: logit bias -> penalties -> grammar mask -> temperature -> top-k -> top-p ->
min-p -> sample, or argmax when the row is greedy. The grammar mask (constrained
decoding, ``engine.structured``) comes after everything that adds to a logit and before
every way of choosing, so no bias or penalty can bring back a token the grammar forbids,
and greedy, sampled and filtered rows all choose among allowed tokens only.

Randomness is an exponential race in its Gumbel-max form: argmax(probs / q) with q ~
Exp(1) equals argmax(log probs + g) with g = -log q = -log(-log u), u ~ U(0, 1). A
seeded request's uniforms for its i-th output token come from a generator seeded with
``noise_key(seed, i)`` (counter-based randomness, as Philox keys a stream by counter),
so a seeded row's draw depends only on its seed and position: never on its batch
neighbours (seeded requests are reproducible, docs/acceptance.md), and not on how many
tokens a step samples for it at once (a speculative step verifies several positions,
and keeps exactly the tokens that one-by-one sampling would have drawn).

A row with top_p < 1 (what chats use) races only among its nucleus candidates, which a
partial selection finds (``Sampler._nucleus``): a token outside the nucleus can never
win, so its noise is never drawn. Such a seeded row takes one uniform per rank, up to its
last kept candidate, from its keyed generator (so its tokens differ from those of the
whole-vocabulary race before 2026-12-02, with the same distribution); other rows race
over the whole vocabulary, one uniform per token id.

Sources: the CTRL paper (Keskar et al. 2019) for the repetition penalty, the OpenAI
API reference for frequency/presence penalties, Holtzman et al. 2019 (nucleus
sampling), Nguyen et al. 2024 (min-p), and vLLM's ``Sampler``/``TopKTopPSampler``
for the order of the steps and the exponential race.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import GREEDY_EPS, SamplingParams
from engine.structured.masks import TokenMasks, allowed_matrix

_F32 = torch.finfo(torch.float32)
# Floor for reported log-probabilities (OpenAI reports -9999.0 for "impossible").
LOGPROB_FLOOR = -9999.0


@dataclass
class SamplerOutput:
    """What one ``Sampler.sample`` call picked, one entry per batch row.

    token_ids: the sampled token id of each row, in ``[0, vocab_size)``.
    logprobs: per row, None unless that row's ``params.logprobs`` is set.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)


def noise_key(seed: int, position: int) -> int:
    """The generator seed for output token ``position`` of a request seeded with ``seed``:
    splitmix64 (Steele et al. 2014) of the pair, a 64-bit value."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


class PenaltyState:
    """One request's token history for the repetition/frequency/presence penalties.

    Create it once per request (only for requests where ``PenaltyState.needed`` is
    True), pass it to every ``Sampler.sample`` call for that request's rows, and
    ``append`` each token the request keeps (the caller does: a speculative step samples
    several positions and keeps only some). The state survives
    preemption with the request; a rebuilt state takes the output so far via
    ``output_ids``. Memory: ``vocab_size`` bytes + ``4 * vocab_size`` bytes on ``device``.

    Attributes:
        prompt_mask: bool ``[V]``, True where the token occurs in the prompt.
        output_counts: int32 ``[V]``, how many times each token was generated.
        counted: the same counts as {token id: count} over the generated tokens only.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        prompt_ids: Sequence[int] = (),
        output_ids: Sequence[int] = (),
    ) -> None:
        """Build the state from token ids (each in ``[0, vocab_size)``).

        Raises:
            IndexError: an id is outside ``[0, vocab_size)``.
        """
        self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        # the same counts, only the tokens generated: what the frequency and presence
        # penalties change (a step reads these few logits, not the whole vocabulary)
        self.counted: dict[int, int] = {}
        if len(prompt_ids):
            self.prompt_mask[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        if len(output_ids):
            ids = torch.tensor(list(output_ids), dtype=torch.long, device=device)
            self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            for t in ids.tolist():  # the tensor's checks ran: every id is in range
                self.counted[t] = self.counted.get(t, 0) + 1

    @staticmethod
    def needed(params: SamplingParams) -> bool:
        """True when ``params`` has any penalty switched on (so the row needs a state)."""
        return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0

    def append(self, token_id: int) -> None:
        """Count one more generated ``token_id``."""
        self.output_counts[token_id] += 1
        self.counted[token_id] = self.counted.get(token_id, 0) + 1


class Sampler:
    """Samples one token per row of a logits batch.

    The result of a keyed row depends only on (its noise key, its own logits and
    params): it draws ``vocab_size`` uniforms from a generator seeded with its key,
    whatever the other rows are. Unkeyed rows share ``self.generator`` (one batched
    draw), so they depend on their neighbours, which is allowed for unseeded requests.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        seed: int | None = None,
        top_p_candidates: int = 256,
    ) -> None:
        """Args:
            vocab_size: number of real tokens V; logits columns beyond V (padding) are ignored.
            device: where the logits live (cpu or cuda).
            seed: seed of the shared generator for unseeded rows; None draws one from the OS.
            top_p_candidates: the nucleus is looked for among this many most likely tokens
                first (a top-k instead of a full-vocabulary sort, which costs ~10x more
                on the CPU), then among 16x as many; when some row's candidates hold less
                than its top_p of the mass, the batch falls back to the full sort. Exact
                either way.
        """
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.top_p_candidates = max(1, top_p_candidates)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._keyed = torch.Generator(device=self.device)  # reseeded for every keyed row

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        noise_keys: Sequence[int | None] | None = None,
        token_counts: Sequence[PenaltyState | None] | None = None,
        extra_tokens: Sequence[Sequence[int]] | None = None,
        masks: TokenMasks | None = None,
    ) -> SamplerOutput:
        """Pick the next token of every row.

        Args:
            logits: float ``[B, V']`` with ``V' >= vocab_size``, on ``self.device``; raw model
                output (any float dtype; computed in float32). A row holding NaN or +-inf
                is sampled greedily over its finite values (token 0 if none is finite).
            params: B sampling parameters, row b uses ``params[b]``.
            noise_keys: B entries; a seeded request's ``noise_key(seed, position)`` for the
                output position the row samples, or None to use the shared generator.
                None means all rows are unkeyed.
            token_counts: B entries; the row's ``PenaltyState`` (required when
                ``PenaltyState.needed(params[b])``), else None. Not modified: the caller
                appends the tokens it keeps. None means no row has a state.
            extra_tokens: B entries (or None): tokens the row's penalties count as generated
                beyond its state (the drafts before a speculative position).
            masks: the grammar masks of the constrained rows (``TokenMasks``; every masked
                row allows at least one token), or None.

        Returns:
            ``SamplerOutput`` with B token ids, and for rows with ``params.logprobs`` set, the
            sampled token's log-probability and the top ``params.logprobs`` alternatives
            (descending). Log-probabilities are ``log_softmax`` of the raw logits (the
            model's own distribution, before logit bias, penalties, grammar mask,
            temperature and filtering, as the OpenAI API reports them), or with
            ``params.processed_logprobs`` of the distribution the token was drawn from
            (``distribution``'s), clamped below at ``LOGPROB_FLOOR`` (a token that could
            not be drawn has exactly that); always finite.

        Cost: a fixed number of tensor ops over the rows that need them (all-greedy is
        one argmax); one device-to-host copy at the end, plus one small host sync for the
        finiteness check and one per candidate level when some row has top_p < 1. A row
        with top_p < 1 and finite logits (a chat's default) draws noise for its nucleus
        candidates only (``_draw``), not for the whole vocabulary. A seeded row's tokens depend only on (seed, its
        step index, its logits and params) on a given device type.

        Raises:
            ValueError: shapes disagree with ``params``, or a row with a penalty has no state.
        """
        x, rows, finite = self._prepare(logits, params, noise_keys, token_counts)
        xp = self._adjust(x, params, token_counts, rows, extra_tokens, masks)
        token_ids = torch.argmax(xp, dim=1) if len(rows.sample) < len(params) else None
        z: torch.Tensor | None = None
        if rows.sample:
            idx = self._index(rows.sample, len(params))
            drawn, z = self._draw(_take(xp, idx), logits, rows.sample, params, noise_keys, finite,
                                  any(params[b].processed_logprobs for b in rows.logprobs))
            if idx is None:
                token_ids = drawn
            else:  # some rows are greedy: token_ids holds their argmax
                assert token_ids is not None
                token_ids = token_ids.index_copy(0, idx, drawn)
        assert token_ids is not None
        if any(params[b].processed_logprobs for b in rows.logprobs):
            x = self._processed(x, xp, z, logits, rows, params)
        return self._to_host(x, token_ids, params, rows.logprobs)

    def _draw(self, zs, logits, rows: list[int], params, noise_keys, finite: bool,
              want_z: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draw the token of each sampling row ``rows`` from its adjusted logits ``zs``
        ``[S, V]``; returns int64 ``[S]`` and, when ``want_z``, the filtered logits the
        tokens were drawn from (``_filtered_logits``'s, ``[S, V]``), else None.

        A row with top_p < 1 and finite logits (a chat's default) is drawn among its
        nucleus candidates (``_nucleus``, ``_draw_candidates``); any other row over the
        whole vocabulary as before (a row with non-finite logits gets no noise, so it
        takes argmax(z), its greedy token: the filters always keep the top token; ties go
        to the lowest id). Which way a row goes depends on the row alone, so a seeded
        row's token never depends on its neighbours."""
        ps = [params[b] for b in rows]
        ok_rows = [True] * len(rows) if finite else _take(self._finite_rows(logits), self._index(
            rows, logits.shape[0])).tolist()
        fast = [i for i, p in enumerate(ps) if p.top_p < 1.0 and ok_rows[i]]
        slow = sorted(set(range(len(rows))) - set(fast))
        parts: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []
        if fast:
            f_idx = self._index(fast, len(rows))
            f_ps = [ps[i] for i in fast]
            for group, zc, ranked in self._nucleus(self._scaled(_take(zs, f_idx), f_ps), f_ps):
                drawn = self._draw_candidates(zc, ranked, [rows[fast[i]] for i in group], noise_keys)
                z = _scatter_full(zc, ranked, self.vocab_size) if want_z else None
                parts.append(([fast[i] for i in group], drawn, z))
        if slow:
            s_rows = [rows[i] for i in slow]
            z = self._filtered_logits(_take(zs, self._index(slow, len(rows))), s_rows, params)
            ok = _take(self._finite_rows(logits), self._index(s_rows, logits.shape[0])).unsqueeze(1)
            # argmax(z + g) with Gumbel g = -log(-log u): the exponential race argmax(p / q).
            drawn = torch.argmax(z - self._log_exponentials(s_rows, noise_keys) * ok, dim=1)
            parts.append((slow, drawn, z))
        if len(parts) == 1:
            return parts[0][1], parts[0][2]
        tokens = torch.empty(len(rows), dtype=torch.long, device=self.device)
        z_all = torch.empty(len(rows), self.vocab_size, device=self.device) if want_z else None
        for which, drawn, z in parts:
            at = torch.tensor(which, device=self.device)
            tokens.index_copy_(0, at, drawn)
            if z_all is not None and z is not None:
                z_all.index_copy_(0, at, z)
        return tokens, z_all

    def _processed(self, x, xp, z, logits, rows: _Rows, params) -> torch.Tensor:
        """``x`` with the rows that asked for ``processed_logprobs`` replaced by the
        log-probabilities they were drawn from (``distribution``'s, from the filtered
        logits ``z`` of the sampling rows: masked tokens -inf; a greedy row's all on its
        argmax), so that ``_to_host``'s ``log_softmax`` reports them."""
        want = [b for b in rows.logprobs if params[b].processed_logprobs]
        greedy = torch.full_like(xp, -float("inf")).scatter_(1, torch.argmax(xp, dim=1, keepdim=True), 0.0)
        post = greedy
        if z is not None:
            idx = self._index(rows.sample, len(params))
            ok = _take(self._finite_rows(logits), idx).unsqueeze(1)
            post = _put(greedy, idx, torch.where(ok, z, _take(greedy, idx)))
        mask = torch.zeros(len(params), 1, dtype=torch.bool, device=x.device)
        mask[want] = True
        return torch.where(mask, post, x)

    def distribution(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        token_counts: Sequence[PenaltyState | None] | None = None,
        masks: TokenMasks | None = None,
    ) -> torch.Tensor:
        """The probabilities ``sample`` would draw each row from (a debugging/test hook).

        Same arguments as ``sample`` (without generators); changes no state.

        Returns:
            float32 ``[B, vocab_size]``, each row sums to 1; one-hot on the argmax for greedy
            rows and rows with non-finite logits.
        """
        x, rows, _ = self._prepare(logits, params, None, token_counts)
        xp = self._adjust(x, params, token_counts, rows, None, masks)
        probs = torch.nn.functional.one_hot(torch.argmax(xp, dim=1), self.vocab_size).float()
        if rows.sample:
            idx = self._index(rows.sample, len(params))
            sampled = torch.softmax(self._filtered_logits(_take(xp, idx), rows.sample, params), dim=1)
            ok = _take(self._finite_rows(logits), idx).unsqueeze(1)
            probs = _put(probs, idx, torch.where(ok, sampled, _take(probs, idx)))
        return probs

    # -- steps -------------------------------------------------------------------

    def _prepare(self, logits, params, noise_keys, token_counts) -> tuple[torch.Tensor, _Rows, bool]:
        """Check shapes, replace non-finite logits, and split the rows by the work they need.

        Returns ``(x, rows, finite)``: the float32 ``[B, vocab_size]`` logits (a view of
        ``logits`` when they are float32 and all finite: never written to), the row groups,
        and whether every logit was finite."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} rows x {self.vocab_size} tokens")
        for name, seq in (("noise_keys", noise_keys), ("token_counts", token_counts)):
            if seq is not None and len(seq) != len(params):
                raise ValueError(f"{name} has {len(seq)} entries for {len(params)} rows")
        x = logits[:, : self.vocab_size].float()
        # A finite sum means every value is finite (a NaN or an infinity anywhere makes it
        # NaN or infinite; a sum that overflows only sends the step the careful way).
        finite = bool(torch.isfinite(x.sum()))
        if not finite:
            # One fused pass: NaN/+-inf become the lowest finite value, so argmax is over finite values.
            x = torch.nan_to_num(x, nan=_F32.min, posinf=_F32.min, neginf=_F32.min)
        rows = _Rows()
        for b, p in enumerate(params):
            if PenaltyState.needed(p):
                if token_counts is None or token_counts[b] is None:
                    raise ValueError(f"row {b} has penalties but no PenaltyState")
                rows.penal.append(b)
            if p.temperature >= GREEDY_EPS:
                rows.sample.append(b)
            if p.logprobs is not None:
                rows.logprobs.append(b)
            if p.logit_bias:
                rows.bias.append(b)
        return x, rows, finite

    def _adjust(self, x, params, token_counts, rows: _Rows, extra_tokens, masks: TokenMasks | None) -> torch.Tensor:
        """The logits every choice is made from: raw, plus logit bias, penalised, masked by
        the grammar (a new tensor when anything applies; ``x`` stays raw for logprobs)."""
        xb = self._bias(x, params, rows.bias)
        xp = self._penalise(xb, params, token_counts, rows.penal, extra_tokens)
        return self._mask(xp, masks)

    def _bias(self, x, params, bias_rows: list[int]) -> torch.Tensor:
        """Add each row's ``logit_bias`` (ids at or above the vocabulary are ignored; the
        engine refuses them before)."""
        if not bias_rows:
            return x
        idx = self._index(bias_rows, x.shape[0])
        add = torch.zeros(len(bias_rows), self.vocab_size, device=self.device)
        for i, b in enumerate(bias_rows):
            items = [(t, v) for t, v in params[b].logit_bias.items() if t < self.vocab_size]
            if items:
                ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=self.device)
                add[i].index_put_((ids,), torch.tensor([v for _, v in items], device=self.device))
        return _put(x, idx, _take(x, idx) + add)

    def _mask(self, x, masks: TokenMasks | None) -> torch.Tensor:
        """Forbidden tokens of the masked rows become -inf (each masked row allows at
        least one token, so every row keeps a finite maximum)."""
        if masks is None or not masks.rows:
            return x
        idx = self._index(masks.rows, x.shape[0])
        allowed = allowed_matrix(masks.bits.to(self.device, non_blocking=True), self.vocab_size)
        return _put(x, idx, torch.where(allowed, _take(x, idx), -float("inf")))

    def _penalise(self, x, params, token_counts, penal: list[int], extra_tokens) -> torch.Tensor:
        """Apply repetition (CTRL), frequency and presence (OpenAI) penalties to rows ``penal``,
        counting each row's ``extra_tokens`` as generated too.

        Returns a new tensor when any row is penalised (``x`` itself is left raw for logprobs).
        """
        if not penal:
            return x
        idx = self._index(penal, x.shape[0])
        if all(params[b].repetition_penalty == 1.0 for b in penal):
            return self._penalise_generated(x, params, token_counts, penal, extra_tokens, idx)
        counts = torch.stack([token_counts[b].output_counts for b in penal]).float()
        for i, b in enumerate(penal):
            extra = extra_tokens[b] if extra_tokens is not None else ()
            if extra:
                ids = torch.tensor(list(extra), dtype=torch.long, device=self.device)
                counts[i].index_add_(0, ids, torch.ones(len(extra), device=self.device))
        generated = counts > 0
        rep, freq, pres = ([getattr(params[b], name) for b in penal]
                           for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
        xp = _take(x, idx)
        if any(r != 1.0 for r in rep):
            seen = torch.stack([token_counts[b].prompt_mask for b in penal]) | generated
            r = self._column(rep)
            xp = torch.where(seen, torch.where(xp > 0, xp / r, xp * r), xp)
        if any(f != 0.0 for f in freq):
            xp = xp - self._column(freq) * counts
        if any(p != 0.0 for p in pres):
            xp = xp - self._column(pres) * generated.float()
        # Huge or tiny penalties can overflow; keep the row finite so argmax stays defined.
        xp = torch.nan_to_num(xp, nan=_F32.min, posinf=_F32.max, neginf=_F32.min)
        return _put(x, idx, xp)

    def _penalise_generated(self, x, params, token_counts, penal: list[int], extra_tokens,
                            idx: torch.Tensor | None) -> torch.Tensor:
        """``_penalise`` for rows without a repetition penalty: the frequency and presence
        penalties change only the logits of tokens generated before (count > 0), so those
        are gathered, changed by the same float operations in the same order
        (``x - f * count``, then ``- p``, then the same ``nan_to_num``) and written back
        into a copy of the rows: the same values as the whole-vocabulary computation, for
        a few hundred logits a row instead of ``[rows, vocab]`` passes."""
        r_l: list[int] = []
        t_l: list[int] = []
        c_l: list[int] = []
        f_l: list[float] = []
        p_l: list[float] = []
        for i, b in enumerate(penal):
            counted = token_counts[b].counted
            extra = extra_tokens[b] if extra_tokens is not None else ()
            if extra:
                counted = dict(counted)
                for t in extra:
                    counted[t] = counted.get(t, 0) + 1
            n = len(counted)
            r_l += [i] * n
            t_l += counted.keys()
            c_l += counted.values()
            f_l += [params[b].frequency_penalty] * n
            p_l += [params[b].presence_penalty] * n
        xp = _take(x, idx)
        xp = xp.clone() if idx is None else xp  # rows idx are a copy already; x stays raw
        if t_l:
            at = (torch.tensor(r_l, device=self.device), torch.tensor(t_l, device=self.device))
            v = xp[at]
            if any(f != 0.0 for f in f_l):
                v = v - torch.tensor(f_l, dtype=torch.float32, device=self.device) * torch.tensor(
                    c_l, dtype=torch.float32, device=self.device)
            if any(p != 0.0 for p in p_l):
                v = v - torch.tensor(p_l, dtype=torch.float32, device=self.device)
            xp[at] = torch.nan_to_num(v, nan=_F32.min, posinf=_F32.max, neginf=_F32.min)
        return _put(x, idx, xp)

    def _filtered_logits(self, z: torch.Tensor, rows: list[int], params) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p masks (masked logits become -inf).

        Args:
            z: float32 ``[S, V]`` finite (penalised) logits of the sampling rows ``rows``.
        Returns:
            float32 ``[S, V]`` scaled logits whose max per row is 0 (the top token always
            survives, so no row is ever empty: sampling edge values (docs/acceptance.md#sampling-edge-values)).
        """
        ps = [params[b] for b in rows]
        z = self._scaled(z, ps)
        nucleus = [i for i, p in enumerate(ps) if p.top_p < 1.0]
        if nucleus:
            # Only rows with top_p < 1: top_p == 1 keeps everything, even where a float
            # cumsum over the vocabulary rounds past 1.
            idx = self._index(nucleus, len(ps))
            zn = torch.empty(len(nucleus), self.vocab_size, device=self.device)
            for group, zc, ranked in self._nucleus(_take(z, idx), [ps[i] for i in nucleus]):
                zn.index_copy_(0, torch.tensor(group, device=self.device), _scatter_full(zc, ranked, self.vocab_size))
            z = _put(z, idx, zn)
        others = [i for i, p in enumerate(ps) if p.top_p >= 1.0 and p.min_p > 0.0]
        if others:  # min-p without a nucleus (a nucleus row's min-p is applied by _nucleus)
            idx = self._index(others, len(ps))
            zo = _take(z, idx)
            probs = torch.softmax(zo, dim=1)
            thr = self._column([ps[i].min_p for i in others]) * probs.amax(dim=1, keepdim=True)
            z = _put(z, idx, zo.masked_fill(probs < thr, -float("inf")))
        return z

    def _scaled(self, z: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
        """Temperature and top-k: float32 ``[S, V]`` logits ``(z - max) / T`` with the
        tokens below each row's k-th largest at -inf (ties at the k-th value all kept);
        the max of each row is 0."""
        # Subtracting the max first keeps (z - max) / T finite for T >= GREEDY_EPS.
        z = (z - z.amax(dim=1, keepdim=True)) / self._column([p.temperature for p in ps])
        ks = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in ps]
        if any(ks):
            # Keep logits >= the k-th largest (ties at the k-th value are all kept).
            kth = torch.topk(z, max(ks), dim=1).values
            k = torch.tensor(ks, device=self.device)
            thr = kth.gather(1, (k.clamp(min=1) - 1).unsqueeze(1))
            thr = torch.where(k.unsqueeze(1) > 0, thr, torch.full_like(thr, -float("inf")))
            z = z.masked_fill(z < thr, -float("inf"))
        return z

    def _nucleus(self, z: torch.Tensor,
                 ps: list[SamplingParams]) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """Top-p (then min-p) of rows that all have top_p < 1, kept compact: each row's
        candidates in rank order and their logits, the dropped ones at -inf.

        A token is dropped when the mass of the tokens ranked before it already reaches
        top_p (Holtzman et al. 2019: the smallest set of most likely tokens holding top_p
        of the mass); the first has mass 0 before it, so it always survives. Ranking is by
        probability ``softmax(z)``, ties by lower id (as argmax), so a tiny top_p is
        exactly greedy. Partial selection instead of a full sort: a row's nucleus is
        looked for among its ``top_p_candidates`` most likely tokens (``torch.topk``),
        then, for the rows where those fell short, among 16x as many, and so on, and
        last by a full sort. With v the k-th largest probability, the candidates above v
        are all the tokens above v; when they hold top_p of the mass, every token at or
        below v has at least that mass before it and is dropped, so the nucleus lies
        among them, whatever ties at v ``topk`` cut. Within the candidates the cumulative
        sums are those of the full sort (a prefix of it), so the kept set is the full
        sort's. Each row stops at its own
        level: one flat row does not make the others sort the vocabulary. Min-p (Nguyen
        et al. 2024) then drops candidates whose probability, renormalised over the
        nucleus, is below min_p times the largest.

        Args:
            z: float32 ``[R, V]`` scaled logits (``_scaled``); ps: R params, top_p in (0, 1).
        Returns:
            groups ``(rows, zc, ranked)``, each row of ``range(R)`` in one: float32
            ``[len(rows), C]`` logits of each row's candidates in rank order (-inf where
            dropped; column 0 is always kept) and int64 ``[len(rows), C]`` their token
            ids; C is 256, 4096 or V, one per group.
        """
        probs = torch.softmax(z, dim=1)
        top_p = self._column([p.top_p for p in ps])
        vocab = probs.shape[1]
        found: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # rows, sorted probs, ranked ids
        todo = list(range(len(ps)))
        k = self.top_p_candidates
        while todo and k < vocab:  # candidates, 16x more candidates, ...
            at = self._index(todo, len(ps))
            cand_p, cand_i = torch.topk(_take(probs, at), k, dim=1)
            k *= 16
            # The candidates above the k-th largest probability v are every token above v. When
            # they hold top_p, every token at or below v (a candidate or not, tied or not) has
            # at least their mass before it: dropped, here as in the full sort.
            above = cand_p * (cand_p > cand_p[:, -1:])
            held = (above.sum(dim=1, keepdim=True) >= _take(top_p, at)).squeeze(1).tolist()  # one host sync
            done = [i for i, h in enumerate(held) if h]
            if done:
                sel = self._index(done, len(todo))
                by_id, perm = torch.sort(_take(cand_i, sel), dim=1)
                sp, order = torch.sort(_take(cand_p, sel).gather(1, perm), dim=1, descending=True, stable=True)
                found.append(([todo[i] for i in done], sp, by_id.gather(1, order)))
            todo = [todo[i] for i, h in enumerate(held) if not h]
        if todo:  # ... then the full sort
            sp, ranked = torch.sort(_take(probs, self._index(todo, len(ps))), dim=1, descending=True, stable=True)
            found.append((todo, sp, ranked))
        groups = []
        for rows, sp, ranked in found:
            at = self._index(rows, len(ps))
            drop = (torch.cumsum(sp, dim=1) - sp) >= _take(top_p, at)
            zc = _take(z, at).gather(1, ranked).masked_fill(drop, -float("inf"))
            min_p = [ps[r].min_p for r in rows]
            if any(v > 0.0 for v in min_p):
                pc = torch.softmax(zc, dim=1)
                thr = self._column(min_p) * pc.amax(dim=1, keepdim=True)
                zc = zc.masked_fill(pc < thr, -float("inf"))
            groups.append((rows, zc, ranked))
        return groups

    def _draw_candidates(self, zc: torch.Tensor, ranked: torch.Tensor, rows: list[int], noise_keys) -> torch.Tensor:
        """One token per row from ``_nucleus``'s candidates: the exponential race of the
        module docstring over the kept candidates only (a dropped token cannot win, so
        its noise is never needed): ``ranked[argmax(zc - log q)]``.

        A keyed row draws its uniforms from a generator seeded with its key, one for
        each rank up to its last kept candidate, which depends only on the row's own
        logits and params (not on the batch's candidate width C); unkeyed rows share one
        ``[S, C]`` draw from the shared generator.

        Returns:
            int64 ``[S]`` token ids.
        """
        S, C = zc.shape
        kept = torch.isfinite(zc)
        # ranks up to the last kept candidate, per row (dropped ranks can lie between kept
        # ones only where the float cumsum is not monotone; they just get unused noise)
        span = (kept * torch.arange(1, C + 1, device=zc.device)).amax(dim=1).tolist()
        u = torch.full((S, C), 0.5, device=self.device)
        unseeded: list[int] = []
        for i, b in enumerate(rows):
            key = noise_keys[b] if noise_keys is not None else None
            if key is None:
                unseeded.append(i)
            else:
                u[i, : span[i]].uniform_(generator=self._keyed.manual_seed(key))
        if unseeded:
            shared = torch.empty(len(unseeded), C, device=self.device).uniform_(generator=self.generator)
            u = _put(u, self._index(unseeded, S), shared)
        log_q = u.clamp_(_F32.tiny, 1.0 - _F32.eps / 2).log_().neg_().log_()
        return ranked.gather(1, torch.argmax(zc - log_q, dim=1, keepdim=True)).squeeze(1)

    def _finite_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: the row's logits are all finite (one min/max pass; NaN propagates)."""
        lo, hi = torch.aminmax(logits[:, : self.vocab_size], dim=1)
        return torch.isfinite(lo) & torch.isfinite(hi)

    def _log_exponentials(self, rows: list[int], noise_keys) -> torch.Tensor:
        """``log q`` for q = -log u ~ Exp(1) (minus a Gumbel sample), float32 ``[S, V]``:
        each keyed row's V uniforms from a generator seeded with its key, the unkeyed rows
        in one draw from the shared generator."""
        noise = torch.empty(len(rows), self.vocab_size, device=self.device)
        unseeded: list[int] = []
        for i, b in enumerate(rows):
            key = noise_keys[b] if noise_keys is not None else None
            if key is None:
                unseeded.append(i)
            else:
                noise[i].uniform_(generator=self._keyed.manual_seed(key))
        if unseeded:
            shared = torch.empty(len(unseeded), self.vocab_size, device=self.device).uniform_(generator=self.generator)
            noise = _put(noise, self._index(unseeded, len(rows)), shared)
        # u = 0 or 1 would make log q infinite, and inf * 0 (a noise-free row) is NaN;
        # the clamp keeps every value finite.
        return noise.clamp_(_F32.tiny, 1.0 - _F32.eps / 2).log_().neg_().log_()

    def _to_host(self, x, token_ids, params, lp_rows: list[int]) -> SamplerOutput:
        """Gather tokens and logprobs, and copy them to the host in one transfer."""
        parts = [token_ids.double()]
        n = min(max((params[b].logprobs for b in lp_rows), default=0), self.vocab_size)
        if lp_rows:
            idx = self._index(lp_rows, len(params))
            lp = torch.log_softmax(_take(x, idx), dim=1).clamp(min=LOGPROB_FLOOR)
            parts.append(lp.gather(1, _take(token_ids, idx).unsqueeze(1)).squeeze(1).double())
            if n:
                top = torch.topk(lp, n, dim=1)
                parts += [top.values.double().flatten(), top.indices.double().flatten()]
        flat = torch.cat(parts).tolist()
        B, L = len(params), len(lp_rows)
        tokens = [int(t) for t in flat[:B]]
        logprobs: list[TokenLogprob | None] = [None] * B
        top_vals, top_ids = flat[B + L : B + L + L * n], flat[B + L + L * n :]
        for j, b in enumerate(lp_rows):
            k = min(params[b].logprobs, n)
            best = [(int(top_ids[j * n + i]), top_vals[j * n + i]) for i in range(k)]
            logprobs[b] = TokenLogprob(token_id=tokens[b], logprob=flat[B + j], top=best)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs)

    def _index(self, rows: list[int], total: int) -> torch.Tensor | None:
        """Row-index tensor for ``rows``, or None when they are all ``total`` rows in order."""
        if len(rows) == total:
            return None
        return torch.tensor(rows, device=self.device)

    def _column(self, values: list[float]) -> torch.Tensor:
        """float32 ``[N, 1]`` per-row parameter column on the sampler's device."""
        return torch.tensor(values, dtype=torch.float32, device=self.device).unsqueeze(1)


def _scatter_full(zc: torch.Tensor, ranked: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 ``[R, vocab]``: ``zc`` at the token ids ``ranked``, -inf elsewhere."""
    full = torch.full((zc.shape[0], vocab), -float("inf"), dtype=zc.dtype, device=zc.device)
    return full.scatter_(1, ranked, zc)


def _take(t: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """Rows ``idx`` of ``t`` (``t`` itself when idx is None: all rows)."""
    return t if idx is None else t[idx]


def _put(t: torch.Tensor, idx: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """``t`` with rows ``idx`` replaced by ``rows`` (out of place; ``rows`` when idx is None)."""
    return rows if idx is None else t.index_copy(0, idx, rows)


@dataclass
class _Rows:
    """Row indices grouped by the work they need in one step."""

    penal: list[int] = field(default_factory=list)
    sample: list[int] = field(default_factory=list)
    logprobs: list[int] = field(default_factory=list)
    bias: list[int] = field(default_factory=list)
