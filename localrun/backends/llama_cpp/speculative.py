"""Speculative decoding on llama.cpp's single path, through llama-cpp-python's low-level
API: drafts from the prompt's n-grams (:class:`~localrun.backends.ngram.NgramDrafter`,
``llama-lookup``'s algorithm) or from a draft model (:mod:`.draft`), verified in one
``llama_decode`` of the last token and the drafts, each row drawn from the request's
own sampler chain (the chain ``Llama.generate`` draws from: same samplers, same seed,
one draw per token), so a kept draft is the token the target draws there itself.

**Same tokens.** Each row of a verify batch is computed as a one-token decode computes
it while the sequence holds at most :data:`SPLIT_KV_CELLS` cells: ggml's matmuls give
the same logits for one row or several (``vec_dot`` and tinyBLAS;
docs/results/llama_batch.md) and attention goes row by row below 64 rows. Past that a
one-token decode takes flash attention's split-KV kernel, which sums in another order,
so in exact mode rounds stop there and greedy replies equal plain decoding's; in fast
mode they go on, and a near-tie there may go the other way (as in ``llama-lookup``
and llama-server's speculative decoding, which verify the same way).
Not speculated: constrained replies, log probabilities, recurrent models (their state
cannot be cut back to a kept draft).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

from localrun.backends.base import GenerationStats, LoadRequest
from localrun.backends.llama_cpp.engine import Engine
from localrun.backends.ngram import NgramDrafter, resume
from localrun.backends.speculative import DRAFT_MAX, Governor, History, Timer
from localrun.sampling import ResolvedSampling
from localrun.types import SpeculativeMode

if TYPE_CHECKING:
    from localrun.backends.llama_cpp.draft import DraftModel

#: Cells past which llama.cpp's one-token decode takes the split-KV attention kernel (a
#: stream of more than 256 cells is padded to 512, ggml's threshold): exact mode's limit.
SPLIT_KV_CELLS = 256
#: Tokens a draft model drafts per round when asked for by name (llama-speculative's
#: default ``--spec-draft-n-max``).
DRAFT_MODEL_MAX = 3


class Speculation:
    """One session's speculative decoding: its mode, its draft model (if any) and the
    cost history the auto policy learns from."""

    def __init__(self, mode: SpeculativeMode, *, draft: DraftModel | None = None,
                 draft_max: int = DRAFT_MAX, exact: bool = False) -> None:
        self.mode: SpeculativeMode = mode
        self.draft = draft
        self.draft_max = draft_max
        self.exact = exact
        self.history = History()
        self.draft_history = History()
        #: the last request's n-gram counts (its prompt and reply): the next one, which
        #: starts with them on a chat's next turn, counts only its new tokens
        self.ngrams: NgramDrafter | None = None

    def mode_for(self, sampling: ResolvedSampling, requested: SpeculativeMode | None
                 ) -> SpeculativeMode:
        """What this request runs: its own ``speculative=`` else the load's; "off"
        where it cannot apply (a constraint, log probabilities)."""
        mode = requested or self.mode
        if mode == "draft" and self.draft is None:
            mode = "prompt-lookup"  # the request asked; the load has no draft model
        if sampling.constraint is not None or sampling.logprobs is not None:
            return "off"
        return mode

    def run(self, engine: Engine, prompt: Sequence[int], sampler: Any,
            mode: SpeculativeMode, max_tokens: int) -> SpeculativeRun:
        with_model = self.draft is not None and mode in ("draft", "auto")
        history = self.draft_history if with_model else self.history
        limit = SPLIT_KV_CELLS - 1 if self.exact else None
        # a draft model's every token costs a step of its own: asked for by name, it
        # drafts llama-speculative's default; auto picks up to draft_max by its costs
        n = min(self.draft_max, DRAFT_MODEL_MAX) if with_model and mode == "draft" \
            else self.draft_max
        if with_model and mode == "auto":
            # auto with a draft model: the prompt's n-gram drafts first (they cost
            # nothing to make), the draft model's where there are none, each weighed by
            # its own costs
            lookup = Governor("auto", self.history, self.draft_max, limit=limit)
            by_model = Governor("auto", history, n, with_model=True, limit=limit)
            return SpeculativeRun(engine, list(prompt), sampler, lookup, self.draft,
                                  max_tokens, by_model=by_model, owner=self)
        governor = Governor("auto" if mode == "auto" else "prompt-lookup", history, n,
                            with_model=with_model, limit=limit)
        return SpeculativeRun(engine, list(prompt), sampler, governor,
                              self.draft if with_model else None, max_tokens, owner=self)

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
            self.draft = None


class SpeculativeRun:
    """One request's token loop: yields each token the target draws, in order."""

    def __init__(self, engine: Engine, prompt: list[int], sampler: Any, governor: Governor,
                 draft: DraftModel | None, max_tokens: int,
                 *, by_model: Governor | None = None, owner: Speculation | None = None
                 ) -> None:
        self.engine = engine
        self.owner = owner  # keeps the n-gram counts for the next request
        self.prompt = prompt
        self.sampler = sampler
        #: the governor of the n-gram drafts (or of the draft model's, when it drafts
        #: alone); ``by_model``: the draft model's, where auto has both
        self.governor = governor
        self.by_model = by_model
        self.draft = draft
        self.max_tokens = max_tokens
        #: llama.cpp's counters once the prompt is in (a verify batch counts as a
        #: prompt to them: the decode's time is everything after)
        self._at_prompt: tuple[int, float, float] = (0, 0.0, 0.0)
        self._draft_prefill = self._draft_decode = 0.0  # the draft model's seconds

    def tokens(self) -> Generator[int, None, None]:
        engine = self.engine
        llm, lc = engine.llm, engine.lc
        ctx = llm._ctx
        prompt = self.prompt
        fed = int(llm.n_tokens)
        # as Llama.generate: the whole prompt fed by the session's reuse (and its logits
        # live) samples from them; older bindings feed the last token again
        if fed >= len(prompt) and getattr(llm, "_requires_eval", True):
            fed = len(prompt) - 1
            llm.n_tokens = fed
        if fed < len(prompt):
            llm.eval(prompt[fed:])
        token = int(self.sampler.sample(ctx, -1))
        # llama.cpp counts a decode when it synchronizes (the sample above did)
        perf = lc.llama_perf_context(engine.ctx)
        self._at_prompt = (int(perf.n_p_eval), perf.t_p_eval_ms, perf.t_eval_ms)
        if self.draft is not None:
            with Timer() as td:
                self.draft.prefill(prompt)
            self._draft_prefill = td.seconds
        seq = list(prompt)
        both = self.by_model is not None
        drafter: NgramDrafter | None = None  # counted after the first token is out
        lookup, batch = self.governor, llm._batch
        by_model = self.by_model if both else (lookup if self.draft is not None else None)
        histories = {id(g.history): g.history for g in (lookup, by_model) if g is not None}
        n_ctx, last = int(llm.n_ctx()), len(prompt) + self.max_tokens
        try:
            while True:
                yield token
                seq.append(token)
                if drafter is None and (self.draft is None or both):
                    drafter = self._drafter(prompt)
                if drafter is not None:
                    drafter.extend((token,))
                if engine.is_eog(token):
                    return
                n_past = len(seq) - 1  # the last token has no cells yet
                if n_past + 1 >= n_ctx:
                    return
                # drafts past the context or the token limit could never be kept
                room = min(n_ctx - n_past - 1, last - len(seq) - 1)
                drafts: list[int] = []
                gov = lookup
                if drafter is not None:
                    proposal = drafter.draft(min(lookup.draft_max, room))
                    drafts = proposal[:lookup.length(len(proposal), n_past)]
                if not drafts and by_model is not None and self.draft is not None:
                    gov = by_model
                    k = by_model.length(min(by_model.draft_max, room), n_past)
                    if k:
                        with Timer() as td:
                            drafts = self.draft.propose(seq, k)
                        by_model.history.drafted(len(drafts), td.seconds)
                        self._draft_decode += td.seconds
                if not drafts:
                    with Timer() as t:
                        batch.set_batch(batch=[token], n_past=n_past, logits_all=False)
                        ctx.decode(batch)
                    for h in histories.values():
                        h.plain(t.seconds)
                    llm.input_ids[n_past] = token
                    llm.n_tokens = n_past + 1
                    token = int(self.sampler.sample(ctx, -1))
                    continue
                rows = [token, *drafts]
                with Timer() as t:
                    batch.set_batch(batch=rows, n_past=n_past, logits_all=True)
                    ctx.decode(batch)
                for h in histories.values():  # the target's cost, whoever drafted
                    h.batch(len(rows), t.seconds)
                llm.input_ids[n_past:n_past + len(rows)] = rows
                accepted = 0
                token = int(self.sampler.sample(ctx, 0))
                while accepted < len(drafts) and token == drafts[accepted]:
                    accepted += 1
                    yield token
                    seq.append(token)
                    if drafter is not None:
                        drafter.extend((token,))
                    if engine.is_eog(token):
                        gov.record(len(drafts), accepted)
                        return
                    token = int(self.sampler.sample(ctx, accepted))
                gov.record(len(drafts), accepted)
                keep = n_past + 1 + accepted  # the last token and the kept drafts
                llm.n_tokens = keep
                if keep < n_past + len(rows):
                    lc.llama_memory_seq_rm(lc.llama_get_memory(engine.ctx), 0, keep, -1)
        finally:
            lookup.finish()
            if self.by_model is not None:
                self.by_model.finish()

    def _drafter(self, prompt: list[int]) -> NgramDrafter:
        """The prompt's n-gram counts: the last request's, extended by what this prompt
        adds to it, where it starts with that request's prompt and reply (a chat's next
        turn); counted afresh otherwise. Counting the whole prompt takes milliseconds per
        thousand tokens, so it waits until the first token is out (it is drawn from the
        prompt's logits: no draft needed)."""
        owner = self.owner
        drafter = resume(owner.ngrams if owner is not None else None, prompt)
        if owner is not None:
            owner.ngrams = drafter
        return drafter

    def report(self, stats: GenerationStats) -> None:
        """The request's figures from llama.cpp's counters: the prompt's as the plain path
        reports them; the decode's time is every decode after the prompt (verify batches
        count as prompts there), its tokens the reply's after the first."""
        n_prompt, t_prompt, t_eval = self._at_prompt
        perf = self.engine.lc.llama_perf_context(self.engine.ctx)
        stats.prefill_tokens = n_prompt
        stats.prefill_seconds = t_prompt / 1000.0 + self._draft_prefill
        n = max(stats.completion_tokens - 1, 0)
        stats.decode_tokens = n
        stats.decode_seconds = ((perf.t_p_eval_ms - t_prompt) + (perf.t_eval_ms - t_eval)
                                ) / 1000.0 + self._draft_decode if n else 0.0
        govs = [g for g in (self.governor, self.by_model) if g is not None]
        stats.drafted_tokens = sum(g.drafted for g in govs)
        stats.accepted_tokens = sum(g.accepted for g in govs)


def speculation_for(lc: Any, request: LoadRequest, engine: Engine, *, n_ctx: int,
                    opts: dict[str, Any]) -> Speculation | None:
    """The session's speculative decoding, from the load's ``speculative`` and
    ``draft_model`` (the draft loaded and checked now); None for a model whose state
    cannot be cut back to the drafts it keeps (recurrent and hybrid models)."""
    from localrun.sampling import check_speculative

    llm = engine.llm
    if getattr(llm, "_is_recurrent", False) or getattr(llm, "_is_hybrid", False):
        return None
    mode = check_speculative(request.speculative) or "auto"
    draft = None
    if request.draft_model:
        from localrun.backends.llama_cpp.draft import DraftModel

        draft = DraftModel(lc, request.draft_model, engine, n_ctx=n_ctx, opts=opts)
    elif mode == "draft":
        from localrun.errors import LocalrunError

        raise LocalrunError("speculative='draft' needs a draft model",
                            hint="pass draft_model= a smaller GGUF of the same family "
                                 "(localrun plan shows the catalog's), or "
                                 "speculative='prompt-lookup'")
    return Speculation(mode, draft=draft, exact=bool(getattr(request, "exact", False)))
