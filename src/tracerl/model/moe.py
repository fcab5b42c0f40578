"""Routed experts: a softmax top-k router and SwiGLU experts computed grouped (dropless).

Shape legend (torchtitan style; a name's suffix spells its shape):
    B  batch rows                S  tokens per row (new tokens)     T = B * S tokens
    D  hidden size               E  experts                         K  experts per token (top-k)
    F  one expert's width        N = T * K routed (token, slot) pairs
    O, I  out / in features of one expert matrix (nn.Linear layout: weight is (O, I))

Dispatch: the (token, slot) pairs are sorted by expert (stable), so every expert's rows are one
contiguous group; `offsets_E` are the cumulative group ends. The two expert GEMMs go through the
single seam `experts_matmul(x_ND, w_EOI, offsets_E)` (torch._grouped_mm where it runs, else one
GEMM per expert; never a loop over tokens). A fake-quant, recording or FP4-kernel path swaps in
there (`MoE.experts_matmul` can be replaced per instance).

Quant-site alignment (the rollout records per site, the trainer replays by position): the
gate_up input is the token's hidden state (B, S, D), quantized once per token before dispatch as
real FP4 MoE kernels do; the down input is shown to the handler as (B, S, K, F) in the token's
top-k slot order (unsorted from the grouped layout, then re-sorted). Expert weights are stacked
(E, 2F, D) and (E, D, F) and quantized along the last (input) dim, one global scale per expert.

Padding: routing is per token and dropless (no capacity), so a padded row cannot change which
experts, or what output, a real token gets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tracerl import qat
from tracerl.model.config import ModelConfig


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    torch._grouped_mm's backward rejects expanded (stride-0) gradients, e.g. from `out.sum()`.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)  # checked on torch 2.13 CPU, forward and backward
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def experts_matmul(x_ND: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM: rows offsets[e-1]:offsets[e] of x (N, I) times w[e].T -> (N, O).

    `offsets_E` is int32, the cumulative row count per expert (last entry N). Uses
    torch._grouped_mm when it supports the device/dtype, else one matmul per expert.
    """
    if _grouped_mm_supported(x_ND, w_EOI):
        y = torch._grouped_mm(x_ND.contiguous(), w_EOI.transpose(-2, -1), offs=offsets_E)
        return _ContiguousGrad.apply(y)
    return experts_matmul_loop(x_ND, w_EOI, offsets_E)


def experts_matmul_loop(x_ND: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Reference / fallback for `experts_matmul`: one GEMM per expert (syncs to read the offsets)."""
    ends = offsets_E.tolist()
    starts = [0] + ends[:-1]
    outs = [x_ND[s:e] @ w_EOI[i].transpose(0, 1) for i, (s, e) in enumerate(zip(starts, ends))]
    return torch.cat(outs, dim=0) if outs else x_ND.new_zeros(0, w_EOI.shape[1])


def gate_weights(
    logits_TE: torch.Tensor, expert_ids_TK: torch.Tensor, rule: str, norm_topk_prob: bool
) -> torch.Tensor:
    """Gate weights (T, K) of the chosen experts from the router logits (float32), differentiable.

    softmax_topk: softmax over all E, gather, renormalise if norm_topk_prob (Qwen3-MoE, OLMoE).
    topk_softmax: softmax over the K chosen logits only (Mixtral).
    """
    if rule == "topk_softmax":
        return torch.softmax(logits_TE.gather(-1, expert_ids_TK), dim=-1)
    probs_TK = torch.softmax(logits_TE, dim=-1).gather(-1, expert_ids_TK)
    if norm_topk_prob:
        probs_TK = probs_TK / probs_TK.sum(dim=-1, keepdim=True)
    return probs_TK


class Router(nn.Module):
    """Linear router (E, D) in float32; experts chosen by top-k of softmax(logits), or replayed."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.top_k
        self.rule = cfg.router
        self.norm_topk_prob = cfg.norm_topk_prob

    def forward(
        self, x_BSD: torch.Tensor, site: str, quant: qat.QuantHandler, replay_ids_TK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits_TE float32, expert_ids_TK int64, gate_weights_TK float32) for x (B, S, D)."""
        x_BSD = quant.act(f"{site}.input", x_BSD)
        w_ED = quant.weight(f"{site}.weight", self.weight.to(x_BSD.dtype))
        logits_TE = F.linear(x_BSD.reshape(-1, x_BSD.shape[-1]).float(), w_ED.float())
        if replay_ids_TK is None:
            with torch.no_grad():
                expert_ids_TK = torch.topk(torch.softmax(logits_TE, dim=-1), self.top_k, dim=-1).indices
        else:
            expert_ids_TK = replay_ids_TK
        return logits_TE, expert_ids_TK, gate_weights(logits_TE, expert_ids_TK, self.rule, self.norm_topk_prob)


class MoE(nn.Module):
    """Router + E SwiGLU experts with stacked weights w_gate_up (E, 2F, D) (gate rows first) and w_down (E, D, F)."""

    experts_matmul = staticmethod(experts_matmul)  # the seam; assign on an instance to override

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.prefix = f"layers.{layer_idx}.mlp"
        self.num_experts, self.top_k, self.expert_size = cfg.num_experts, cfg.top_k, cfg.expert_size
        self.router = Router(cfg)
        self.experts = Experts(cfg)

    def forward(
        self, x_BSD: torch.Tensor, quant: qat.QuantHandler, replay_ids_BSK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output (B, S, D) in x's dtype, expert_ids (B, S, K) int64)."""
        B, S, D = x_BSD.shape
        T, K, E, Fw = B * S, self.top_k, self.num_experts, self.expert_size
        dtype = x_BSD.dtype
        p = self.prefix
        replay_TK = None if replay_ids_BSK is None else replay_ids_BSK.reshape(T, K).to(torch.int64)
        _, expert_ids_TK, gate_TK = self.router(x_BSD, f"{p}.router", quant, replay_TK)

        # dispatch: sort (token, slot) pairs by expert; order_N[n] is the pair (t*K + k) at sorted row n
        expert_ids_N = expert_ids_TK.reshape(-1)
        order_N = torch.argsort(expert_ids_N, stable=True)
        unsort_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))
        # scatter_add, not bincount: bincount reads the ids' max on the host (two syncs per MoE
        # layer on CUDA, most of a decode step's remaining syncs); the counts are the same integers
        counts_E = torch.zeros(E, dtype=torch.long, device=expert_ids_N.device)
        offsets_E = counts_E.scatter_add_(0, expert_ids_N, torch.ones_like(expert_ids_N)).cumsum(0).to(torch.int32)

        x_BSD = quant.act(f"{p}.experts.gate_up.input", x_BSD)  # once per token, before dispatch
        w_gate_up_E2FD = quant.weight(f"{p}.experts.gate_up.weight", self.experts.w_gate_up.to(dtype))
        w_down_EDF = quant.weight(f"{p}.experts.down.weight", self.experts.w_down.to(dtype))

        x_ND = x_BSD.reshape(T, D)[order_N // K]
        h_N2F = self.experts_matmul(x_ND, w_gate_up_E2FD, offsets_E)
        gate_NF, up_NF = h_N2F.split(Fw, dim=-1)
        h_NF = F.silu(gate_NF) * up_NF
        h_BSKF = quant.act(f"{p}.experts.down.input", h_NF[unsort_N].reshape(B, S, K, Fw))
        y_ND = self.experts_matmul(h_BSKF.reshape(T * K, Fw)[order_N], w_down_EDF, offsets_E)

        y_TKD = y_ND[unsort_N].reshape(T, K, D)
        out_TD = (y_TKD.float() * gate_TK.unsqueeze(-1)).sum(dim=1)
        return out_TD.to(dtype).reshape(B, S, D), expert_ids_TK.reshape(B, S, K)


class Experts(nn.Module):
    """Holds the stacked expert weights (E, 2F, D) and (E, D, F)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, D, Fw = cfg.num_experts, cfg.hidden_size, cfg.expert_size
        self.w_gate_up = nn.Parameter(torch.empty(E, 2 * Fw, D))
        self.w_down = nn.Parameter(torch.empty(E, D, Fw))
