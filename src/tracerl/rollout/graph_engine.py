"""GraphEngine: the rollout engine's API (generate / continue_ / load_weights) on the GPU decoder.

`rollout.Engine` runs the model's own PyTorch forward (the reference: exact FP4 via `tracerl.fp4`,
any model the trainer runs, any sampler). On CUDA it is launch-bound: thousands of small ops per
decode step. GraphEngine runs the same rollouts on `GPUDecoder` (Triton FP4 kernels, FP4 weights
kept packed, one CUDA graph per decode step) and records what TRACE needs inside that graph:

- every sequence owns a slot (row) and advances one column per step from column 0, with its own
  position (no padding inside a row: the RolloutBatch is right-padded, which the trainer handles
  like the reference engine's left padding, since positions come from the attention mask);
- a prompt, or a multi-turn environment observation, is a queue of forced tokens that the step
  feeds before the slot samples again (teacher-forced decode steps; a real engine would prefill
  them in one forward: prompts here are short next to the responses);
- sampling, stop tokens, per-slot budgets, finished slots (which stop advancing) and the
  inf/NaN watch all run on the device; the host reads one flag copy every `check_every` steps;
- routing (top-k ids per layer) and each recorded site's FP4 codes, block scales and row global
  scales are written at (slot, column) inside the graph, into a `SiteRecorder` whose `finalize`
  builds the same GuidanceRecords as the reference engine's; the sites' quantize kernels store
  them in the same pass (a `RecordSink`: no launch of its own), routing by one index_copy_.

Numerics are GPUDecoder's (not bit-identical with the reference engine; see rollout/gpu.py), which is
what a production rollout engine is to its trainer: the records make the trainer follow it.

Supported: what GPUDecoder runs (MoE layers only, NVFP4, BF16 compute) with the `experts+kv` site
set; sampling with temperature (0 = greedy), no top-p / top-k; guidance encodings `codes` and `lsb`.
Anything else raises ValueError naming the setting to change (or use `rollout.engine: reference`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tracerl import fp4
from tracerl.guidance import CachePolicy
from tracerl.kernels.record_sink import RecordSink
from tracerl.model import RoutingRecord
from tracerl.qat import Recipe
from tracerl.rollout.batch import RolloutBatch
from tracerl.rollout.engine import check_ids, check_prompts
from tracerl.rollout.gpu import DecoderWeights, GPUDecoder, LayerWeights
from tracerl.rollout.recorder import SiteRecorder
from tracerl.rollout.sampling import SamplingParams

# recorded sites are written by their quantize kernel (kernels/record_sink.py); False: by the
# sink's index_copy_ after it (the earlier path, kept for A/B timing in bench/engine_rollout.py)
FUSED_RECORDING = True
MAX_STOP = 16  # stop token ids held in the step's static buffer
KEEP_DECODERS = 2  # decoders (KV cache, records, graph) kept per engine: RL samples, then evaluates greedily


def _sink_of(st, flat: torch.Tensor, **kw) -> RecordSink:
    """A RecordSink over a (contiguous) stage's buffers viewed as rows."""
    return RecordSink(st.codes.view(-1, st.codes.shape[-1]), st.scales.view(-1, st.scales.shape[-1]),
                      None if st.gscale is None else st.gscale.view(-1), flat, **kw)


class RecordingDecoder(GPUDecoder):
    """GPUDecoder whose step also feeds forced tokens, stops slots, and records routing and sites."""

    def __init__(self, weights: DecoderWeights, batch: int, max_len: int, *, temperature: float,
                 recorder: SiteRecorder, use_graph: bool | None = None) -> None:
        super().__init__(weights, batch, max_len, temperature=temperature, use_graph=use_graph)
        B, T, dev = batch, max_len, self.device
        cfg = weights.cfg
        self.recorder = recorder
        self.seq = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.mask = torch.zeros(B, T, dtype=torch.bool, device=dev)
        self.prompt_mask = torch.zeros(B, T, dtype=torch.bool, device=dev)
        self.policy_mask = torch.zeros(B, T, dtype=torch.bool, device=dev)
        self.logp = torch.zeros(B, T, dtype=torch.float32, device=dev)
        self.routing = torch.zeros(cfg.num_layers, B * T, cfg.top_k, dtype=torch.int32, device=dev)
        self.forced = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.n_forced = torch.zeros(B, dtype=torch.long, device=dev)
        self.i_forced = torch.zeros(B, dtype=torch.long, device=dev)
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
        self.budget = torch.zeros(B, dtype=torch.long, device=dev)
        self.stop = torch.full((MAX_STOP,), -1, dtype=torch.long, device=dev)
        self.bad = torch.zeros(1, dtype=torch.bool, device=dev)
        self.row_base = torch.arange(B, device=dev) * T
        self.flat = torch.zeros(B, dtype=torch.long, device=dev)  # slot * T + pos, this step
        self.calls = 0  # generate() calls served: a batch can be continued until the next one
        self.prompt_index = torch.arange(B, device=dev)  # GRPO group of each slot, set by generate()

    def _state(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.pos, self.seed, self.seq, self.mask, self.policy_mask, self.logp, self.i_forced,
                self.budget, self.active, self.finished, self.bad)

    def capture(self) -> None:
        """GPUDecoder.capture, restoring all of the step's state after its eager warm-up step.

        The warm-up also writes the KV cache and the records at each slot's column: the first
        replay rewrites them with the same values (same inputs, same computation).
        """
        if not self.use_graph:
            return
        saved = [t.clone() for t in self._state()]
        super().capture()
        for t, v in zip(self._state(), saved, strict=True):
            t.copy_(v)

    # ------------------------------------------------------------------ in the captured step

    def _quantize(self, x: torch.Tensor, sink: RecordSink | None,
                  dequant_out: torch.Tensor | None = None) -> fp4.FP4Tensor:
        if sink is None or FUSED_RECORDING:
            return super()._quantize(x, sink, dequant_out)
        q = super()._quantize(x, None, dequant_out)
        sink.write(q)
        return q

    def _sink(self, site: str, x: torch.Tensor, pairs: torch.Tensor | None) -> RecordSink | None:
        if not self.recorder.wants(site):
            return None
        K = x.shape[-1]
        if pairs is None:  # token rows: (slot, column)
            return _sink_of(self.recorder.stage(site, K, (), x.device), self.flat)
        k = self.cfg.top_k  # expert-sorted (token, k) pairs: (slot, column, k)
        return _sink_of(self.recorder.stage(site, K, (k,), x.device), self.flat, src=pairs, group=k)

    def _kv_sink(self, layer: int, kv: torch.Tensor) -> RecordSink | None:
        sites = (f"layers.{layer}.attn.k_cache", f"layers.{layer}.attn.v_cache")
        if not any(self.recorder.wants(s) for s in sites):
            return None
        _, B, Hkv, Dh = kv.shape  # rows (k|v, slot, kv head) -> one (2, slots, max_len, Hkv) group
        g = self.recorder.stage_group(sites, Dh, (Hkv,), kv.device)
        return _sink_of(g, self.flat, group=Hkv, plane_rows=B * Hkv, plane_stride=g.codes[0].numel() // (Dh // 2))

    def _watch(self, site: str, x: torch.Tensor) -> None:
        # on the device, read at the next poll: quantization can turn inf/NaN into finite codes, so
        # the logits alone may look fine (as the reference engine's FiniteWatch)
        self.bad |= (~torch.isfinite(x)).any().reshape(1)

    def _observe_routing(self, layer: int, ids: torch.Tensor) -> None:
        self.routing[layer].index_copy_(0, self.flat, ids)

    def _step(self) -> None:
        self.flat.copy_(self.row_base + self.pos.long())
        super()._step()

    def _advance(self) -> None:
        """Next inputs: a forced token while the slot has some queued, else the sampled one."""
        T = self.max_len
        act = self.active
        self.bad |= (act & ~torch.isfinite(self.logits).all(-1)).any().reshape(1)
        col = self.pos.long() + 1
        has_f = self.i_forced < self.n_forced
        ftok = self.forced.gather(1, self.i_forced.clamp(max=T - 1)[:, None])[:, 0]
        sampled = act & ~has_f
        nxt = torch.where(has_f, ftok, self.next_tokens)
        flat = self.row_base + col.clamp(max=T - 1)
        _put(self.seq, flat, nxt, act)
        _put(self.mask, flat, torch.ones_like(act), act)
        _put(self.policy_mask, flat, torch.ones_like(act), sampled)
        _put(self.logp, flat, self.logprobs, sampled)
        self.i_forced += (act & has_f).long()
        self.budget -= sampled.long()
        stopped = sampled & (self.next_tokens[:, None] == self.stop[None]).any(-1)
        self.finished |= stopped
        done = stopped | (sampled & (self.budget <= 0)) | (act & (col >= T - 1))
        self.tokens.copy_(torch.where(act, nxt, self.tokens))
        self.pos.add_(act.int())
        self.active &= ~done
        self.seed.add_(1)


def philox_key(seed: int) -> int:
    """The sampler's 64-bit Philox key at a call's first step: a 31-bit mix of the seed (splitmix64)
    in the high word, the step (+1 per decode step) in the low word.

    With the seed itself as the key, calls with nearby seeds would share keys a few steps apart
    (collect passes seed + turn to each turn of an episode) and a later turn would re-draw an
    earlier turn's noise. Two calls now share a key only if their seeds' mixes are equal."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((z ^ (z >> 31)) & 0x7FFFFFFF) << 32


def _put(buf: torch.Tensor, flat: torch.Tensor, val: torch.Tensor, where: torch.Tensor) -> None:
    """buf.view(-1)[flat] = val where `where` (a read-modify-write, so it can be graph-captured)."""
    v = buf.view(-1)
    v.index_copy_(0, flat, torch.where(where, val.to(buf.dtype), v[flat]))


@dataclass
class _GraphState:
    """What continue_ needs from a generate(): which decoder call the batch came from."""

    decoder: RecordingDecoder
    call: int


class GraphEngine:
    """Rollouts on the GPU decoder with recording (see the module docstring); Engine's API."""

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
        check_every: int = 8,
        use_graph: bool | None = None,
    ) -> None:
        self.recipe = recipe if isinstance(recipe, Recipe) else Recipe(recipe)
        self.policy = cache_policy
        self.config = model.config
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_len = max_len or self.config.max_seq_len
        self.diagnostics = diagnostics
        self.check_every = check_every
        self.use_graph = use_graph
        if dtype != torch.bfloat16:
            raise ValueError(f"the graph engine computes in bfloat16, not {dtype}; use rollout.engine: reference")
        if self.recipe.acts and self.recipe.sites != "experts+kv" and (diagnostics or cache_policy is not None):
            raise ValueError(f"the graph engine records the experts+kv sites only, not {self.recipe.sites!r}; "
                             "use rollout.sites: experts+kv or rollout.engine: reference")
        if cache_policy is not None and cache_policy.encoding == "ties":
            raise ValueError("the graph engine records guidance as codes or lsb, not ties; "
                             "set guidance.encoding or use rollout.engine: reference")
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.weights: DecoderWeights | None = None
        # (slots, temperature) -> decoder with its graph; RL alternates two (sampling, greedy eval)
        self._decoders: dict[tuple[int, float], RecordingDecoder] = {}
        self.load_weights(model.pack_weights(self.recipe, dtype=torch.bfloat16))

    # ------------------------------------------------------------------ weights

    def load_weights(self, packed) -> None:
        """Swap in a step's PackedWeights, copied into the decoder's tensors (captured graphs stay valid)."""
        if getattr(packed, "recipe", self.recipe) != self.recipe:
            raise ValueError(f"PackedWeights were packed for {packed.recipe}, the engine runs {self.recipe}")
        new = DecoderWeights.from_packed(self.config, packed, device=self.device)
        if self.weights is None:
            self.weights = new
            return
        _copy_weights(self.weights, new)

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, *, seed: int = 0) -> RolloutBatch:
        """Sample `params.n` completions per prompt; returns a RolloutBatch of len(prompts) * n rows."""
        params = params or SamplingParams()
        self._check_params(params)
        check_prompts(prompts, params, self.config.vocab_size, self.max_len)
        t0 = time.perf_counter()
        rows = [p for p in prompts for _ in range(params.n)]
        dec = self._decoder_for(len(rows), params.temperature)
        dec.calls += 1
        self._reset(dec)
        B, T = dec.B, dec.max_len
        forced = torch.zeros(B, T, dtype=torch.long)
        lens = torch.tensor([len(p) for p in rows])
        for i, p in enumerate(rows):
            forced[i, :len(p)] = torch.tensor(p)
        dec.forced.copy_(forced)
        dec.n_forced.copy_(lens)
        dec.prompt_mask.copy_(torch.arange(T)[None] < lens[:, None])
        dec.i_forced.fill_(1)
        dec.tokens.copy_(forced[:, 0])
        dec.seq[:, 0] = dec.tokens
        dec.mask[:, 0] = True
        dec.pos.zero_()
        self._start(dec, torch.ones(B, dtype=torch.bool), params, seed)
        dec.prompt_index = torch.arange(len(prompts), device=self.device).repeat_interleave(params.n)
        return self._finish(dec, t0)

    @torch.no_grad()
    def continue_(self, batch: RolloutBatch, appended: list[list[int] | None], params: SamplingParams | None = None,
                  *, seed: int = 0) -> RolloutBatch:
        """Append environment tokens to live sequences (None = sequence is over) and keep decoding.

        The appended tokens are fed teacher-forced and masked out of `policy_mask`; then the policy
        samples its next turn with `params` (n must be 1).
        """
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("continue_ samples one continuation per live sequence; use n=1")
        self._check_params(params)
        st = batch._state
        if not isinstance(st, _GraphState):
            raise ValueError("this RolloutBatch has no graph-engine state (it was sliced, finalised or made by "
                             "another engine); cannot continue it")
        dec = st.decoder
        if st.call != dec.calls or self._decoders.get((dec.B, dec.temperature)) is not dec:
            raise ValueError("this RolloutBatch's slots were reused by a later generate(); continue a batch "
                             "before generating the next one")
        if len(appended) != dec.B:
            raise ValueError(f"appended has {len(appended)} entries for a batch of {dec.B} sequences")
        if params.temperature != dec.temperature:
            raise ValueError(f"continue_ samples at the batch's temperature {dec.temperature}, "
                             f"got {params.temperature}")
        t0 = time.perf_counter()
        pos = dec.pos.tolist()
        for i, a in enumerate(appended):
            if a is None:
                continue
            if a:
                check_ids(a, f"appended[{i}]", self.config.vocab_size)
            need = pos[i] + 1 + len(a) + params.max_new_tokens
            if need > dec.max_len:
                raise ValueError(f"continuing sequence {i} needs {need} columns, the engine's max_len is {dec.max_len}")
        B, T = dec.B, dec.max_len
        live = torch.tensor([a is not None for a in appended])
        forced = torch.zeros(B, T, dtype=torch.long)
        lens = torch.zeros(B, dtype=torch.long)
        for i, a in enumerate(appended):
            if a:
                forced[i, :len(a)] = torch.tensor(a)
                lens[i] = len(a)
        dev = self.device
        # a step feeds each slot's input at its pos, then samples: a slot with an observation moves
        # to the next column with the observation's first token as input; a live slot without one
        # re-feeds its last token at its own column (the identical computation: its cache column and
        # records are rewritten unchanged) and samples from the logits that gives
        has = (lens > 0).to(dev) & live.to(dev)
        p = dec.pos.long()
        first = forced[:, 0].to(dev)
        flat = dec.row_base + (p + 1).clamp(max=T - 1)
        _put(dec.seq, flat, first, has)
        _put(dec.mask, flat, torch.ones_like(has), has)
        dec.tokens.copy_(torch.where(has, first, dec.tokens))
        dec.pos.add_(has.int())
        dec.forced.copy_(forced)
        dec.n_forced.copy_(lens)
        dec.i_forced.copy_(torch.where(has, 1, 0).long())
        dec.finished &= ~live.to(dev)
        self._start(dec, live, params, seed)
        return self._finish(dec, t0)

    # ------------------------------------------------------------------ internals

    def _check_params(self, params: SamplingParams) -> None:
        if params.top_p < 1 or params.top_k > 0:
            raise ValueError("the graph engine samples the full tempered distribution (no top_p / top_k); "
                             "use rollout.engine: reference for truncated sampling")
        if len(params.stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop tokens, got {len(params.stop)}")

    def _decoder_for(self, n_rows: int, temperature: float) -> RecordingDecoder:
        """The decoder of this batch size and temperature, kept with its graph (the latest KEEP of them)."""
        key = (n_rows, temperature)
        d = self._decoders.pop(key, None)
        if d is None:
            while len(self._decoders) >= KEEP_DECODERS:  # free an old cache before allocating a new one
                self._decoders.pop(next(iter(self._decoders)))
            rec = SiteRecorder(self.recipe, self.policy, self.config.num_layers, n_rows, self.max_len,
                               self.diagnostics)
            d = RecordingDecoder(self.weights, n_rows, self.max_len, temperature=temperature, recorder=rec,
                                 use_graph=self.use_graph)
        self._decoders[key] = d  # most recently used last
        return d

    def _reset(self, dec: RecordingDecoder) -> None:
        for t in (dec.seq, dec.mask, dec.prompt_mask, dec.policy_mask, dec.logp, dec.routing, dec.finished,
                  dec.bad):
            t.zero_()
        dec.recorder.clear()

    def _start(self, dec: RecordingDecoder, live: torch.Tensor, params: SamplingParams, seed: int) -> None:
        """Decode until every live slot stops, polling the device every `check_every` steps."""
        dev = self.device
        dec.active.copy_(live.to(dev))
        dec.budget.fill_(params.max_new_tokens)
        stop = list(params.stop) + [-1] * (MAX_STOP - len(params.stop))
        dec.stop.copy_(torch.tensor(stop))
        dec.seed.fill_(philox_key(seed))
        while True:
            for _ in range(self.check_every):
                dec.step()
            running, bad = torch.cat([dec.active.any().reshape(1), dec.bad]).tolist()
            if bad:
                raise ValueError(
                    "rollout: activations or logits became non-finite (inf/NaN); no tokens are returned. Check "
                    "the model weights / checkpoint for NaN or inf (e.g. after a diverged training step) and that "
                    "activations fit bfloat16")
            if not running:
                break
        # a slot that stopped in the last step has not fed its last token yet (finished slots
        # re-feed theirs at their own column: the same computation, records rewritten unchanged)
        dec.step()

    def _finish(self, dec: RecordingDecoder, t0: float) -> RolloutBatch:
        length = int(dec.pos.max()) + 1
        valid = dec.mask[:, :length]
        records, reference, bpt = dec.recorder.finalize(length, valid, copy=True)
        L, K = self.config.num_layers, self.config.top_k
        ids = dec.routing.view(L, dec.B, dec.max_len, K)[:, :, :length].long()
        batch = RolloutBatch(
            tokens=dec.seq[:, :length].clone(), attention_mask=valid.clone(),
            prompt_mask=dec.prompt_mask[:, :length].clone(), policy_mask=dec.policy_mask[:, :length].clone(),
            logprobs=dec.logp[:, :length].clone(), prompt_index=dec.prompt_index.clone(),
            routing=RoutingRecord(ids, self.config.moe_layers, self.config.num_experts),
            guidance=records, reference=reference, guidance_bytes_per_token=bpt, finished=dec.finished.clone(),
            _state=_GraphState(dec, dec.calls),
        )
        dt = time.perf_counter() - t0
        batch.stats = {"rollout_s": dt, "generated_tokens": batch.n_generated,
                       "tok_per_s": batch.n_generated / max(dt, 1e-9)}
        return batch


def _copy_weights(dst: DecoderWeights, src: DecoderWeights) -> None:
    """Copy src's values into dst's tensors in place (the addresses a captured graph reads)."""

    def copy(a, b):
        if a is None:
            return
        if isinstance(a, fp4.FP4Tensor):
            a.codes.copy_(b.codes)
            a.scales.copy_(b.scales)
            if a.global_scale is not None:
                a.global_scale.copy_(b.global_scale)
        else:
            a.copy_(b)

    for name in ("embed", "lm_head", "final_norm"):
        copy(getattr(dst, name), getattr(src, name))
    for a, b in zip(dst.layers, src.layers, strict=True):
        for f in LayerWeights.__dataclass_fields__:
            copy(getattr(a, f), getattr(b, f))
