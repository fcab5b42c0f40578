"""The rollout engine: batched generation in BF16 or FP4 with a KV cache, recording what TRACE needs.

It runs the real incremental computation of an inference engine: one prefill over the (left-padded)
prompts, then one new token per step against the KV cache; it never calls the trainer's
full-sequence forward over the generated text. That difference in computation (and in batch
shapes) is the honest source of the train/rollout mismatch that TRACE measures and removes.

Weights come as PackedWeights (`model.pack_weights(recipe)`): FP4Tensors for the quantized sites,
so the engine's FP4 weights are bit-identical to the trainer's fake-quantized weights, and plain
copies for everything else. On CPU the FP4 weights are dequantized once per `load_weights` (the
PyTorch reference path); GPU kernels that never materialise them are a separate backend.

Slots: each sequence owns a row of the KV cache and of the record buffers; all rows advance in
lockstep columns, finished rows stop being computed, and (multi-turn) `continue_` appends
environment tokens that the engine feeds teacher-forced before the policy samples again.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from tracerl import fp4
from tracerl.guidance import CachePolicy
from tracerl.qat import Recipe
from tracerl.rollout.batch import RolloutBatch
from tracerl.rollout.kvcache import DenseKVCache, FP4KVCache
from tracerl.rollout.recorder import FiniteWatch, RolloutQuant, SiteRecorder
from tracerl.rollout.sampling import SamplingParams, sample


def check_prompts(prompts: list[list[int]], params: SamplingParams, vocab_size: int, max_len: int) -> None:
    """Raise ValueError for no prompts, an empty one, ids outside the vocabulary, or no room for the response."""
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
        check_ids(p, f"prompt {i}", vocab_size)
    longest = max(len(p) for p in prompts)
    if longest + params.max_new_tokens > max_len:
        raise ValueError(
            f"prompt length {longest} + max_new_tokens {params.max_new_tokens} exceeds the context "
            f"({max_len}); shorten the prompt or max_new_tokens, or raise max_len"
        )


def check_ids(ids: list[int], what: str, vocab_size: int) -> None:
    """Raise ValueError if a token id lies outside [0, vocab_size)."""
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"{what} has token ids outside [0, {vocab_size})")


@dataclass
class _GenState:
    tokens: torch.Tensor  # (B, max_len)
    mask: torch.Tensor
    prompt_mask: torch.Tensor
    policy_mask: torch.Tensor
    logprobs: torch.Tensor
    routing: torch.Tensor | None  # (L, B, max_len, K)
    prompt_index: torch.Tensor
    cache: DenseKVCache | FP4KVCache
    recorder: SiteRecorder
    next_logits: torch.Tensor  # (B, V) float32: logits after each row's last fed token
    cur: int  # next column to write
    finished: torch.Tensor  # (B,) stopped by a stop token
    finite: FiniteWatch  # inf/NaN flags of the forwards not yet read on the host


class Engine:
    """Generate completions like an RL rollout worker; record routing and guidance."""

    def __init__(
        self,
        model: torch.nn.Module,
        recipe: Recipe | str = "bf16",
        cache_policy: CachePolicy | None = None,
        *,
        max_len: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        diagnostics: bool = False,
    ) -> None:
        self.recipe = recipe if isinstance(recipe, Recipe) else Recipe(recipe)
        self.policy = cache_policy
        self.config = model.config
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_len = max_len or self.config.max_seq_len
        self.diagnostics = diagnostics
        # the engine owns its copy of the architecture; weights arrive through load_weights
        self.model = copy.deepcopy(model).to(device=self.device, dtype=dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._weights: dict[str, torch.Tensor] = {}
        self.load_weights(model.pack_weights(self.recipe, dtype=dtype))

    # ------------------------------------------------------------------ weights

    def load_weights(self, packed) -> None:
        """Swap in a step's PackedWeights (no re-quantization; the KV cache is per call, not reallocated here)."""
        if getattr(packed, "recipe", self.recipe) != self.recipe:
            raise ValueError(f"PackedWeights were packed for {packed.recipe}, the engine runs {self.recipe}")
        params = dict(self.model.named_parameters())
        sites = self.model.weight_sites()  # weight site -> parameter name
        weights: dict[str, torch.Tensor] = {}
        for name, t in packed.items():
            if isinstance(t, fp4.FP4Tensor):
                weights[name] = fp4.dequantize(t.to(self.device), self.dtype)
                continue
            pname = sites.get(name, name)
            if pname not in params:
                raise KeyError(f"PackedWeights entry {name!r} matches no engine parameter or quant site")
            params[pname].copy_(t.to(device=self.device, dtype=self.dtype))
        self._weights = weights

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, *, seed: int = 0) -> RolloutBatch:
        """Sample `params.n` completions per prompt; returns a RolloutBatch of len(prompts) * n rows."""
        params = params or SamplingParams()
        check_prompts(prompts, params, self.config.vocab_size, self.max_len)
        t0 = time.perf_counter()
        n_prompts, n = len(prompts), params.n
        p_len = max(len(p) for p in prompts)
        st = self._new_state(n_prompts, p_len, prompts)
        # prefill the unique prompts once, then give each of the n samples its own slot
        rows = torch.arange(n_prompts, device=self.device)
        logits = self._forward(st, rows, 0, p_len)
        st.next_logits[:n_prompts] = logits[:, -1].float()
        index = torch.arange(n_prompts, device=self.device).repeat_interleave(n)
        self._expand(st, index)
        st.cur = p_len
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self._decode(st, torch.ones(len(index), dtype=torch.bool, device=self.device), params, gen)
        return self._finish(st, t0)

    @torch.no_grad()
    def continue_(self, batch: RolloutBatch, appended: list[list[int] | None], params: SamplingParams | None = None,
                  *, seed: int = 0) -> RolloutBatch:
        """Append environment tokens to live sequences (None = sequence is over) and keep decoding.

        The appended tokens are fed through the KV cache teacher-forced (one forward for all
        live sequences), masked out of `policy_mask`; then the policy samples its next turn with
        `params` (n must be 1).
        """
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("continue_ samples one continuation per live sequence; use n=1")
        st: _GenState = batch._state
        if st is None:
            raise ValueError("this RolloutBatch has no engine state (it was sliced or finalised); cannot continue it")
        if len(appended) != st.tokens.shape[0]:
            raise ValueError(f"appended has {len(appended)} entries for a batch of {st.tokens.shape[0]} sequences")
        t0 = time.perf_counter()
        live = torch.tensor([a is not None for a in appended], device=self.device)
        need = max((len(a) for a in appended if a is not None), default=0) + params.max_new_tokens
        if st.cur + need > self.max_len:
            raise ValueError(f"continuing needs {st.cur + need} columns, the engine's max_len is {self.max_len}")
        for i, a in enumerate(appended):
            if a:
                check_ids(a, f"appended[{i}]", self.config.vocab_size)
        st.finished &= ~live
        self._feed(st, appended)
        self._decode(st, live, params, torch.Generator(device=self.device).manual_seed(seed))
        return self._finish(st, t0)

    # ------------------------------------------------------------------ internals

    def _new_state(self, n_rows: int, p_len: int, prompts: list[list[int]]) -> _GenState:
        cfg, dev, L = self.config, self.device, self.max_len
        # built on the host and copied once: a host tensor per prompt is a synchronous copy each on CUDA
        tokens = torch.zeros(n_rows, L, dtype=torch.long)
        mask = torch.zeros(n_rows, L, dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding: prompts end at column p_len - 1
            tokens[i, p_len - len(p):p_len] = torch.tensor(p)
            mask[i, p_len - len(p):p_len] = True
        tokens, mask = tokens.to(dev), mask.to(dev)
        recorder = SiteRecorder(self.recipe, self.policy, cfg.num_layers, n_rows, L, self.diagnostics)
        finite = FiniteWatch()
        shape = (cfg.num_layers, n_rows, L, cfg.num_kv_heads, cfg.head_dim)
        if self.recipe.kv:
            cache = FP4KVCache(*shape, fmt=self.recipe.fmt, dtype=self.dtype, device=dev, observer=recorder,
                               finite=finite)
        else:
            cache = DenseKVCache(*shape, dtype=self.dtype, device=dev)
        return _GenState(
            tokens=tokens, mask=mask, prompt_mask=mask.clone(),
            policy_mask=torch.zeros_like(mask), logprobs=torch.zeros(n_rows, L, device=dev),
            routing=None, prompt_index=torch.arange(n_rows, device=dev), cache=cache, recorder=recorder,
            next_logits=torch.zeros(n_rows, cfg.vocab_size, device=dev), cur=0,
            finished=torch.zeros(n_rows, dtype=torch.bool, device=dev), finite=finite,
        )

    def _expand(self, st: _GenState, index: torch.Tensor) -> None:
        for name in ("tokens", "mask", "prompt_mask", "policy_mask", "logprobs", "prompt_index", "next_logits", "finished"):
            setattr(st, name, getattr(st, name)[index].clone())
        if st.routing is not None:
            st.routing = st.routing[:, index].clone()
        st.cache.expand(index)
        st.recorder.expand(index)

    def _forward(self, st: _GenState, rows: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Run slots `rows` on columns [start, end) against the cache; stage routing; return logits."""
        st.cache.set_step(rows, start)
        st.recorder.set_step(rows, start)
        handler = RolloutQuant(self.recipe, self._weights, st.recorder, st.finite)
        mask = st.mask[rows, :end]
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:end]
        out = self.model(
            st.tokens[rows, start:end], attention_mask=mask, position_ids=positions,
            quant=handler, kv_cache=st.cache, return_routing=True,
        )
        ids = out.routing.expert_ids  # (L, B_rows, S_new, K)
        if st.routing is None:
            L, _, _, K = ids.shape
            st.routing = torch.zeros(L, st.tokens.shape[0], self.max_len, K, dtype=ids.dtype, device=self.device)
        st.routing[:, rows, start:end] = ids
        # the logits too: a bf16 recipe has no quant site, and only the last column is sampled from
        st.finite.note("logits", out.logits[:, -1])
        return out.logits

    def _feed(self, st: _GenState, appended: list[list[int] | None]) -> None:
        """Teacher-force the live sequences' environment tokens in one forward.

        One forward per turn instead of one decode step per environment token (a maze observation
        is ~30 tokens, a tool output can be thousands). Observations are right-aligned in a block of
        columns: a shorter one leaves masked columns before it (as prompts are left-padded), so the
        block's last column is every row's last token and its logits are the next turn's.
        """
        idx = [i for i, a in enumerate(appended) if a]
        if not idx:
            return
        n, c = max(len(appended[i]) for i in idx), st.cur
        toks = torch.zeros(len(idx), n, dtype=torch.long)
        mask = torch.zeros(len(idx), n, dtype=torch.bool)
        for j, i in enumerate(idx):
            a = appended[i]
            toks[j, n - len(a):] = torch.tensor(a)
            mask[j, n - len(a):] = True
        rows = self._to_device(idx)
        st.tokens[rows, c:c + n] = toks.to(self.device)
        st.mask[rows, c:c + n] = mask.to(self.device)
        st.finite.label = f"environment tokens (columns {c}-{c + n - 1})"
        logits = self._forward(st, rows, c, c + n)
        st.next_logits[rows] = logits[:, -1].float()
        st.cur += n

    def _poll(self, st: _GenState, active: torch.Tensor) -> list[int]:
        """The active slots' indices; raises ValueError if a forward since the last poll went non-finite.

        One host copy holds both (a sync on CUDA): neither the finiteness check nor finding the
        running slots costs a sync of its own.
        """
        flags = st.finite.take()
        host = torch.cat([active, *flags]).tolist() if flags else active.tolist()
        st.finite.check(host[len(active):])
        return [i for i, a in enumerate(host[:len(active)]) if a]

    def _decode(self, st: _GenState, active: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> None:
        """Sample from every active slot until each hits a stop token or its budget (or the context ends)."""
        budget = torch.full((len(active),), params.max_new_tokens, device=self.device)
        stop = torch.tensor(params.stop or [-1], device=self.device)
        active = active.clone()
        step, rows, rows_of = 0, None, None
        # polled before every sample and after the last forward, so no token comes from a non-finite forward;
        # the per-step updates below index with the slot list and mask with tensors: no further host syncs
        while (running := self._poll(st, active)) and st.cur < self.max_len:
            step += 1
            if running != rows_of:  # the slot list changes only when a row stops: copy it then, not per step
                rows, rows_of = self._to_device(running), running
            tok, lp = sample(st.next_logits[rows], params, gen)
            c = st.cur
            st.tokens[rows, c] = tok
            # index_fill_ passes True as a kernel argument; `x[rows, c] = True` makes a host tensor of
            # it, a synchronous copy per step on CUDA
            st.mask[:, c].index_fill_(0, rows, True)
            st.policy_mask[:, c].index_fill_(0, rows, True)
            st.logprobs[rows, c] = lp
            budget[rows] -= 1
            hit_stop = torch.isin(tok, stop)
            st.finished[rows] |= hit_stop
            # the last token is fed too, so the cache is complete if the episode continues
            st.finite.label = f"decode step {step} (column {c})"
            logits = self._forward(st, rows, c, c + 1)
            st.next_logits[rows] = logits[:, -1].float()
            active[rows] &= ~(hit_stop | (budget[rows] <= 0))
            st.cur += 1

    def _to_device(self, ids: list[int]) -> torch.Tensor:
        """int64 tensor of `ids` on the engine's device; on CUDA from pinned memory, so the copy does not sync."""
        t = torch.tensor(ids, dtype=torch.long)
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _finish(self, st: _GenState, t0: float) -> RolloutBatch:
        length = st.cur
        valid = st.mask[:, :length]
        records, reference, bpt = st.recorder.finalize(length, valid)
        from tracerl.model import RoutingRecord

        batch = RolloutBatch(
            tokens=st.tokens[:, :length].clone(), attention_mask=valid.clone(),
            prompt_mask=st.prompt_mask[:, :length].clone(), policy_mask=st.policy_mask[:, :length].clone(),
            logprobs=st.logprobs[:, :length].clone(), prompt_index=st.prompt_index.clone(),
            routing=RoutingRecord(st.routing[:, :, :length].clone(), self.config.moe_layers, self.config.num_experts)
            if st.routing is not None else None,
            guidance=records, reference=reference, guidance_bytes_per_token=bpt, finished=st.finished.clone(),
            _state=st,
        )
        dt = time.perf_counter() - t0
        batch.stats = {"rollout_s": dt, "generated_tokens": batch.n_generated,
                       "tok_per_s": batch.n_generated / max(dt, 1e-9)}
        return batch
